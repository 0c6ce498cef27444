"""The torch engine on a vision-language model: a prompt's image marker expands to the image's positions.

On the test VLM (tests/models/make_test_vlm.py: a random SmolVLM as a Hugging Face directory) the engine must
compute what transformers computes for the whole prompt with its own processor and forward, place the
text after an image at the right positions, roll back across and before an image, keep a batch's text
sessions as they are alone, and refuse what it cannot read (corrupt bytes, a hash it does not hold,
images on a text-only target, an M-RoPE model whose positions it does not compute) with the reason. The
Qwen-VLs (M-RoPE) have tests of their own: test_torch_mrope.py.
"""

import numpy as np
import pytest
import torch

from protocol.images import PromptImage
from runtime.vision import CACHED, UnknownImage
from server_bridge.engines import Pass, load_engine
from server_bridge.engines.torch import TorchEngine
from tests.models import make_test_vlm as tv
from tests.server_bridge.engines.vision_setup import CORRUPT_JPEG, TAIL, decoded, encoded, open_with, prompt, run, vlm

pytestmark = pytest.mark.real
__all__ = ["vlm"]  # the shared fixture, used by name

CLOSE = 1e-5  # float32 on both sides, the same operations in one pass


@pytest.fixture(scope="module")
def engine(vlm):
    return load_engine(
        str(vlm.hf_dir), engine="torch", device="cpu", dtype="float32", threads=1, max_sequences=8, max_len=256
    )


