"""The llamacpp engine's settings for a GPU: per-sequence KV streams, micro-batches, and the weights' real type."""

from __future__ import annotations

import subprocess
import sys

import llama_cpp
import numpy as np
import pytest

from protocol import modelfiles
from server_bridge.config import ServerConfig
from server_bridge.engines import EngineFull, Pass, load_engine

pytestmark = pytest.mark.real

PROMPTS = ["The robot walked to the kitchen door and", "Turn left at the red box, then", "Go"]


def ragged_rounds(engine, rounds: int = 3) -> list[list[np.ndarray]]:
    """Three sessions of different lengths: their prompts in one pass, then verify-shaped passes of 1-5 tokens
    with a rollback each round (start behind the sequence's length), every row's logits kept."""
    seqs = [engine.new_sequence() for _ in PROMPTS]
    ids = [engine.tokenizer.encode(p) for p in PROMPTS]
    out = [engine.forward([Pass(s, 0, i, len(i)) for s, i in zip(seqs, ids, strict=True)])]
    for r in range(rounds):
        batch = [
            Pass(s, len(i) + r, [(7 * k + r + j) % 1000 + 10 for j in range(1 + (k + r) % 5)], 1 + (k + r) % 5)
            for k, (s, i) in enumerate(zip(seqs, ids, strict=True))
        ]
        out.append(engine.forward(batch))
    for s in seqs:
        engine.free(s)
    return out


def test_per_sequence_streams_and_micro_batches_give_the_unified_engines_logits():
    ref = ragged_rounds(load_engine("smollm2-f32", threads=1, max_sequences=4, kv_tokens=1024, kv_unified=True))
    for options in ({"kv_unified": False}, {"kv_unified": False, "n_ubatch": 4}, {"flash_attn": "on"}):
        engine = load_engine("smollm2-f32", threads=1, max_sequences=4, kv_tokens=1024, **options)
        assert engine.info.extra["kv_unified"] == options.get("kv_unified", True)
        got = ragged_rounds(engine)
        for rows_ref, rows in zip(ref, got, strict=True):
            for a, b in zip(rows_ref, rows, strict=True):
                assert a.shape == b.shape
                assert np.array_equal(a.argmax(-1), b.argmax(-1)), options
                assert np.abs(a - b).max() < 0.05, options  # f16 KV and another summation order, no more


def test_a_session_longer_than_its_stream_is_refused_and_the_others_keep_their_kv():
    engine = load_engine("smollm2-f32", threads=1, max_sequences=4, kv_tokens=256, kv_unified=False)
    assert engine.seq_capacity == 64
    a, b = engine.new_sequence(), engine.new_sequence()
    engine.forward([Pass(a, 0, list(range(10, 60)), 1)])
    with pytest.raises(EngineFull, match="holds 64 tokens"):
        engine.forward([Pass(a, 50, list(range(10, 30)), 1), Pass(b, 0, [11, 12], 1)])
    assert a.length == 50 and b.length == 0  # nothing half-written
    [row] = engine.forward([Pass(a, 50, list(range(60, 74)), 1)])  # exactly the stream's 64
    assert row.shape == (1, engine.vocab_size)


def test_exits_need_the_unified_kv_in_one_micro_batch():
    with pytest.raises(ValueError, match="kv_unified"):
        load_engine("smollm2-f32", threads=1, max_sequences=2, kv_tokens=256, tap_layers=[12], kv_unified=False)
    with pytest.raises(ValueError, match="micro-batch"):
        load_engine("smollm2-f32", threads=1, max_sequences=2, kv_tokens=256, tap_layers=[12], n_ubatch=8)


def test_the_weights_real_type_is_reported():
    f32 = load_engine("smollm2-f32", threads=1, max_sequences=1, kv_tokens=256)
    assert (f32.info.dtype, f32.info.extra["weights"]) == ("float32", "F32")
    q41 = load_engine(str(modelfiles.shipped_gguf()), threads=1, max_sequences=1, kv_tokens=256)
    assert (q41.info.dtype, q41.info.extra["weights"]) == ("q4_1", "Q4_1")
    assert q41.info.as_dict()["dtype"] == "q4_1"  # what welcome, /healthz and /metrics carry


def test_the_server_config_carries_the_options_and_checks_them():
    assert ServerConfig().llama_options == {"kv_unified": None, "n_ubatch": 0, "flash_attn": "auto"}
    assert ServerConfig(kv_unified="off", n_ubatch=64).llama_options["kv_unified"] is False
    for bad in ({"kv_unified": "yes"}, {"flash_attn": "maybe"}, {"n_ubatch": -1}):
        with pytest.raises(ValueError):
            ServerConfig(**bad)


