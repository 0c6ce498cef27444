"""The torch engine's compiled pass (server_bridge/engines/compile_torch.py) against its eager pass.

On the tiny random target (the session's `compiled_torch_target`, compiled once per run): ragged batches that
fall in different buckets, each padded in sessions and in tokens, give every session the logits the eager
pass gives it (within float32 rounding: inductor's fused kernels sum in another order, so not bit for bit;
the argmax ids are identical) and write the same keys and values into its slot; the greedy ids are the eager
engine's. SD through the compiled engine commits the AR ids: tests/server_bridge/test_batching.py runs on it
too. A compile that fails leaves the eager pass, with one warning.
"""

import logging
from pathlib import Path

import pytest
import torch

from server_bridge.engines import Pass
from server_bridge.engines.compile_torch import CompiledPass, bucket
from server_bridge.engines.torch import TorchEngine
from tests.server_bridge.test_batching import greedy

pytestmark = pytest.mark.real  # the compile (the session fixture) takes 20-50 s on this machine


@pytest.fixture(scope="module")
def engines(compiled_torch_target):
    """(compiled, eager): the compiled target's engine and an eager one on the same model object."""
    compiled = compiled_torch_target.engine
    eager = TorchEngine(
        compiled.path, compiled.name, device="cpu", threads=1, max_sequences=16, max_len=1024,
        model=compiled.model, compile="off",
    )  # fmt: skip
    return compiled, eager


def prefilled(eng, lengths: list[int]):
    seqs = []
    for i, n in enumerate(lengths):
        seq = eng.new_sequence()
        if n:
            eng.forward([Pass(seq, 0, [(37 * i + 11 * j) % 49000 + 3 for j in range(n)], 0)])
        seqs.append(seq)
    return seqs


# (cached lengths, new ids per session): each batch in its own bucket (sessions, tokens, keys), padded in both
BATCHES = [
    ([3, 40, 0], [[5], [9, 8, 7, 6, 5], [1, 2, 3]]),  # 3 sessions -> 4, 5 tokens -> 8, keys 45 -> 64
    ([70, 2, 9, 14, 1], [[1, 2], [3], [4, 5, 6], [7], [8, 9, 10]]),  # 5 -> 8, 3 -> 4, 73 -> 128
    ([6], [[44]]),  # one session, one token (AR): 2 x 2, a padding session beside it
]


@pytest.mark.parametrize("lengths, news", BATCHES, ids=["4x8x64", "8x4x128", "2x2x64"])
def test_the_compiled_pass_gives_each_session_the_eager_logits_and_kv(engines, lengths, news):
    compiled, eager = engines
    out, seqs = {}, {}
    for eng in (eager, compiled):
        seqs[eng] = prefilled(eng, lengths)
        batch = [Pass(s, n, ids, len(ids)) for s, n, ids in zip(seqs[eng], lengths, news, strict=True)]
        out[eng] = eng.forward(batch)
    assert compiled.compiled.failed is None
    keys = max(n + len(ids) for n, ids in zip(lengths, news, strict=True))
    shape = (bucket(len(lengths)), bucket(max(map(len, news))), bucket(keys, 64, 1024))
    assert shape in compiled.compiled.shapes
    for a, b, ids in zip(out[eager], out[compiled], news, strict=True):
        assert a.shape == b.shape == (len(ids), compiled.vocab_size)
        assert torch.equal(a.argmax(-1), b.argmax(-1))
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-4)  # logits of magnitude ~10: float32 rounding
    for layer in range(compiled.n_layers):
        for se, sc, n, ids in zip(seqs[eager], seqs[compiled], lengths, news, strict=True):
            end = n + len(ids)
            torch.testing.assert_close(compiled.pool.k[layer][sc.id, :, :end], eager.pool.k[layer][se.id, :, :end])
            torch.testing.assert_close(compiled.pool.v[layer][sc.id, :, :end], eager.pool.v[layer][se.id, :, :end])
    for eng in (eager, compiled):
        for s in seqs[eng]:
            eng.free(s)


def test_warming_up_writes_the_scratch_slot_only(engines):
    """The compile `serve` runs before it listens is a pass of padding alone: no session's KV changes."""
    compiled = engines[0]
    held = [t[:-1].clone() for t in (*compiled.pool.k, *compiled.pool.v)]  # every slot but the scratch one
    compiled.warm()
    assert compiled.compiled.failed is None
    for before, t in zip(held, (*compiled.pool.k, *compiled.pool.v), strict=True):
        assert torch.equal(before, t[:-1])


def test_the_compiled_engine_decodes_the_eager_greedy_ids(engines, compiled_torch_target):
    """AR through the compiled pass (one session padded to two) gives the eager pass's ids."""
    from server_bridge.target import Target

    prompt = [1, 523, 4096, 77, 9000, 12]
    assert greedy(compiled_torch_target, prompt, 16) == greedy(Target(engines[1]), prompt, 16)


def test_a_compile_that_fails_leaves_the_eager_pass_with_one_warning(caplog):
    """A graph break where the whole pass must be one graph: the compiler refuses it, the pass runs eagerly."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(
        LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2)
    )  # fmt: skip
    make = lambda c: TorchEngine(Path("random"), "t", "cpu", "float32", 1, 4, max_len=64, model=model, compile=c)  # noqa: E731
    eng, eager = make("on"), make("off")

    def breaking(ids, positions, grid):
        torch._dynamo.graph_break()  # what an operator dynamo cannot trace does
        return eng._decode_grid(ids, positions, grid)

    eng.compiled = CompiledPass(breaking, eng.pool, eng.max_len, eng.device)
    with caplog.at_level(logging.WARNING, logger="server_bridge.engines.compile_torch"):
        for _ in range(2):  # the second pass goes straight to the eager one
            seqs = eng.new_sequence(), eager.new_sequence()
            got, want = (e.forward([Pass(s, 0, [5, 6, 7], 3)])[0] for e, s in zip((eng, eager), seqs, strict=True))
            assert torch.equal(got, want)  # the eager pass itself: bit for bit
            eng.free(seqs[0])
            eager.free(seqs[1])
    warnings = [r for r in caplog.records if r.name.endswith("compile_torch")]
    assert len(warnings) == 1 and "runs its passes eagerly" in warnings[0].getMessage()
    assert eng.compiled.failed and "eager" in eng.compiled.status()