@pytest.fixture(scope="module")
def reference(vlm):
    """rows(pixels, prompt, n) -> [n, vocab]: transformers' logits at the prompt's last n positions, by the
    model's own processor and forward (a model of its own, apart from the engine's)."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    processor = AutoProcessor.from_pretrained(vlm.hf_dir)
    model = AutoModelForImageTextToText.from_pretrained(vlm.hf_dir, dtype=torch.float32).eval()

    def rows(pixels: np.ndarray, prompt: str, n: int) -> np.ndarray:
        inputs = processor(text=prompt, images=[[pixels]], return_tensors="pt")
        with torch.no_grad():
            return model(**inputs).logits[0, -n:].numpy()

    return rows


def test_an_image_expands_to_the_processors_layout_and_the_logits_are_transformers(vlm, engine):
    assert engine.info.extra["vision"] is True and engine.vision and engine.image_token_id == vlm.image_token_id
    seq, ids, images, row = open_with(engine, encoded(0))
    ref, ref_ids = tv.hf_logits(vlm.hf_dir, tv.random_image(0))
    # a 128 x 128 image: 2 x 2 tiles and the overview, 4 embeddings each, in 13 of SmolVLM's text tokens
    assert engine.image_positions(images[ids.index(vlm.image_token_id)]) == 33 == len(ref_ids) - len(ids) + 1
    assert seq.length == len(ids) and engine.kv_pos(seq, len(ids)) == len(ref_ids)
    assert np.abs(row - ref).max() < CLOSE
    engine.free(seq)


def test_a_jpeg_is_read_as_its_pixels(engine, reference):
    data = encoded(0, "JPEG")
    seq, _, _, row = open_with(engine, data)
    assert np.abs(row - reference(decoded(data), tv.PROMPT, 1)[0]).max() < CLOSE
    engine.free(seq)


def test_two_images_give_different_logits(engine):
    a, _, _, row_a = open_with(engine, encoded(0))
    b, _, _, row_b = open_with(engine, encoded(1))
    assert np.abs(row_a - row_b).max() > 1e-2
    engine.free(a)
    engine.free(b)


def test_an_image_as_the_last_kept_row_gives_the_logits_after_the_image(vlm, engine, reference):
    seq, ids, _, row = open_with(engine, encoded(0), "User:<image>")
    assert ids[-1] == vlm.image_token_id
    assert np.abs(row - reference(tv.random_image(0), "User:<image>", 1)[0]).max() < CLOSE
    engine.free(seq)


def test_a_verify_pass_after_the_image_gives_transformers_rows(engine, reference):
    """As the verifier runs it: the KV holds all but the last committed id, which comes with 3 drafted."""
    ids, images = prompt(engine, encoded(0))
    more = engine.tokenizer.encode(tv.PROMPT + TAIL)
    assert more[: len(ids)] == ids and len(more) == len(ids) + 3
    seq = engine.new_sequence()
    run(engine, [Pass(seq, 0, ids[:-1], 0, images=images)])
    [verify] = run(engine, [Pass(seq, len(ids) - 1, more[len(ids) - 1 :], 4)])  # [4, vocab]
    assert np.abs(verify - reference(tv.random_image(0), tv.PROMPT + TAIL, 4)).max() < CLOSE
    assert seq.length == len(more) and engine.kv_pos(seq, len(more)) == len(more) + 32
    singles = [run(engine, [Pass(seq, len(ids) + k, [t], 1)])[0][0] for k, t in enumerate(more[len(ids) :])]
    assert np.abs(verify[1:] - np.stack(singles)).max() < CLOSE
    engine.free(seq)


def test_a_sequence_rolls_back_after_and_before_its_image(engine, reference):
    seq, ids, images, row = open_with(engine, encoded(0))
    tail = engine.tokenizer.encode(tv.PROMPT + TAIL)[len(ids) :]
    [first] = run(engine, [Pass(seq, len(ids), tail, 3)])
    engine.truncate(seq, len(ids))  # after the image: it stays
    assert engine.kv_pos(seq, len(ids)) == len(ids) + 32
    [again] = run(engine, [Pass(seq, len(ids), tail, 3)])
    assert np.abs(again - first).max() < CLOSE
    at = next(iter(images))
    engine.truncate(seq, at)  # before it: its positions go
    assert seq.length == at and engine.kv_pos(seq, at + 1) == at + 1
    other = PromptImage.of(encoded(1), at)  # and another image takes its place
    [rows] = run(engine, [Pass(seq, at, ids[at:], 1, images={0: other})])
    assert np.abs(rows[0] - reference(tv.random_image(1), tv.PROMPT, 1)[0]).max() < CLOSE
    assert np.abs(rows[0] - row).max() > 1e-2
    engine.free(seq)


def test_an_image_pass_in_a_batch_leaves_the_other_sessions_as_they_were(engine):
    text = engine.tokenizer.encode("The robot walked to the kitchen door and")
    alone = engine.new_sequence()
    [ref_text] = run(engine, [Pass(alone, 0, text, 2)])
    seen, ids, _, ref_image = open_with(engine, encoded(0))
    tail = engine.tokenizer.encode(tv.PROMPT + TAIL)[len(ids) :]
    [ref_tail] = run(engine, [Pass(seen, len(ids), tail, 3)])  # text after an image, alone
    a, b = engine.new_sequence(), engine.new_sequence()
    _, images = prompt(engine, encoded(0))
    rows_a, rows_b, rows_tail = run(
        engine, [Pass(a, 0, ids, 1, images=images), Pass(b, 0, text, 2), Pass(seen, len(ids), tail, 3)]
    )
    assert np.abs(rows_a[0] - ref_image).max() < CLOSE and np.abs(rows_b - ref_text).max() < CLOSE
    assert np.abs(rows_tail - ref_tail).max() < CLOSE
    for s in (alone, seen, a, b):
        engine.free(s)


def test_corrupt_bytes_are_refused_before_anything_is_written_and_the_engine_serves_on(engine):
    ids, _ = prompt(engine, encoded(0))
    at = ids.index(engine.image_token_id)
    bad = PromptImage.of(CORRUPT_JPEG, at)
    text = engine.tokenizer.encode("Go to the door")
    seq, other = engine.new_sequence(), engine.new_sequence()
    with pytest.raises(ValueError, match="could not be decoded"):
        engine.forward([Pass(other, 0, text, 1), Pass(seq, 0, ids, 1, images={at: bad})])
    with pytest.raises(ValueError, match="could not be decoded"):
        engine.image_positions(PromptImage.of(encoded(0)[:300], at))  # a truncated PNG
    assert seq.length == other.length == 0
    [row] = run(engine, [Pass(other, 0, text, 1)])
    assert np.isfinite(row).all()
    opened, _, _, row = open_with(engine, encoded(1))
    assert np.isfinite(row).all()
    with pytest.raises(ValueError, match="not on the image marker"):
        engine.forward([Pass(seq, 0, ids, 1, images={at + 1: PromptImage.of(encoded(0), at + 1)})])
    for s in (seq, other, opened):
        engine.free(s)


def test_an_image_sent_before_is_known_by_its_hash_until_it_leaves_the_cache(engine):
    ids, images = prompt(engine, encoded(7))
    at = next(iter(images))
    by_hash = {at: PromptImage(at, images[at].sha256)}
    seq = engine.new_sequence()
    with pytest.raises(UnknownImage, match="send its bytes again"):  # never sent
        engine.forward([Pass(seq, 0, ids, 1, images=by_hash)])
    with pytest.raises(UnknownImage):
        engine.resolve(by_hash[at])
    [full] = run(engine, [Pass(seq, 0, ids, 1, images=images)])
    assert engine.resolve(by_hash[at]) == images[at] and engine.resolve(images[at]) is images[at]
    [again] = run(engine, [Pass(seq, 0, ids, 1, images=by_hash)])
    assert np.abs(full - again).max() < CLOSE
    for s in range(100, 100 + CACHED):  # CACHED others push it out
        engine.image_positions(PromptImage.of(encoded(s), at))
    with pytest.raises(UnknownImage, match="send its bytes again"):
        engine.forward([Pass(seq, 0, ids, 1, images=by_hash)])
    engine.free(seq)


def test_a_text_only_engine_refuses_images(torch_target):
    text_only = torch_target.engine
    assert text_only.info.extra["vision"] is False and text_only.vision is None
    image = PromptImage.of(encoded(0), 1)
    with pytest.raises(ValueError, match="reads text only"):
        text_only.forward(
            [Pass(text_only.new_sequence(), 0, text_only.tokenizer.encode("User: look"), 1, images={1: image})]
        )
    with pytest.raises(ValueError, match="reads text only"):
        text_only.image_positions(image)


def test_an_mrope_model_other_than_the_qwen_vls_is_refused_at_load_with_the_reason(tmp_path):
    from transformers import Glm4vConfig

    Glm4vConfig().save_pretrained(tmp_path)  # the config alone: refused before weights
    with pytest.raises(ValueError, match="M-RoPE.*qwen2_vl, qwen2_5_vl, qwen3_vl only"):
        TorchEngine(tmp_path, "glm-4v", device="cpu", dtype="float32")
