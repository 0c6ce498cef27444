"""The torch engine's batched pass: one attention call per layer over every session, no loop over them.

A randomly initialised tiny Llama (and a Mistral, whose layers have a sliding window) built from its
config: the pass's shape is what is tested, not the weights. A ragged batch (sessions at different
cache lengths, with different numbers of new tokens) gives each session the logits it gets alone,
and the operators a pass runs (torch.profiler) are as many for 8 sessions as for 2: also on an M-RoPE
model (the tiny Qwen2-VL of tests/models/qwen_vlm.py), each session after an image of its own size, so
at its own rope delta, its positions handed over as [3, 1, T].
"""

import io
from pathlib import Path

import pytest
import torch

from protocol.images import PromptImage
from server_bridge.engines import Pass, load_engine
from server_bridge.engines.torch import TorchEngine

TINY = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
)
# operators that only re-describe memory (views, shapes) and launch no kernel on any device
VIEWS = {
    "aten::slice",
    "aten::narrow",
    "aten::view",
    "aten::select",
    "aten::as_strided",
    "aten::split",
    "aten::split_with_sizes",
    "aten::unsqueeze",
    "aten::squeeze",
    "aten::transpose",
    "aten::expand",
    "aten::reshape",
    "aten::_reshape_alias",
    "aten::t",
    "aten::permute",
    "aten::alias",
    "aten::detach",
    "aten::lift_fresh",
    "aten::unbind",
    "aten::contiguous",
    "aten::_unsafe_view",
    "aten::view_as",
}


def engine(kind: str = "llama", slots: int = 8) -> TorchEngine:
    from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    if kind == "mistral":
        model = MistralForCausalLM(MistralConfig(**TINY, sliding_window=6))
    else:
        model = LlamaForCausalLM(LlamaConfig(**TINY))
    return TorchEngine(
        Path("random"), kind, device="cpu", dtype="float32", threads=1, max_sequences=slots, max_len=64, model=model
    )


def prefilled(eng: TorchEngine, lengths: list[int]):
    seqs = []
    for i, n in enumerate(lengths):
        seq = eng.new_sequence()
        if n:
            eng.forward([Pass(seq, 0, [(7 * i + j) % 500 + 3 for j in range(n)], 0)])
        seqs.append(seq)
    return seqs


