"""The set-up both engines' vision tests share (test_llamacpp_vision.py and test_torch_vision.py on the test
SmolVLM; test_llamacpp_mrope.py and test_torch_mrope.py on the Qwen-VLs): images as bytes, prompts with
images on their markers, a sequence opened on a prompt, and a pass's rows on the host for either engine."""

import io

import numpy as np
import pytest

from protocol.images import PromptImage
from server_bridge.engines import Pass
from tests.models import make_test_vlm as tv

TAIL = " A red box"  # three ids after the SmolVLM prompt: the verify-shaped passes
CORRUPT_JPEG = b"\xff\xd8\xff\xc0\x00\x08\x08\x00\x40\x00\x40\x00\xff\xda\x00\x02" + b"not a jpeg" * 40  # a
# JPEG header of 64 x 64, then bytes no decoder reads


@pytest.fixture(scope="module")
def vlm() -> tv.TinyVLM:
    """The test SmolVLM (tests/models/make_test_vlm.py): its GGUF + mmproj and its Hugging Face directory."""
    return tv.make(log=lambda m: None)


def image_bytes(pixels: np.ndarray, fmt: str = "PNG") -> bytes:
    """[h, w, 3] uint8 pixels encoded as PNG (lossless: the engine sees these pixels) or JPEG."""
    from PIL import Image

    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format=fmt, quality=95)
    return out.getvalue()


def encoded(seed: int, fmt: str = "PNG") -> bytes:
    """The test VLM's random image `seed`, encoded."""
    return image_bytes(tv.random_image(seed), fmt)


def decoded(data: bytes) -> np.ndarray:
    """[h, w, 3] uint8: the pixels of encoded bytes as PIL reads them (the reference's input)."""
    from PIL import Image

    return np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))


def prompt_images(engine, datas: list[bytes], text: str) -> tuple[list[int], dict[int, PromptImage]]:
    """The prompt's ids and its images on its image markers, in order (one image per marker)."""
    ids = engine.tokenizer.encode(text)
    at = [i for i, t in enumerate(ids) if t == engine.image_token_id]
    assert len(at) == len(datas)
    return ids, {i: PromptImage.of(d, i) for i, d in zip(at, datas, strict=True)}


def run(engine, passes: list[Pass]) -> list[np.ndarray]:
    """One pass; each pass's rows on the host [keep, vocab] (either engine)."""
    return [engine.to_numpy(rows) for rows in engine.forward(passes)]


def open_images(engine, datas: list[bytes], text: str):
    """A new sequence holding the prompt: (sequence, ids, images, [vocab] logits after the prompt)."""
    ids, images = prompt_images(engine, datas, text)
    seq = engine.new_sequence()
    [rows] = run(engine, [Pass(seq, 0, ids, 1, images=images)])
    return seq, ids, images, rows[0]


def prompt(engine, data: bytes, text: str = tv.PROMPT) -> tuple[list[int], dict[int, PromptImage]]:
    """A SmolVLM prompt (one image marker) with the image on it."""
    return prompt_images(engine, [data], text)


def open_with(engine, data: bytes, text: str = tv.PROMPT):
    """A new sequence holding a SmolVLM prompt with one image: (sequence, ids, images, [vocab] logits after it)."""
    return open_images(engine, [data], text)
