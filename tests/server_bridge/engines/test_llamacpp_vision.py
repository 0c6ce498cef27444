"""The llamacpp engine with a vision projector: a prompt's image marker expands to the image's positions.

On the test VLM (tests/models/make_test_vlm.py: a random SmolVLM, its f32 GGUF and mmproj by llama.cpp's own
converter) the engine must compute what libmtmd computes on its own for the whole prompt, place the
text after an image at the right positions, roll back across and before an image, and refuse what it
cannot read (corrupt bytes, another model's projector, images on a text-only engine) with the reason.
"""

import numpy as np
import pytest

from protocol import modelfiles
from protocol.images import PromptImage
from runtime.vision import CACHED, UnknownImage
from server_bridge.engines import Pass, load_engine
from server_bridge.engines.llamacpp import LlamaCppEngine
from tests.models import make_test_vlm as tv
from tests.server_bridge.engines.vision_setup import CORRUPT_JPEG, TAIL, decoded, encoded, open_with, prompt, vlm

pytestmark = pytest.mark.real
__all__ = ["vlm"]  # the shared fixture, used by name


@pytest.fixture(scope="module")
def engine(vlm):
    return load_engine(
        str(vlm.target), engine="llamacpp", threads=1, max_sequences=8, kv_tokens=1024, mmproj=vlm.target_mmproj
    )


def test_an_image_expands_to_libmtmds_positions_and_the_logits_are_libmtmds(vlm, engine):
    assert engine.info.extra["vision"] is True and engine.image_token_id == vlm.image_token_id
    data = encoded(0)
    seq, ids, images, row = open_with(engine, data)
    ref = tv.llama_logits(vlm.target, vlm.target_mmproj, tv.random_image(0))
    # a 128 x 128 image: 2 x 2 tiles and the overview, 4 embeddings each, in 13 of SmolVLM's text tokens
    assert engine.vision.positions(images[ids.index(vlm.image_token_id)]) == 33
    assert seq.length == len(ids) and engine.kv_used == ref.n_pos == len(ids) + 32
    assert np.abs(row - ref.logits).max() < 1e-4
    engine.free(seq)


def test_a_jpeg_is_read_as_its_pixels(vlm, engine):
    data = encoded(0, "JPEG")
    seq, _, _, row = open_with(engine, data)
    ref = tv.llama_logits(vlm.target, vlm.target_mmproj, decoded(data))
    assert np.abs(row - ref.logits).max() < 2e-3  # libmtmd's decoder against PIL's: a pixel's rounding
    engine.free(seq)


def test_two_images_give_different_logits(engine):
    a, _, _, row_a = open_with(engine, encoded(0))
    b, _, _, row_b = open_with(engine, encoded(1))
    assert np.abs(row_a - row_b).max() > 1e-2
    engine.free(a)
    engine.free(b)


def test_an_image_as_the_last_kept_row_gives_the_logits_after_the_image(vlm, engine):
    seq, ids, _, row = open_with(engine, encoded(0), "User:<image>")
    assert ids[-1] == vlm.image_token_id
    ref = tv.llama_logits(vlm.target, vlm.target_mmproj, tv.random_image(0), prompt="User:<image>")
    assert np.abs(row - ref.logits).max() < 1e-4
    engine.free(seq)


def test_text_after_the_image_sits_at_the_positions_after_it(vlm, engine):
    seq, ids, _, _ = open_with(engine, encoded(0))
    more = engine.tokenizer.encode(tv.PROMPT + TAIL)
    assert more[: len(ids)] == ids and len(more) == len(ids) + 3
    tail = more[len(ids) :]
    [verify] = engine.forward([Pass(seq, len(ids), tail, 3)])  # [3, vocab] in one pass
    singles = [engine.forward([Pass(seq, len(ids) + k, [t], 1)])[0][0] for k, t in enumerate(tail)]
    assert np.abs(verify - np.stack(singles)).max() < 1e-3
    ref = tv.llama_logits(vlm.target, vlm.target_mmproj, tv.random_image(0), prompt=tv.PROMPT + TAIL)
    assert np.abs(verify[-1] - ref.logits).max() < 1e-4
    assert seq.length == len(more) and engine.kv_used == len(more) + 32
    engine.free(seq)


def test_a_sequence_rolls_back_after_and_before_its_image(engine):
    seq, ids, images, row = open_with(engine, encoded(0))
    tail = engine.tokenizer.encode(tv.PROMPT + TAIL)[len(ids) :]
    [first] = engine.forward([Pass(seq, len(ids), tail, 3)])
    engine.truncate(seq, len(ids))  # after the image: it stays
    assert engine.kv_used == len(ids) + 32
    [again] = engine.forward([Pass(seq, len(ids), tail, 3)])
    assert np.abs(again - first).max() < 1e-5
    at = next(iter(images))
    engine.truncate(seq, at)  # before it: its positions go
    assert seq.length == at and engine.kv_used == at
    [rows] = engine.forward([Pass(seq, at, ids[at:], 1, images={0: images[at]})])
    assert np.abs(rows[0] - row).max() < 1e-4
    engine.free(seq)
    fresh = engine.new_sequence()
    engine.forward([Pass(fresh, 0, [11, 12], 1)])  # its cells went back
    assert engine.kv_used == 2
    engine.free(fresh)


