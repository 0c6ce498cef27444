"""tools.bench.payload's arithmetic: q_K as the wire has it, beta, the summaries, the checks and the merge.

No models: synthetic logits and synthetic run records.
"""

import numpy as np
import pytest

from protocol import payload, sampling
from protocol.sampling import SamplingParams
from tools.bench import payload as bp

T07 = SamplingParams(temperature=0.7)


def logits(seed: int, v: int = 1000) -> np.ndarray:
    return (np.random.default_rng(seed).normal(size=v) * 3).astype(np.float32)


def run(mode: str, rtt: float = 20, bw: float = 10, **kw) -> dict:
    r = {
        "mode": mode,
        "payload": "topk(K=16)" if mode == "topk" else mode,
        "rtt_ms": rtt,
        "bandwidth_mbps": bw,
        "tokens": 10,
        "wall_s": 1.0,
        "rounds": 2,
        "drafted": 8,
        "accepted": 6,
        "round_bytes_up": 100,
        "round_bytes_down": 60,
        "residuals": 0,
    }
    r.update(kw)
    return r


def test_acceptance_is_the_overlap_of_the_two_distributions():
    p = np.array([0.5, 0.5, 0.0])
    assert bp.acceptance(p, p) == pytest.approx(1.0)
    assert bp.acceptance(p, np.array([0.0, 0.0, 1.0])) == 0.0
    q = np.array([0.2, 0.3, 0.5])
    assert bp.acceptance(p, q) == pytest.approx(0.5) == pytest.approx(bp.acceptance(q, p))


def test_wire_q_full_is_the_fp16_table_the_draft_samples_from():
    x = logits(0)
    q = bp.wire_q(x, T07, None)
    want = sampling.quantize_q(sampling.probs_from_logits(x[None], T07))[1][0]
    assert q.sum() == pytest.approx(1.0)
    np.testing.assert_array_equal(q, want)


@pytest.mark.parametrize("k", [1, 4, 16])
def test_wire_q_topk_keeps_the_top_k_renormalized_and_fp16_rounded(k):
    x = logits(1)
    q = bp.wire_q(x, T07, k)
    probs = sampling.probs_from_logits(x[None], T07)[0]
    top = np.argsort(probs)[-k:]
    assert set(np.flatnonzero(q)) == set(top)
    assert q.sum() == pytest.approx(1.0)
    want = sampling.quantize_q((probs[top] / probs[top].sum())[None])[1][0]
    np.testing.assert_array_equal(np.sort(q[top]), np.sort(want))
    if k == 1:
        assert q[int(np.argmax(x))] == 1.0


def test_position_betas_full_matches_the_limit_of_large_k_and_k1_is_p_of_the_argmax():
    x = logits(2)
    v = len(x)
    betas = bp.position_betas(x, x, T07, [1, v])
    p = sampling.probs_from_logits(x[None], T07)[0]
    assert betas[None] == pytest.approx(1.0, abs=2e-3)  # only fp16 rounding separates q from p
    assert betas[v] == pytest.approx(betas[None], abs=1e-9)
    assert betas[1] == pytest.approx(p.max())


def test_summarize_topk_gaps_and_intervals():
    rng = np.random.default_rng(0)
    full = rng.uniform(0.8, 1.0, 200)
    betas = {None: full, 4: full - 0.1, 16: full - 0.01, 1: np.full(200, 0.5)}
    rows = bp.summarize_topk(betas, n_boot=500, seed=0)
    assert [r["k"] for r in rows] == [1, 4, 16, None]
    by_k = {r["k"]: r for r in rows}
    assert by_k[None]["gap_to_full"] == 0.0 and by_k[None]["gap_ci95"] == [0.0, 0.0]
    assert by_k[4]["gap_to_full"] == pytest.approx(0.1 / full.mean())
    assert 0 < by_k[16]["gap_to_full"] < by_k[4]["gap_to_full"]
    for r in rows:
        lo, hi = r["ci95"]
        assert lo <= r["acceptance"] <= hi and r["positions"] == 200
    assert by_k[1]["ci95"] == pytest.approx([0.5, 0.5])
    # paired: a constant offset from full has a narrower gap interval than the acceptance interval itself
    g_lo, g_hi = by_k[16]["gap_ci95"]
    assert g_hi - g_lo < by_k[16]["ci95"][1] - by_k[16]["ci95"][0]


