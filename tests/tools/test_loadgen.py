"""tools.bench.loadgen: capacities per policy, the committed traces, the server's logged config, reports, the
CLI and (marked real) one small sweep against a real server-bridge with exactness checked token by token (the
robots, the SLO rule and capacity search themselves: tests/server_bridge/ops/test_loadtest.py)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from server_bridge.ops import loadtest as lt
from tests.server_bridge.ops.test_loadtest import synthetic_trace
from tools.bench import loadgen as lg

pytestmark = pytest.mark.timeout(120)

TRACES = lg.TRACES


def point(pair, policy, n, rate, by_class):
    return {
        "pair": pair,
        "policy": policy,
        "n": n,
        "violation_rate": rate,
        "violation_rate_by_class": by_class,
        "passes": lt.point_passes(rate, by_class),
    }


def test_capacities_per_policy_and_class_and_the_slo_over_fcfs_ratio():
    table = {  # N: (fcfs overall, fcfs class 8, slo overall, slo class 8); class 2 always fine
        2: (0.0, 0.0, 0.0, 0.0),
        4: (0.02, 0.04, 0.0, 0.0),
        8: (0.10, 0.40, 0.01, 0.03),
        12: (0.30, 0.90, 0.04, 0.05),
        16: (0.50, 1.0, 0.20, 0.60),
    }
    points = []
    for n, (f, f8, s, s8) in table.items():
        points.append(point("p", "fcfs", n, f, {"8": f8, "2": 0.0}))
        points.append(point("p", "slo", n, s, {"8": s8, "2": 0.0}))
    caps = lg.capacities(points, (8, 2))["p"]
    assert caps["policies"]["fcfs"]["capacity"] == 4
    assert caps["policies"]["slo"]["capacity"] == 12
    assert caps["policies"]["fcfs"]["by_class"] == {"8": 4, "2": 16}
    assert caps["policies"]["slo"]["by_class_lower_bound"] == {"8": False, "2": True}
    assert caps["ratio_slo_over_fcfs"]["overall"] == 3.0
    assert caps["ratio_slo_over_fcfs"]["class_8"] == 3.0


@pytest.mark.parametrize("pair", ["smollm2-q4_1", "smollm2-q2_k"])
def test_the_committed_traces_are_small_and_consistent(pair):
    path = TRACES / f"{pair}__smollm2-f32.json"
    if not path.exists():
        pytest.skip(f"{path} not recorded (python -m tools.train.record_traces)")
    t = lt.Trace.load(path)
    assert path.stat().st_size < 1024 * 1024 and t.gamma_max >= 4 and len(t.prompts) >= 3
    for p in t.prompts:
        assert len(p.target_ids) >= 8 and all(len(c) == t.gamma_max for c in p.chains)


def test_the_servers_logged_config_is_read_back():
    log = (
        '2026-01-01 INFO server_bridge: config in use: {"scheduler": "slo", "max_batch": 8}\n'
        "2026-01-01 INFO server_bridge.server: listening\n"
    )
    assert lg.server_config(log) == {"scheduler": "slo", "max_batch": 8}
    assert lg.server_config("nothing here\n") is None


def test_reports_render_with_missing_classes_and_failed_points(tmp_path):
    trace = synthetic_trace()
    points = []
    for n, policy, violated in [(2, "fcfs", False), (2, "slo", False), (4, "fcfs", True), (4, "slo", False)]:
        out = lt.PointLog(window=(0.0, 10.0), ended=10.0)
        out.generations = [
            lt.Generation(
                0, 8, 0, 16, opened=1.0, tokens=trace.prompts[0].target_ids[:16], done=10.0 if violated else 2.0
            )
        ]
        points.append(
            {
                "pair": "fake-draft",
                "target": "fake-target",
                "policy": policy,
                "n": n,
                **lt.summarize(out, trace, (8, 2)),
                "server_metrics": lt.server_figures({}),
            }
        )
    cfg = {
        **dataclasses.asdict(lt.LoadConfig(classes=(8, 2))),
        "ns": [2, 4],
        "policies": ["fcfs", "slo"],
        "pairs": ["fake-draft"],
        "target": "fake-target",
        "scheduler_flag": True,
        "server_cpus": [1],
        "server_threads": 1,
        "client_cpus": [0],
        "max_violation": lt.MAX_VIOLATION,
        "started": "now",
    }
    result = {"config": cfg, "points": points, "capacities": lg.capacities(points, (8, 2))}
    assert result["capacities"]["fake-draft"]["ratio_slo_over_fcfs"]["overall"] == 2.0
    result["capacity"], result["target"] = lg.capacity_rows(result), "fake-target"
    for p in points:
        p["exactness"] = lg._exactness(p)
    md = lg.REPORT.markdown(result)
    assert "| fake-draft | fcfs | 2 | - | 2 |" in md and "| fake-draft | slo | >= 4 | - | >= 4 |" in md
    lg.REPORT.write(tmp_path, result)
    assert (tmp_path / "loadgen.png").stat().st_size > 0


def test_the_cli_refuses_unknown_policies():
    with pytest.raises(SystemExit):
        lg.main(["--policies", "fcfs,lifo", "--out", "/nonexistent"])


# --------------------------------------------------------------------------- end to end (real server)


@pytest.mark.real
def test_a_small_sweep_against_the_real_server_is_exact_and_writes_its_report(tmp_path):
    trace_path = TRACES / "smollm2-q4_1__smollm2-f32.json"
    if not trace_path.exists():
        pytest.fail(f"{trace_path} missing: python -m tools.train.record_traces")
    rc = lg.main(
        [
            "--n",
            "2",
            "--policies",
            "fcfs",
            "--pairs",
            "smollm2-q4_1",
            "--window-s",
            "3",
            "--warmup-s",
            "1",
            "--tokens",
            "16",
            "--keep-tokens",
            "--out",
            str(tmp_path),
        ]
    )
    result = json.loads((tmp_path / "loadgen.json").read_text())
    assert (tmp_path / "loadgen.md").read_text().startswith("# Multi-robot load")
    assert (tmp_path / "loadgen.png").stat().st_size > 0
    trace = lt.Trace.load(trace_path)
    [p] = result["points"]
    assert p["n"] == 2 and p["policy"] == "fcfs" and not p["errors"]
    gens = p["generation_records"]
    assert gens and sum(g["tokens"] for g in gens) >= 16
    for g in gens:  # greedy equivalence, token by token
        assert g["token_ids"] == trace.prompts[g["prompt"]].target_ids[: len(g["token_ids"])]
    assert p["rounds"] > 0 and p["goodput_tokens_per_s"] > 0
    assert any(k.startswith("bridge_rounds_total") for k in p["server_metrics"]["end"])
    assert "fcfs" in result["capacities"]["smollm2-q4_1"]["policies"]
    assert p["decided"] >= 1
    assert rc == 0


# --------------------------------------------------------------------------- the planner picks gamma


def test_the_planner_drafts_longer_for_a_draft_that_agrees_more(tmp_path):
    """--gamma plan: tools/bench/planner.py's DP over the fitted estimator chooses the draft length per N."""
    est = tmp_path / "est.json"
    est.write_text(json.dumps({"a": 2.9, "b_c": 1.5e-4, "b_r": 0.12, "c": 130.0}))
    cfg = lt.LoadConfig()
    good = synthetic_trace()  # every chain starts with the target token
    bad = dataclasses.replace(
        good,
        prompts=[
            lt.TracePrompt(p.prompt_ids, p.target_ids, [[5] + c[1:] if i % 2 else c for i, c in enumerate(p.chains)])
            for p in good.prompts
        ],
    )
    assert lg.trace_alpha(good) == 1.0 and lg.trace_alpha(bad) == 0.5
    g_good, plan = lg.planned_gamma(good, 4, cfg, est)
    g_bad, _ = lg.planned_gamma(bad, 4, cfg, est)
    assert 1 <= g_bad < g_good <= good.gamma_max
    assert plan["gammas"] == (g_good,) and sorted(i for b in plan["batches"] for i in b) == [0, 1, 2, 3]


