"""The tiny test VLM (tests/models/make_test_vlm.py): one random Idefics3 that transformers and llama.cpp both run.

Made once into models/build/ (~20 s on 2 cores) and found in the cache after. The checks: every file
loads in what reads it, llama.cpp sees the Hugging Face vocabulary (the shipped SmolLM2 one first),
libmtmd lays an image out in the same tokens as the Hugging Face processor, and the f32 GGUF with its
mmproj computes what transformers computes, image included.
"""

import time

import numpy as np
import pytest

from protocol import modelfiles
from tests.models import make_test_vlm as tv

pytestmark = pytest.mark.real


@pytest.fixture(scope="module")
def vlm():
    return tv.make(log=lambda m: None)


@pytest.fixture(scope="module")
def hf_runs(vlm):
    """transformers on two noise images: {seed: ([vocab] logits, input ids)}."""
    return {s: tv.hf_logits(vlm.hf_dir, tv.random_image(s)) for s in (0, 1)}


def test_the_files_are_made_once_then_found_by_their_key(vlm):
    for f in (
        vlm.target,
        vlm.target_mmproj,
        vlm.draft,
        vlm.draft_mmproj,
        vlm.hf_dir / "config.json",
        vlm.hf_dir / "model.safetensors",
        vlm.hf_dir / "processor_config.json",
        vlm.hf_dir / "tokenizer.json",
    ):
        assert f.is_file() and f.stat().st_size > 0, f
    assert vlm.draft.stat().st_size < vlm.target.stat().st_size / 3  # Q8_0 against f32
    t0 = time.perf_counter()
    again = tv.make(log=lambda m: None)
    assert time.perf_counter() - t0 < 2 and again == vlm


def test_the_processor_and_config_are_a_smolvlm_with_the_shipped_vocabulary_first(vlm):
    from transformers import AutoConfig, AutoProcessor

    processor = AutoProcessor.from_pretrained(vlm.hf_dir)
    config = AutoConfig.from_pretrained(vlm.hf_dir)
    assert type(processor).__name__ == "Idefics3Processor" and config.model_type == "idefics3"
    assert len(processor.tokenizer) == config.text_config.vocab_size == vlm.vocab
    assert processor.tokenizer.convert_tokens_to_ids("<image>") == config.image_token_id == vlm.image_token_id


def test_llamacpp_loads_target_and_draft_with_the_hf_vocabulary_the_shipped_one_first(vlm):
    shipped = tv.llama_vocab(modelfiles.shipped_gguf())
    target, draft = tv.llama_vocab(vlm.target), tv.llama_vocab(vlm.draft)
    assert len(target) == vlm.vocab and draft == target
    assert target[: len(shipped)] == shipped and target[len(shipped) :] == [t.encode() for t in tv.IMAGE_TOKENS]


def test_transformers_runs_the_model_and_two_images_give_different_logits(vlm, hf_runs):
    (a, ids), (b, _) = hf_runs[0], hf_runs[1]
    assert a.shape == (vlm.vocab,) and np.isfinite(a).all()
    tiles = (vlm.shape.longest_edge // vlm.shape.tile) ** 2 + 1  # 2 x 2 tiles and the overview
    assert ids.count(vlm.image_token_id) == tiles * vlm.shape.tokens_per_tile
    assert np.abs(a - b).max() > 1e-2


@pytest.mark.parametrize("which", ["target", "draft"])
def test_libmtmd_prefills_an_image_as_transformers_does(vlm, hf_runs, which):
    gguf, mmproj = {"target": (vlm.target, vlm.target_mmproj), "draft": (vlm.draft, vlm.draft_mmproj)}[which]
    pa, pb = (tv.llama_logits(gguf, mmproj, tv.random_image(s)) for s in (0, 1))
    hf_a, hf_ids = hf_runs[0]
    # the same prompt: libmtmd's text chunks and image chunks are the processor's ids, <image> for each embedding
    flat = [t for kind, x in pa.chunks for t in (x if kind == "text" else [vlm.image_token_id] * x)]
    assert flat == hf_ids and pa.n_pos == len(hf_ids)
    assert np.abs(pa.logits - pb.logits).max() > 1e-2  # the image reaches the logits
    # the same function: f32 within float noise (tiles resized by llama.cpp's own Lanczos); Q8_0 close
    assert np.abs(pa.logits - hf_a).max() < {"target": 2e-3, "draft": 5e-2}[which]
