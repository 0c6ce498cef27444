"""Robots per GPU (tools/bench/gpu_fleet.py) and its random target (tools/models/random_target.py), on the CPU.

The figures of the tiny form mean nothing; these check the replay keeps the recorded pair's acceptance,
the search finds the edge, and the random target speaks the draft's vocabulary in both engines. The whole
benchmark's end-to-end run on the toy target is the fleet phase of the GPU run's CPU rehearsal
(tests/tools/test_gpu_run.py).
"""

import numpy as np
import pytest

from protocol import modelfiles
from server_bridge.ops import loadtest
from server_bridge.ops.loadtest import Trace
from tools.bench import gpu_fleet as fleet
from tools.models import random_target

RECORDED = fleet.TRACES / "smollm2-q4_1__smollm2-f32.json"


# --------------------------------------------------------------------------- pure pieces


def test_the_search_doubles_then_bisects_to_the_edge():
    runs = []

    def run(n):
        runs.append(n)
        return {"8": n <= 37}

    found = loadtest.capacity_search(run, ["8"], start=1, max_n=512, refine=0.1)["8"]
    assert 34 <= found["capacity"] <= 37 and not found["lower_bound"]
    assert runs[:7] == [1, 2, 4, 8, 16, 32, 64] and len(runs) <= 11


def test_the_search_reports_lower_bounds_and_failures_at_the_smallest_fleet():
    assert loadtest.capacity_search(lambda n: {"2": True}, ["2"], start=4, max_n=16)["2"] == {
        "capacity": 16,
        "lower_bound": True,
        "tried": [4, 8, 16],
    }
    assert loadtest.capacity_search(lambda n: {"8": False}, ["8"], ns=(1, 2))["8"]["capacity"] == 0
    # fixed sizes stop once every class has failed
    seen = []
    loadtest.capacity_search(lambda n: seen.append(n) or {"8": n < 2, "2": n < 4}, ["8", "2"], ns=(1, 2, 4, 8))
    assert seen == [1, 2, 4]


def test_one_sweep_serves_every_class_for_the_peer():
    caps = loadtest.capacity_search(
        lambda n: {"8": n <= 5, "4": n <= 10, "2": n <= 20}, ["8", "4", "2"], start=1, max_n=64, refine=0.01
    )
    assert {c: v["capacity"] for c, v in caps.items()} == {"8": 5, "4": 10, "2": 20}


def test_generations_are_judged_again_at_each_tighter_rate():
    recs = [{"in_sample": True, "violated": False, "tokens_per_s": s} for s in (9.0, 5.0, 3.0)] + [
        {"in_sample": True, "violated": True, "tokens_per_s": None},
        {"in_sample": False, "violated": False, "tokens_per_s": 1.0},
    ]
    j = fleet.judged(recs, (8, 4, 2))
    assert [j[c]["violation_rate"] for c in ("8", "4", "2")] == [0.75, 0.5, 0.25]
    assert all(j[c]["decided"] == 4 and j[c]["passes"] is False for c in j)


def test_the_planted_path_is_one_cycle_through_the_normal_tokens():
    types = random_target.token_types()
    succ = random_target.planted_successor(types, seed=0)
    normal = np.flatnonzero(types == random_target.NORMAL_TOKEN)
    assert set(succ.tolist()) <= set(normal.tolist())  # never an end-of-text or control token
    t, seen = int(normal[0]), set()
    for _ in range(len(normal)):
        seen.add(t)
        t = int(succ[t])
    assert t == normal[0] and len(seen) == len(normal)  # one cycle, every normal token on it


def test_the_replayed_robots_keep_the_recorded_pairs_acceptance():
    recorded = Trace.load(RECORDED)
    succ = random_target.planted_successor(random_target.token_types(), seed=0)
    replay = fleet.replay_trace(recorded, succ, "random.gguf")
    assert replay.vocab_hash == recorded.vocab_hash and replay.target == "random.gguf"
    for rp, pp in zip(recorded.prompts, replay.prompts, strict=True):
        assert pp.prompt_ids == rp.prompt_ids and len(pp.target_ids) == len(rp.target_ids)
        assert pp.target_ids == random_target.greedy_path(succ, rp.prompt_ids[-1], len(rp.target_ids))
        for i, (rc, pc) in enumerate(zip(rp.chains, pp.chains, strict=True)):
            assert len(pc) == recorded.gamma_max
            assert fleet.agreement(pc, pp.target_ids[i:]) == fleet.agreement(rc, rp.target_ids[i:])
    for gamma in (1, 4, 8):
        assert fleet.planned_tau(replay, gamma, 48) == pytest.approx(fleet.planned_tau(recorded, gamma, 48))
    assert 1.0 < fleet.planned_tau(replay, 4, 48) <= 5.0


