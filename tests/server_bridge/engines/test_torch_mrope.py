"""The torch engine on M-RoPE vision-language models (Qwen2-VL, Qwen2.5-VL, Qwen3-VL): positions, not token counts.

On each family's tiny random test model (tests/models/qwen_vlm.py, conftest's qwen_vlm) an image takes
rows x cols KV cells but advances the position by max(rows, cols) only, and the text after it sits at the
previous maximum + 1 on all three rotary axes (Qwen3-VL also adds deepstack features at the image's cells).
The engine must compute what transformers computes for the whole prompt with the model's own processor and
forward (float32, tight), verify text right after an image at those positions (which fails if positions were
counted by tokens), roll back after and before an image, keep a batch's sessions as they are alone, and add
up two images' positions.
"""

import numpy as np
import pytest
import torch

from protocol.images import PromptImage
from server_bridge.engines import Pass, load_engine, vision_torch
from tests.models import qwen_vlm as qv
from tests.server_bridge.engines.vision_setup import TAIL, image_bytes, open_images, prompt_images, run

pytestmark = pytest.mark.real

CLOSE = 1e-4  # float32 on both sides (logits ~4 wide: the same operations, in another order)
WIDE, SQUARE = (96, 128), (64, 64)  # (height, width): 6 x 8 embeddings at 8 positions; 4 x 4 at 4


@pytest.fixture(scope="module", params=qv.FAMILIES)
def vlm(request, qwen_vlm):
    return qwen_vlm(request.param)


@pytest.fixture(scope="module")
def engine(vlm):
    return load_engine(
        str(vlm.hf_dir), engine="torch", device="cpu", dtype="float32", threads=1, max_sequences=8, max_len=512
    )


@pytest.fixture(scope="module")
def reference(vlm, engine):
    """rows(images, prompt, n) -> ([n, vocab] transformers' logits at the prompt's last n positions, the model's
    own rope delta for it, its input ids): the model's processor and forward (a model apart from the engine's)."""
    from transformers import AutoModelForImageTextToText

    processor = vision_torch.load_processor(vlm.hf_dir, engine.model.config)
    model = AutoModelForImageTextToText.from_pretrained(vlm.hf_dir, dtype=torch.float32).eval()

    def rows(images: list[np.ndarray], prompt: str, n: int) -> tuple[np.ndarray, int, list[int]]:
        inputs = processor(text=prompt, images=images, return_tensors="pt")
        with torch.no_grad():
            logits = model(**inputs).logits[0, -n:].numpy()
            _, delta = model.model.get_rope_index(
                inputs["input_ids"], inputs["mm_token_type_ids"], image_grid_thw=inputs["image_grid_thw"]
            )
        return logits, int(delta), inputs["input_ids"][0].tolist()

    return rows


def pixels(seed: int, size: tuple[int, int] = WIDE) -> np.ndarray:
    return qv.random_image(seed, *size)


def encoded(seed: int, size: tuple[int, int] = WIDE) -> bytes:
    return image_bytes(pixels(seed, size))


def prompt(engine, datas: list[bytes], text: str = qv.PROMPT) -> tuple[list[int], dict[int, PromptImage]]:
    return prompt_images(engine, datas, text)


def open_with(engine, data: bytes, text: str = qv.PROMPT):
    """A new sequence holding the prompt: (sequence, ids, images, [vocab] logits after the prompt)."""
    return open_images(engine, [data], text)


def test_an_image_prompt_gives_transformers_logits_at_its_positions(vlm, engine, reference):
    assert engine.vision.mrope and engine.image_token_id == vlm.image_token_id
    seq, ids, images, row = open_with(engine, encoded(0))
    image = next(iter(images.values()))
    ref, delta, ref_ids = reference([pixels(0)], qv.PROMPT, 1)
    # 96 x 128: 6 x 8 embeddings (cells), which advance the position by max(6, 8) = 8
    assert engine.vision.cells(image) == 48 == len(ref_ids) - len(ids) + 1
    assert engine.image_positions(image) == 8
    # text after the image sits at its cell + the model's own rope delta (max position + 1 - length)
    assert engine.kv_pos(seq, len(ids)) == len(ids) - 1 + 8 == len(ref_ids) + delta and delta == 8 - 48
    assert np.abs(row - ref).max() < CLOSE
    engine.free(seq)


def test_a_verify_pass_after_the_image_gives_transformers_rows(engine, reference):
    """As the verifier runs it: the KV holds all but the last committed id, which comes with 3 drafted."""
    ids, images = prompt(engine, [encoded(0)])
    more = engine.tokenizer.encode(qv.PROMPT + TAIL)
    assert more[: len(ids)] == ids and len(more) == len(ids) + 3
    seq = engine.new_sequence()
    run(engine, [Pass(seq, 0, ids[:-1], 0, images=images)])
    [verify] = run(engine, [Pass(seq, len(ids) - 1, more[len(ids) - 1 :], 4)])  # [4, vocab]
    assert np.abs(verify - reference([pixels(0)], qv.PROMPT + TAIL, 4)[0]).max() < CLOSE
    singles = [run(engine, [Pass(seq, len(ids) + k, [t], 1)])[0][0] for k, t in enumerate(more[len(ids) :])]
    assert np.abs(verify[1:] - np.stack(singles)).max() < CLOSE
    engine.free(seq)


