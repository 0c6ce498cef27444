"""The tiny Qwen-VL test models (tools/models/qwen_vlm.py, `make_test_vlm --family`): Qwen2-VL, Qwen2.5-VL, Qwen3-VL.

Each is made once into models/build/ (~20 s on 2 cores) and shared through conftest's `qwen_vlm`. The checks:
transformers loads the Hugging Face directory and its processor gives pixel_values + image_grid_thw; llama.cpp
loads the f32 target and the Q8_0 draft with their mmproj, as an M-RoPE model; libmtmd lays an image out in as
many tokens as the processor but advances the position by fewer (max(rows, cols) for M-RoPE), so a test that
counts positions by tokens fails on these models; the GGUF computes what transformers computes; two images give
two different greedy outputs; the draft agrees with the target on most greedy tokens.
"""

import time

import numpy as np
import pytest

from tools.models import make_test_vlm as tv
from tools.models import qwen_vlm as qv

pytestmark = pytest.mark.real

ROPE = {"qwen2vl": "MROPE", "qwen2.5vl": "MROPE", "qwen3vl": "IMROPE"}  # llama.cpp's LLAMA_ROPE_TYPE_<this>
SIZES = {(64, 64): (16, 4), (96, 128): (48, 8)}  # [h, w] -> the image's (tokens, positions): 4 x 4 and 6 x 8 embeddings


@pytest.fixture(scope="module", params=qv.FAMILIES)
def vlm(request, qwen_vlm):
    return qwen_vlm(request.param)


@pytest.fixture(scope="module")
def hf_runs(vlm):
    """transformers on two 64 x 64 noise images and a 96 x 128 one: {(seed, h, w): HfRun}."""
    return {
        (s, h, w): qv.hf_run(vlm.hf_dir, qv.random_image(s, h, w), n=8)
        for s, h, w in ((0, 64, 64), (1, 64, 64), (0, 96, 128))
    }


def test_the_files_are_made_once_then_found_by_their_key(vlm):
    for f in (vlm.target, vlm.target_mmproj, vlm.draft, vlm.draft_mmproj, vlm.hf_dir / "config.json"):
        assert f.is_file() and f.stat().st_size > 0, f
    assert vlm.draft.stat().st_size < vlm.target.stat().st_size / 3  # Q8_0 against f32
    t0 = time.perf_counter()
    again = tv.make_family(vlm.family, log=lambda m: None)
    assert time.perf_counter() - t0 < 2 and again == vlm


def test_transformers_loads_the_model_and_its_processor_lays_out_the_image(vlm):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(vlm.hf_dir)
    assert config.model_type == {"qwen2vl": "qwen2_vl", "qwen2.5vl": "qwen2_5_vl", "qwen3vl": "qwen3_vl"}[vlm.family]
    assert config.image_token_id == vlm.image_token_id and config.text_config.vocab_size == vlm.vocab
    processor = qv.load_processor(vlm.hf_dir)
    for (h, w), (tokens, _) in SIZES.items():
        out = processor(text=qv.PROMPT, images=[qv.random_image(0, h, w)], return_tensors="pt")
        merge = vlm.shape.merge
        assert out["image_grid_thw"][0].tolist() == [1, h // vlm.shape.patch, w // vlm.shape.patch]
        assert out["pixel_values"].shape == (tokens * merge * merge, 3 * 2 * vlm.shape.patch**2)
        assert out["input_ids"][0].tolist().count(vlm.image_token_id) == tokens


@pytest.mark.parametrize("which", ["target", "draft"])
def test_libmtmd_advances_the_position_by_fewer_than_the_image_tokens(vlm, hf_runs, which):
    import llama_cpp

    gguf, mmproj = {"target": (vlm.target, vlm.target_mmproj), "draft": (vlm.draft, vlm.draft_mmproj)}[which]
    for (h, w), (tokens, positions) in SIZES.items():
        run = qv.llama_run(gguf, mmproj, qv.random_image(0, h, w), n=1)
        assert run.rope_type == getattr(llama_cpp, f"LLAMA_ROPE_TYPE_{ROPE[vlm.family]}")
        images = [c for c in run.chunks if c[0] == "image"]
        assert [(n_tokens, n_pos) for _, n_tokens, n_pos in images] == [(tokens, positions)]
        n_text = sum(len(c[1]) for c in run.chunks if c[0] == "text")
        assert run.n_past == n_text + positions != n_text + tokens
        # the same prompt: libmtmd's text chunks and image chunk are the processor's ids, <|image_pad|> a token
        flat = [t for c in run.chunks for t in (c[1] if c[0] == "text" else [vlm.image_token_id] * c[1])]
        assert flat == hf_runs[(0, h, w)].input_ids


def test_llamacpp_computes_what_transformers_computes_and_the_image_matters(vlm, hf_runs):
    greedy = {}
    for s, h, w in hf_runs:
        run = qv.llama_run(vlm.target, vlm.target_mmproj, qv.random_image(s, h, w), n=8)
        hf = hf_runs[(s, h, w)]
        assert np.abs(run.logits - hf.logits).max() < 0.1  # logits of std ~4; the rest is float noise
        assert run.greedy == hf.greedy
        greedy[(s, h, w)] = run.greedy
    assert greedy[(0, 64, 64)] != greedy[(1, 64, 64)]  # two images, two outputs


def test_the_q8_draft_agrees_with_the_target_on_most_greedy_tokens(vlm):
    agree = total = 0
    for seed in (0, 1):
        image = qv.random_image(seed, 64, 64)
        target = qv.llama_run(vlm.target, vlm.target_mmproj, image, n=16)
        draft = qv.llama_run(vlm.draft, vlm.draft_mmproj, image, follow=target.greedy)  # on the target's path
        agree += sum(a == b for a, b in zip(draft.greedy, target.greedy, strict=True))
        total += len(target.greedy)
    assert agree >= 0.75 * total, f"{agree}/{total}"


def test_the_command_line_names_every_family():
    assert tv.FAMILIES == ("smolvlm", "qwen2vl", "qwen2.5vl", "qwen3vl")
    with pytest.raises(ValueError, match="unknown Qwen-VL family"):
        qv.default_dir("qwen9vl")