def test_the_peer_sweep_judges_every_class_from_one_set_of_points(monkeypatch, tmp_path):
    from tools.bench import peer

    def fake_point(model, trace, n, cfg, **kw):
        speed = 40.0 / n  # the fleet shares 40 tok/s
        assert cfg.classes == (2,) and kw["extra_args"] == []
        recs = [{"in_sample": True, "violated": speed < 2, "tokens_per_s": speed} for _ in range(n)]
        return {
            "generation_records": recs,
            "matches_trace": True,
            "server_start_s": 0.1,
            "goodput_tokens_per_s": 40.0,
            "tokens_per_round": 1.0,
            "round_ms_mean": 1.0,
            "round_ms_p95": 2.0,
            "sheds": 0,
            "errors": [],
        }

    monkeypatch.setattr(peer, "fleet_point", fake_point)
    monkeypatch.setattr(peer, "server_version", lambda b: "version: fake")
    cfg = fleet.FleetConfig(tiny=True, device="cpu", classes=(8, 4, 2), refine=0.01)
    res = fleet.run_peer(
        cfg, type("T", (), {"gguf": tmp_path / "x.gguf"})(), None, 64, tmp_path / "llama-server", {}, lambda m: None
    )
    assert {c: v["capacity"] for c, v in res["capacity"].items()} == {"8": 5, "4": 10, "2": 20}


# --------------------------------------------------------------------------- with models


@pytest.mark.real
def test_the_random_target_is_one_model_in_both_engines_with_the_drafts_vocabulary():
    from server_bridge.engines import Pass, load_engine

    target = random_target.make(random_target.TINY, "f32", seed=0, log=lambda m: None)
    shipped = random_target.gguf_vocab_hash(modelfiles.shipped_gguf())
    assert random_target.gguf_vocab_hash(target.gguf) == shipped
    prompt = list(range(100, 140))
    logits = {}
    for engine, path in (("llamacpp", target.gguf), ("torch", target.hf_dir)):
        eng = load_engine(
            str(path), engine=engine, device="cpu", dtype="float32", max_sequences=2, kv_tokens=512, max_len=256
        )
        assert eng.vocab_hash == shipped and eng.vocab_size == 49152
        logits[engine] = eng.to_numpy(eng.forward([Pass(eng.new_sequence(), 0, prompt, len(prompt))])[0])
    # the same function (Q and K permuted as llama.cpp's converter does: a wrong permutation differs by ~7e-4)
    assert np.abs(logits["llamacpp"] - logits["torch"]).max() < 2e-4
    succ = random_target.planted_successor(random_target.token_types(), 0)
    assert (logits["torch"].argmax(-1) == succ[prompt]).all()  # the planted path wins at every position


@pytest.mark.real
@pytest.mark.parametrize("dtype", random_target.QUANTIZED)
def test_the_quantized_random_target_is_written_as_blocks_and_both_engines_follow_its_path(tmp_path, dtype):
    """The GPU run's target: llama.cpp's blocks of random values written directly (no F16 file, no quantizer
    pass), the scale giving each tensor its standard deviation; the torch engine builds the model from the
    weightless recipe directory. Both follow the planted path, in the shipped vocabulary."""
    import gguf

    from server_bridge.engines import random_init

    target = random_target.make(random_target.TINY, dtype, seed=0, directory=tmp_path, log=lambda m: None)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([target.gguf.name, target.hf_dir.name])
    assert random_init.is_recipe(target.hf_dir) and not list(target.hf_dir.glob("*.safetensors"))
    reader = gguf.GGUFReader(str(target.gguf))
    kinds = {t.name: t.tensor_type.name for t in reader.tensors}
    assert kinds["token_embd.weight"] == kinds["output.weight"] == "F16" and kinds["blk.0.attn_norm.weight"] == "F32"
    assert {kinds[n] for n in kinds if n.startswith("blk.") and n.endswith("_q.weight")} == {dtype.upper()}
    tensor_bytes = sum(int(t.n_bytes) for t in reader.tensors)
    assert abs(tensor_bytes / random_target.TINY.weight_bytes(dtype) - 1) < 0.001  # the roofline's bytes
    up = next(t for t in reader.tensors if t.name == "blk.1.ffn_up.weight")
    values = gguf.quants.dequantize(up.data, up.tensor_type)
    assert abs(values.std() / random_target.INIT_STD - 1) < 0.05 and abs(values.mean()) < 1e-4  # no bias
    assert np.abs(values.reshape(values.shape[0], -1).mean(axis=1)).max() < 0.01  # no row leans
    shipped = random_target.gguf_vocab_hash(modelfiles.shipped_gguf())
    for engine, path in (("llamacpp", target.gguf), ("torch", target.hf_dir)):
        result = random_target.check(path, engine, dtype="float32")
        assert result["follows_path"] and result["vocab_hash"] == shipped, result


@pytest.mark.real
def test_the_vocabulary_alone_stands_in_for_the_shipped_draft(tmp_path, monkeypatch):
    """vocab.gguf (what travels in the draft's place) holds no tensor, and a target made from it has the shipped
    draft's vocabulary, so a robot's hello passes the server's check."""
    import gguf

    vocab = random_target.vocab_gguf(tmp_path / "vocab.gguf")
    assert vocab.stat().st_size < 4 * 2**20 and not gguf.GGUFReader(str(vocab)).tensors
    monkeypatch.setenv(random_target.VOCAB_ENV, str(vocab))
    assert random_target.vocabulary_gguf() == vocab
    target = random_target.make(random_target.TINY, "q8_0", seed=0, directory=tmp_path, log=lambda m: None)
    assert random_target.gguf_vocab_hash(target.gguf) == random_target.gguf_vocab_hash(modelfiles.shipped_gguf())