def test_summarize_links_averages_over_rounds_and_skips_failed_runs():
    runs = [
        run("split", rounds=2, round_bytes_up=100, tokens=10, wall_s=1.0, residuals=1),
        run("split", rounds=3, round_bytes_up=200, tokens=20, wall_s=3.0, drafted=12, accepted=12),
        {"mode": "split", "payload": "split", "rtt_ms": 20, "bandwidth_mbps": 10, "error": "lost", "tokens": 3},
        run("none", bw=1),
        run("none", bw=100),
        run("full", rtt=50),
    ]
    rows = bp.summarize_links(runs)
    assert [(r["mode"], r["rtt_ms"], r["bandwidth_mbps"]) for r in rows] == [
        ("none", 20, 1),
        ("none", 20, 100),
        ("full", 50, 10),
        ("split", 20, 10),
    ]
    s = rows[-1]
    assert s["runs"] == 2 and s["failed"] == 1
    assert s["bytes_up_per_round"] == pytest.approx(300 / 5)
    assert s["tokens_per_s"] == pytest.approx(30 / 4.0)
    assert s["acceptance_rate"] == pytest.approx(18 / 20)
    assert s["residuals_per_round"] == pytest.approx(1 / 5)


def links_part(split_up: int, topk_accepted: int) -> dict:
    runs = [
        run("split", round_bytes_up=split_up),
        run("full", accepted=100, drafted=100),
        run("topk", accepted=topk_accepted, drafted=100),
    ]
    return {
        "config": {
            "gamma": 4,
            "topk": 16,
            "temperature": 0.7,
            "draft": "d",
            "target": "t",
            "prompts": 1,
            "max_tokens": 8,
            "server_cpus": [1],
            "agent_cpus": [0],
            "started": "now",
            "rtts_ms": [20],
            "bandwidths_mbps": [10],
        },
        "runs": runs,
        "summary": bp.summarize_links(runs),
    }


def topk_part(gap16: float) -> dict:
    rows = [
        {
            "draft": "d",
            "temperature": 0.7,
            "k": k,
            "positions": 10,
            "acceptance": 0.9 * (1 - g),
            "ci95": [0.8, 0.95],
            "gap_to_full": g,
            "gap_ci95": [g - 0.01, g + 0.01],
        }
        for k, g in ((1, 0.3), (payload.DEFAULT_TOPK, gap16), (None, 0.0))
    ]
    return {
        "config": {
            "drafts": ["d"],
            "temperatures": [0.7],
            "ks": [1, payload.DEFAULT_TOPK],
            "target": "t",
            "prompts": 1,
            "tokens": 8,
            "bootstrap": 10,
            "started": "now",
        },
        "rows": rows,
    }


def test_checks_pass_and_fail_on_the_two_claims():
    good = bp.checks({"links": links_part(split_up=2 * 60, topk_accepted=99), "topk": topk_part(0.01)})
    assert good["split_uplink"]["bytes_up_per_round"] == 60 and good["split_uplink"]["ok"]
    assert good["topk_gap_links"]["gap"] == pytest.approx(0.01) and good["topk_gap_links"]["ok"]
    assert [g["ok"] for g in good["topk_gap"]] == [True]
    bad = bp.checks({"links": links_part(split_up=2 * 65, topk_accepted=90), "topk": topk_part(0.05)})
    assert not bad["split_uplink"]["ok"] and not bad["topk_gap_links"]["ok"] and not bad["topk_gap"][0]["ok"]
    assert bp.checks({}) == {} and bp.check_lines({}) == ["no results to check"]
    assert len(bp.check_lines(bad)) == 3


def test_merge_keeps_the_other_part_and_recomputes_the_checks():
    old = {"links": links_part(120, 99), "topk": topk_part(0.05), "checks": {"stale": True}, "junk": 1}
    merged = bp.merge(old, {"topk": topk_part(0.01)})
    assert merged["links"] is old["links"] and merged["topk"]["rows"][1]["gap_to_full"] == 0.01
    assert "junk" not in merged and "stale" not in merged["checks"] and merged["checks"]["topk_gap"][0]["ok"]
    assert set(bp.merge(None, {"links": links_part(120, 99)})) == {"links", "checks"}


def test_reports_render_for_either_part_alone_and_both(tmp_path):
    both = bp.merge(None, {"links": links_part(120, 99), "topk": topk_part(0.01)})
    md = bp.REPORT.markdown(both | {"command": "x"})
    assert "| split | split | 20 | 10 | 60 |" in md and f"| {payload.DEFAULT_TOPK} | 0.891" in md
    assert "## Acceptance" not in bp.REPORT.markdown(bp.merge(None, {"links": links_part(120, 99)}) | {"command": ""})
    assert "## Bytes" not in bp.REPORT.markdown(bp.merge(None, {"topk": topk_part(0.01)}) | {"command": ""})
    bp.write_plots(tmp_path, both)
    assert (tmp_path / "payload_links.png").stat().st_size > 0 and (tmp_path / "payload_topk.png").stat().st_size > 0


def test_none_is_greedy_and_the_payload_modes_sample():
    assert bp.mode_params("none", 0.7, 3) == SamplingParams(0.0, 0, 3)
    assert bp.mode_params("split", 0.7, 3) == SamplingParams(0.7, 0, 3)