def test_an_image_pass_in_a_batch_leaves_the_other_sessions_as_they_were(engine):
    text = engine.tokenizer.encode("The robot walked to the kitchen door and")
    alone = engine.new_sequence()
    [ref_text] = engine.forward([Pass(alone, 0, text, 2)])
    image, _, _, ref_image = open_with(engine, encoded(0))
    a, b = engine.new_sequence(), engine.new_sequence()
    ids, images = prompt(engine, encoded(0))
    rows_a, rows_b = engine.forward([Pass(a, 0, ids, 1, images=images), Pass(b, 0, text, 2)])
    assert np.abs(rows_a[0] - ref_image).max() < 1e-4 and np.abs(rows_b - ref_text).max() < 1e-4
    for s in (alone, image, a, b):
        engine.free(s)


def test_corrupt_bytes_are_refused_before_anything_is_written_and_the_engine_serves_on(engine):
    ids, _ = prompt(engine, encoded(0))
    at = ids.index(engine.image_token_id)
    bad = PromptImage.of(CORRUPT_JPEG, at)
    text = engine.tokenizer.encode("Go to the door")
    seq, other = engine.new_sequence(), engine.new_sequence()
    used = engine.kv_used
    with pytest.raises(ValueError, match="could not be decoded"):
        engine.forward([Pass(other, 0, text, 1), Pass(seq, 0, ids, 1, images={at: bad})])
    assert seq.length == other.length == 0 and engine.kv_used == used
    [row] = engine.forward([Pass(other, 0, text, 1)])
    assert np.isfinite(row).all()
    opened, _, _, row = open_with(engine, encoded(1))
    assert np.isfinite(row).all()
    with pytest.raises(ValueError, match="not on the image marker"):
        engine.forward([Pass(seq, 0, ids, 1, images={at + 1: PromptImage.of(encoded(0), at + 1)})])
    for s in (seq, other, opened):
        engine.free(s)


def test_an_image_sent_before_is_known_by_its_hash_until_it_leaves_the_cache(engine):
    ids, images = prompt(engine, encoded(0))
    at = next(iter(images))
    by_hash = {at: PromptImage(at, images[at].sha256)}
    seq = engine.new_sequence()
    [full] = engine.forward([Pass(seq, 0, ids, 1, images=images)])
    [again] = engine.forward([Pass(seq, 0, ids, 1, images=by_hash)])
    assert np.abs(full - again).max() < 1e-5
    for s in range(100, 100 + CACHED):  # CACHED others push it out
        engine.vision.positions(PromptImage.of(encoded(s), at))
    with pytest.raises(UnknownImage, match="send its bytes again"):
        engine.forward([Pass(seq, 0, ids, 1, images=by_hash)])
    engine.free(seq)


def test_image_positions_and_resolve_answer_from_the_cache(engine):
    """What the verifier asks at open, before any pass: an image's positions, its bytes for a hash."""
    image = PromptImage.of(encoded(5), 2)
    by_hash = PromptImage(2, image.sha256)
    with pytest.raises(UnknownImage, match="send its bytes again"):
        engine.resolve(by_hash)
    with pytest.raises(UnknownImage):
        engine.image_positions(by_hash)
    assert engine.image_positions(image) == engine.vision.positions(image) == 33
    assert engine.resolve(image) is image and engine.resolve(by_hash) == image  # the bytes from the cache
    assert engine.image_positions(by_hash) == 33
    with pytest.raises(ValueError, match="could not be decoded"):
        engine.image_positions(PromptImage.of(CORRUPT_JPEG, 2))


def test_a_text_only_engine_refuses_images(vlm):
    text_only = LlamaCppEngine(vlm.target, "vlm-text", threads=1, max_sequences=2, kv_tokens=256)
    assert text_only.info.extra["vision"] is False and text_only.vision is None
    ids, images = prompt(text_only, encoded(0))
    with pytest.raises(ValueError, match="reads text only"):
        text_only.forward([Pass(text_only.new_sequence(), 0, ids, 1, images=images)])
    with pytest.raises(ValueError, match="reads text only"):
        text_only.image_positions(next(iter(images.values())))


def test_a_projector_that_does_not_fit_is_refused_with_the_reason(vlm):
    with pytest.raises(ValueError, match="not an mmproj"):
        LlamaCppEngine(vlm.target, "vlm", threads=1, max_sequences=2, kv_tokens=256, mmproj=vlm.draft)
    with pytest.raises(ValueError, match="another model's mmproj"):
        LlamaCppEngine(
            modelfiles.shipped_gguf(), "smollm2", threads=1, max_sequences=2, kv_tokens=256, mmproj=vlm.target_mmproj
        )
    with pytest.raises(ValueError, match="no projector file"):
        LlamaCppEngine(
            vlm.target, "vlm", threads=1, max_sequences=2, kv_tokens=256, mmproj=vlm.directory / "missing-mmproj.gguf"
        )