@pytest.mark.real
def test_a_divergence_is_a_near_tie_only_between_the_targets_top_two():
    """near_ties: the target's own one-token pass at the divergence decides, and only its top two can tie."""
    import numpy as np

    from tools.logit_margin import top2

    trace = lt.Trace.load(TRACES / "smollm2-q4_1__smollm2-f32.json")
    p = trace.prompts[0]
    lg.near_ties({"generation_records": []}, [], trace)  # nothing diverged: no model loaded
    from server_bridge.target import load_target

    solo = load_target(trace.target, threads=1, max_sequences=1, kv_tokens=1024)
    _, second, _, margin = top2(np.asarray(solo.score(solo.new_state(p.prompt_ids + p.target_ids[:3]), [])[0]))
    gens = [
        lt.Generation(0, 8, 0, 8, 0.0, tokens=p.target_ids[:3] + [second]),
        lt.Generation(
            1, 8, 0, 8, 0.0, tokens=p.target_ids[:3] + [next(t for t in range(3) if t not in (p.target_ids[3], second))]
        ),
        lt.Generation(2, 8, 0, 8, 0.0, tokens=p.target_ids[:5]),
    ]
    point = {"generation_records": [{"exact": False}, {"exact": False}, {"exact": True}]}
    lg.near_ties(point, gens, trace, bound=margin + 1e-3)
    first, other, fine = point["generation_records"]
    assert first["divergence"]["at"] == 3 and first["divergence"]["near_tie"]
    assert first["divergence"]["margin"] == pytest.approx(margin, abs=1e-2)
    assert not other["divergence"]["near_tie"] and "divergence" not in fine
    assert point["near_ties"] == 1 and not point["exact_up_to_near_ties"]
    point = {"generation_records": [{"exact": False}]}
    lg.near_ties(point, gens[:1], trace, bound=margin / 2)  # the same pair, farther apart than the bound
    assert not point["exact_up_to_near_ties"]
