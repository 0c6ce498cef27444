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
from tools.models import random_target

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


def test_the_hf_tokenizer_is_built_from_the_gguf_and_splits_text_as_llama_cpp_does(vlm):
    """The VLMs' tokenizer comes from the shipped GGUF's fields through `tokenizers` itself, not through
    transformers' GGUF loader: on the GPU machine's transformers 5.17 that loader made a byte-fallback tokenizer
    that llama.cpp's converter wrote as a SentencePiece vocabulary, and the draft aborted on its first prompt."""
    from llama_cpp import Llama

    tok = random_target.shipped_tokenizer()
    llama = Llama(str(modelfiles.shipped_gguf()), vocab_only=True, verbose=False)
    texts = [
        "Walk down the hallway, turn left at the second door.",
        "  two leading spaces\n\tand a tab",
        "def f(x):\n    return {'a': [1, 2.5e-3]}",
        "caf\u00e9 \u2192 \u6a5f\u68b0 \U0001f916\u200d!",
        "<|im_start|>user\nstop<|im_end|>",
    ]
    for text in texts:
        ids = tok.encode(text, add_special_tokens=False)
        assert ids == llama.tokenize(text.encode(), add_bos=False, special=True), text
        assert tok.decode(ids) == text
    assert (tok.bos_token, tok.eos_token) == ("<|im_start|>", "<|im_end|>")
    assert tok.chat_template == llama.metadata["tokenizer.chat_template"]


def test_llama_cpp_converted_the_vocabulary_as_byte_level_bpe(vlm):
    import gguf

    fields = gguf.GGUFReader(str(vlm.target)).fields
    assert fields["tokenizer.ggml.model"].contents() == "gpt2"  # not "llama" (SentencePiece)
    assert fields["tokenizer.ggml.pre"].contents() == "smollm"
    assert fields["tokenizer.ggml.eos_token_id"].contents() == 2


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