@pytest.mark.parametrize("kind", ["llama", "mistral"])
def test_a_ragged_batch_gives_each_session_the_logits_it_gets_alone(kind):
    eng = engine(kind)
    lengths, news = [3, 11, 0, 7, 20], [[5], [9, 8, 7, 6, 5], [1, 2, 3, 4], [40, 41], [100, 101, 102]]
    keeps = [1, 5, 2, 2, 3]

    def passes(seqs):
        return [Pass(s, n, ids, k) for s, n, ids, k in zip(seqs, lengths, news, keeps, strict=True)]

    seqs = prefilled(eng, lengths)
    alone = [eng.forward([p])[0] for p in passes(seqs)]
    batched = eng.forward(passes(seqs))  # the same tokens again, at the same positions
    for a, b, k in zip(alone, batched, keeps, strict=True):
        assert a.shape == b.shape == (k, TINY["vocab_size"])
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_the_batch_writes_each_sessions_kv_where_a_solo_pass_does():
    solo, batch = engine(), engine()
    lengths, news = [4, 9, 1], [[5, 6], [9], [1, 2, 3]]
    for eng, together in ((solo, False), (batch, True)):
        seqs = prefilled(eng, lengths)
        passes = [Pass(s, n, ids, 1) for s, n, ids in zip(seqs, lengths, news, strict=True)]
        if together:
            eng.forward(passes)
        else:
            for p in passes:
                eng.forward([p])
        eng.after = [
            eng.forward([Pass(s, n + len(ids), [77], 1)])[0] for s, n, ids in zip(seqs, lengths, news, strict=True)
        ]
    for a, b in zip(solo.after, batch.after, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    for layer in range(TINY["num_hidden_layers"]):
        for slot, (n, ids) in enumerate(zip(lengths, news, strict=True)):
            end = n + len(ids) + 1
            torch.testing.assert_close(solo.pool.k[layer][slot, :, :end], batch.pool.k[layer][slot, :, :end])
            torch.testing.assert_close(solo.pool.v[layer][slot, :, :end], batch.pool.v[layer][slot, :, :end])


def text_sessions(eng: TorchEngine, sessions: int) -> list[tuple]:
    """(sequence, text length) per session: 10, 13, 16, ... ids of text."""
    lengths = [10 + 3 * i for i in range(sessions)]
    return list(zip(prefilled(eng, lengths), lengths, strict=True))


def kernel_ops(eng: TorchEngine, sessions: int, tokens: int, opened=text_sessions) -> list[str]:
    """The operators one pass of `sessions` x `tokens` runs, views left out."""
    from torch.profiler import ProfilerActivity, profile

    held = opened(eng, sessions)
    batch = [Pass(s, n, list(range(20, 20 + tokens)), tokens) for s, n in held]
    eng.forward(batch)  # warm
    for s, n in held:
        eng.truncate(s, n)
    batch = [Pass(s, n, list(range(20, 20 + tokens)), tokens) for s, n in held]
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        eng.forward(batch)
    for s, _ in held:
        eng.free(s)
    return sorted(e.name for e in prof.events() if e.name.startswith("aten::") and e.name not in VIEWS)


@pytest.mark.parametrize("kind", ["llama", "mistral"])
def test_a_pass_runs_as_many_operators_for_eight_sessions_as_for_two(kind):
    eng = engine(kind, slots=16)
    counts = {n: kernel_ops(eng, n, 5) for n in (2, 4, 8)}
    assert counts[2] == counts[4] == counts[8], {n: len(c) for n, c in counts.items()}
    # and a session's pass is not dearer per layer than the batch: one attention call per layer
    sdpa = [name for name in counts[8] if "scaled_dot_product" in name and not name.startswith("aten::_")]
    assert len(sdpa) == TINY["num_hidden_layers"]


@pytest.mark.parametrize("kind", ["llama", "mistral"])
def test_a_pass_on_a_cache_gives_the_logits_of_transformers_own_forward(kind):
    """Several new tokens on a cache longer than the sliding window: each sees its own window."""
    eng = engine(kind)
    ids = [(11 * j) % 500 + 3 for j in range(17)]
    seq = eng.new_sequence()
    eng.forward([Pass(seq, 0, ids[:12], 0)])
    ours = eng.forward([Pass(seq, 12, ids[12:], 5)])[0]
    with eng.plain_attention() as model, torch.inference_mode():
        theirs = model(torch.tensor([ids])).logits[0, 12:]
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)


def image_sessions(eng: TorchEngine, sessions: int) -> list[tuple]:
    """(sequence, text length) per session: the Qwen-VL prompt with an image of its own size (so its own cells,
    positions and rope delta), then i more ids of text."""
    from PIL import Image

    from tests.models import qwen_vlm as qv

    ids = eng.tokenizer.encode(qv.PROMPT)
    at = ids.index(eng.image_token_id)
    held = []
    for i in range(sessions):
        out = io.BytesIO()
        Image.fromarray(qv.random_image(i, 32 + 16 * (i % 3), 64 + 16 * (i % 4))).save(out, format="PNG")
        prompt = ids + [(7 * i + j) % 500 + 3 for j in range(i)]
        seq = eng.new_sequence()
        eng.forward([Pass(seq, 0, prompt, 0, images={at: PromptImage.of(out.getvalue(), at)})])
        held.append((seq, len(prompt)))
    return held


@pytest.mark.real
def test_an_mrope_pass_runs_as_many_operators_for_eight_sessions_as_for_two(qwen_vlm):
    vlm = qwen_vlm("qwen2vl")
    eng = load_engine(
        str(vlm.hf_dir), engine="torch", device="cpu", dtype="float32", threads=1, max_sequences=16, max_len=128
    )
    assert eng.mrope
    counts = {n: kernel_ops(eng, n, 5, image_sessions) for n in (2, 4, 8)}
    assert counts[2] == counts[4] == counts[8], {n: len(c) for n, c in counts.items()}
    sdpa = [name for name in counts[8] if "scaled_dot_product" in name and not name.startswith("aten::_")]
    assert len(sdpa) == eng.n_layers