def test_two_processes_making_the_same_target_at_once_both_succeed_and_leave_one_whole_file(tmp_path):
    """Two servers starting on one models/build: each quantizes into a temporary name of its own process,
    so neither reads or renames the other's half-written file."""
    dst = tmp_path / "smollm2-q8_0.gguf"
    script = (
        "import sys; from server_bridge.engines.llamacpp import requantize; "
        "requantize(sys.argv[1], sys.argv[2], 'LLAMA_FTYPE_MOSTLY_Q8_0')"
    )
    procs = [
        subprocess.Popen([sys.executable, "-c", script, str(modelfiles.shipped_gguf()), str(dst)]) for _ in range(2)
    ]
    assert [p.wait(120) for p in procs] == [0, 0]
    assert sorted(p.name for p in tmp_path.iterdir()) == [dst.name, dst.name + ".log"]  # no temporary left
    model = llama_cpp.Llama(str(dst), vocab_only=True, verbose=False)  # whole: its header and vocabulary load
    assert model.n_vocab() == 49152


def test_the_cpu_runs_a_pass_in_cache_sized_micro_batches_unless_exits_are_tapped():
    from server_bridge.engines.llamacpp import CPU_UBATCH

    plain = load_engine("smollm2-f32", threads=1, max_sequences=2, kv_tokens=256)
    assert plain.info.extra["n_ubatch"] == CPU_UBATCH and plain.packed
    tapped = load_engine("smollm2-f32", threads=1, max_sequences=2, kv_tokens=256, tap_layers=[12])
    assert tapped.info.extra["n_ubatch"] == tapped.n_batch  # the tapped rows arrive in order
    assert (
        load_engine("smollm2-f32", threads=1, max_sequences=2, kv_tokens=256, n_ubatch=64).info.extra["n_ubatch"] == 64
    )


def test_the_batch_invariant_mode_gives_every_verify_row_the_one_token_pass_bits():
    """batch_invariant = "on" (llamacpp._invariant): a session's verify rows, alone or sharing a pass with other
    sessions at other draft lengths, after a rejected draft too, are the rows the one-token passes at those
    positions compute, bit for bit. Without it they differ by rounding (docs/benchmarks/batch_invariant_cpu/)."""
    from server_bridge.target import Extension, load_target

    target = load_target(None, threads=1, max_sequences=6, kv_tokens=1536, batch_invariant="on")
    assert target.engine.info.extra["batch_invariant"] and not target.engine.kv_unified
    prompts = [target.engine.tokenizer.encode(p) for p in PROMPTS]
    ar = []  # per prompt: 14 greedy ids and their one-token rows
    for ids in prompts:
        state = target.new_state(ids)
        toks, rows = [], []
        for _ in range(14):
            row = np.array(target.score(state, [])[0])
            toks.append(int(row.argmax()))
            rows.append(row)
            target.commit(state, toks[-1:], len(state.ids))
        ar.append((toks, rows))
    states = [target.new_state(ids) for ids in prompts]
    pos = [0, 0, 0]
    for gammas in ([3, 1, 4], [2, 4, 0], [1, 2, 3]):  # each round one pass of all three
        drafts = [ar[i][0][pos[i] : pos[i] + g] for i, g in enumerate(gammas)]
        drafts[1] = drafts[1][:-1] + [7] if drafts[1] else drafts[1]  # a wrong last token: rejected
        exts = [Extension(s, s.ids[s.cached :] + d, len(d) + 1) for s, d in zip(states, drafts, strict=True)]
        for i, rows in enumerate(target.extend(exts)):
            accepted = next((j for j, t in enumerate(drafts[i]) if t != ar[i][0][pos[i] + j]), len(drafts[i]))
            for j in range(accepted + 1):  # the rows up to the first wrong token's
                assert np.array_equal(np.asarray(rows[j]), ar[i][1][pos[i] + j]), (i, pos[i] + j)
            keep = drafts[i][:accepted] + [ar[i][0][pos[i] + accepted]]
            target.commit(states[i], keep, len(states[i].ids) + accepted)
            pos[i] += accepted + 1


def test_the_batch_invariant_mode_refuses_what_it_cannot_keep():
    with pytest.raises(ValueError, match="early exits need one unified pass"):
        load_engine("smollm2-f32", threads=1, max_sequences=2, kv_tokens=256, tap_layers=[4], batch_invariant="on")
    with pytest.raises(ValueError, match="needs kv_unified off"):
        load_engine("smollm2-f32", threads=1, max_sequences=2, kv_tokens=256, kv_unified=True, batch_invariant="on")