def test_text_right_after_an_image_verifies_at_its_positions_not_its_tokens(engine, reference):
    """The image ends the prefill; the text after it comes in a verify pass of its own. Placed at the image's
    cells (48) instead of its positions (8), every row would differ from transformers'."""
    head = "<|im_start|>user\n<|vision_start|><|image_pad|>"
    whole = head + "<|vision_end|>Describe the scene."
    seq, ids, images, row = open_with(engine, encoded(3), head)
    assert ids[-1] == engine.image_token_id
    assert engine.image_positions(images[len(ids) - 1]) < engine.vision.cells(images[len(ids) - 1])
    assert np.abs(row - reference([pixels(3)], head, 1)[0][0]).max() < CLOSE  # the row after the image
    more = engine.tokenizer.encode(whole)
    k = len(more) - len(ids)
    [verify] = run(engine, [Pass(seq, len(ids), more[len(ids) :], k)])
    assert np.abs(verify - reference([pixels(3)], whole, k)[0]).max() < CLOSE
    engine.free(seq)


def test_a_sequence_rolls_back_after_and_before_its_image(engine, reference):
    seq, ids, images, row = open_with(engine, encoded(0))
    tail = engine.tokenizer.encode(qv.PROMPT + TAIL)[len(ids) :]
    [first] = run(engine, [Pass(seq, len(ids), tail, 3)])
    engine.truncate(seq, len(ids))  # after the image: it stays
    assert engine.kv_pos(seq, len(ids)) == len(ids) + 7
    [again] = run(engine, [Pass(seq, len(ids), tail, 3)])
    assert np.abs(again - first).max() < CLOSE
    at = next(iter(images))
    engine.truncate(seq, at)  # before it: its cells and positions go
    assert seq.length == at and engine.kv_pos(seq, at + 1) == at + 1
    other = PromptImage.of(encoded(1, SQUARE), at)  # another image, of other counts (16 cells, 4 positions)
    [rows] = run(engine, [Pass(seq, at, ids[at:], 1, images={0: other})])
    assert engine.kv_pos(seq, len(ids)) == len(ids) + 3
    assert np.abs(rows[0] - reference([pixels(1, SQUARE)], qv.PROMPT, 1)[0][0]).max() < CLOSE
    assert np.abs(rows[0] - row).max() > 1e-2
    [after] = run(engine, [Pass(seq, len(ids), tail, 3)])  # text after the new image, at its positions
    assert np.abs(after - reference([pixels(1, SQUARE)], qv.PROMPT + TAIL, 3)[0]).max() < CLOSE
    engine.free(seq)


def test_an_image_pass_in_a_batch_leaves_the_other_sessions_as_they_were(engine):
    text = engine.tokenizer.encode("The robot walked to the kitchen door and")
    alone = engine.new_sequence()
    [ref_text] = run(engine, [Pass(alone, 0, text, 2)])
    seen, ids, _, ref_image = open_with(engine, encoded(0))
    tail = engine.tokenizer.encode(qv.PROMPT + TAIL)[len(ids) :]
    [ref_tail] = run(engine, [Pass(seen, len(ids), tail, 3)])  # text after an image (a rope delta), alone
    a, b = engine.new_sequence(), engine.new_sequence()
    _, images = prompt(engine, [encoded(0)])
    rows_a, rows_b, rows_tail = run(
        engine, [Pass(a, 0, ids, 1, images=images), Pass(b, 0, text, 2), Pass(seen, len(ids), tail, 3)]
    )
    assert np.abs(rows_a[0] - ref_image).max() < CLOSE and np.abs(rows_b - ref_text).max() < CLOSE
    assert np.abs(rows_tail - ref_tail).max() < CLOSE
    # and text passes of sessions with and without an image, in one batched pass
    rows_a, rows_b = run(engine, [Pass(a, len(ids), tail, 3), Pass(b, 0, text, 2)])
    assert np.abs(rows_a - ref_tail).max() < CLOSE and np.abs(rows_b - ref_text).max() < CLOSE
    for s in (alone, seen, a, b):
        engine.free(s)


def test_two_images_give_different_logits_and_add_up_their_positions(engine, reference):
    a, _, _, row_a = open_with(engine, encoded(0))
    b, _, _, row_b = open_with(engine, encoded(1))
    assert np.abs(row_a - row_b).max() > 1e-2
    span = qv.IMAGE_SPAN
    both = f"<|im_start|>user\n{span}then{span}Which is nearer?<|im_end|>\n<|im_start|>assistant\n"
    ids, images = prompt(engine, [encoded(0), encoded(1, SQUARE)], both)
    seq = engine.new_sequence()
    [rows] = run(engine, [Pass(seq, 0, ids, 1, images=images)])
    ref, delta, ref_ids = reference([pixels(0), pixels(1, SQUARE)], both, 1)
    assert engine.kv_pos(seq, len(ids)) == len(ids) + 7 + 3 == len(ref_ids) + delta
    assert np.abs(rows[0] - ref[0]).max() < CLOSE
    for s in (a, b, seq):
        engine.free(s)
