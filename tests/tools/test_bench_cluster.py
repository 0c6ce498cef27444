"""tools.bench.cluster's pure parts: core layout, the grid's stop rule, capacity and its ratio, the overhead's
statistics and block order, and the report on a small fake result (no model, no fleet)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tools.bench import cluster as bc

# --------------------------------------------------------------------------- cores


def test_layout_on_two_cores_puts_one_replica_beside_the_robots_and_two_on_both():
    assert bc.layout(1, [0, 1]) == ({0}, [{1}], False)
    assert bc.layout(2, [0, 1]) == ({0}, [{0}, {1}], True)


def test_layout_with_cores_to_spare_gives_every_replica_its_own():
    assert bc.layout(2, [0, 1, 2, 3]) == ({0}, [{1}, {2}], False)
    assert bc.layout(1, [5]) == ({5}, [{5}], True)


# --------------------------------------------------------------------------- grid and capacity


def test_grid_stops_after_two_failures_in_a_row_only():
    assert not bc.should_stop([True, False])
    assert not bc.should_stop([False, True, False])
    assert bc.should_stop([True, False, False])
    assert not bc.should_stop([False])


def _points(passes: dict[int, bool]) -> list[dict]:
    return [{"n": n, "passes": ok} for n, ok in passes.items()]


def test_fleet_capacity_is_the_largest_n_with_every_smaller_passing():
    assert bc.fleet_capacity(_points({2: True, 3: True, 4: False, 6: True})) == {
        "capacity": 3,
        "lower_bound": False,
        "ns_run": [2, 3, 4, 6],
    }
    assert bc.fleet_capacity(_points({2: False, 3: False}))["capacity"] == 0
    whole = bc.fleet_capacity(_points({2: True, 4: True}))
    assert whole["capacity"] == 4 and whole["lower_bound"]


def test_ratio_exact_and_bounded_by_the_grid_edge():
    one = {"capacity": 4, "lower_bound": False}
    r = bc.capacity_ratio(one, {"capacity": 8, "lower_bound": False})
    assert r["ratio"] == 2.0 and r["bound"] == "" and r["meets_aim"] is True
    r = bc.capacity_ratio(one, {"capacity": 6, "lower_bound": False})
    assert r["ratio"] == 1.5 and r["meets_aim"] is False
    # 2 replicas passed their whole grid: the ratio is at least 1.5, which does not settle the aim
    r = bc.capacity_ratio(one, {"capacity": 6, "lower_bound": True})
    assert r["bound"] == ">=" and r["meets_aim"] is None
    # 1 replica passed its whole grid: at most 2.0, which does not settle it either
    r = bc.capacity_ratio({"capacity": 4, "lower_bound": True}, {"capacity": 8, "lower_bound": False})
    assert r["bound"] == "<=" and r["meets_aim"] is None
    r = bc.capacity_ratio({"capacity": 4, "lower_bound": True}, {"capacity": 6, "lower_bound": False})
    assert r["meets_aim"] is False


def test_ratio_undefined_when_one_replica_fails_at_the_smallest_n():
    r = bc.capacity_ratio({"capacity": 0, "lower_bound": False}, {"capacity": 4, "lower_bound": False})
    assert r["ratio"] is None and r["meets_aim"] is None


# --------------------------------------------------------------------------- overhead


def test_block_order_is_abba_with_as_many_blocks_of_each_path():
    assert bc.block_order(20, 5) == ["direct", "lb", "lb", "direct"] * 2
    assert bc.block_order(3, 5) == ["direct", "lb"]
    order = bc.block_order(30, 5)
    assert order.count("direct") == order.count("lb") == 6


def test_overhead_stats_medians_p99_and_their_differences():
    direct = [10.0] * 99 + [30.0]
    lb = [11.0] * 99 + [40.0]
    s = bc.overhead_stats(direct, lb, boots=200)
    assert s["direct"]["rounds"] == 100 and s["direct"]["median"] == 10.0
    assert s["lb"]["median"] == 11.0
    assert s["added"]["median"] == pytest.approx(1.0)
    assert s["added"]["p99"] == pytest.approx(np.percentile(lb, 99) - np.percentile(direct, 99))
    lo, hi = s["added"]["median_ci95"]
    assert lo <= 1.0 <= hi


def test_group_differences_per_abba_group_of_block_medians():
    blocks = [
        {"path": p, "median": m}
        for p, m in (("direct", 10.0), ("lb", 12.0), ("lb", 14.0), ("direct", 12.0), ("direct", 20.0), ("lb", None))
    ]
    # (12 + 14) / 2 - (10 + 12) / 2 = 2; the last, short group has no lb median: left out
    assert bc.group_differences(blocks) == [2.0]
    assert bc.group_differences(blocks[:2]) == [2.0]


def test_overhead_stats_without_rounds_on_a_path():
    assert bc.overhead_stats([], [1.0]) == {"direct": None, "lb": None, "added": None}


# --------------------------------------------------------------------------- report


def _point(replicas: int, n: int, rate: float, passes: bool, spread: dict) -> dict:
    return {
        "replicas": replicas,
        "n": n,
        "violation_rate": rate,
        "decided": 3 * n,
        "goodput_tokens_per_s": 9.5 * n,
        "round_ms_mean": 120.0,
        "round_ms_p95": 200.0,
        "sheds": 0,
        "spread": spread,
        "connections_mid_window": {k: v for k, v in spread.items()},
        "exact": True,
        "near_ties": 0,
        "exact_up_to_near_ties": True,
        "passes": passes,
        "errors": [],
    }


def fake_result() -> dict:
    cfg = {
        "gamma": 4,
        "draft_ms": 8.0,
        "tokens": 48,
        "classes": [8],
        "warmup_s": 3.0,
        "window_s": 8.0,
        "ns": [2, 4, 6],
        "pair": "smollm2-q4_1",
        "target": "smollm2-f32",
        "max_violation": 0.05,
        "stop_after_fails": 2,
        "cpu_count": 2,
        "commit": "abc123",
        "dirty": True,
        "command": "python -m tools.bench.cluster --n 2,4,6",
        "started": "t0",
        "finished": "t1",
    }
    one = {
        "replicas": 1,
        "client_cpus": [0],
        "replica_cpus": [[1]],
        "robots_share_a_replica_core": False,
        "points": [
            _point(1, 2, 0.0, True, {"r0": 2}),
            _point(1, 4, 0.25, False, {"r0": 4}),
            _point(1, 6, 0.6, False, {"r0": 6}),
        ],
    }
    two = {
        "replicas": 2,
        "client_cpus": [0],
        "replica_cpus": [[0], [1]],
        "robots_share_a_replica_core": True,
        "points": [
            _point(2, 2, 0.0, True, {"r0": 1, "r1": 1}),
            _point(2, 4, 0.0, True, {"r0": 2, "r1": 2}),
            _point(2, 6, 0.1, False, {"r0": 4, "r1": 2}),
        ],
    }
    for run in (one, two):
        run.update(bc.fleet_capacity(run["points"]))
    direct, lb = [100.0, 101.0, 102.0, 140.0], [101.0, 102.0, 103.0, 150.0]
    blocks = [
        {"path": "direct", "rounds": 2, "median": 100.5},
        {"path": "lb", "rounds": 2, "median": 101.5},
        {"path": "lb", "rounds": 2, "median": 126.5},
        {"path": "direct", "rounds": 2, "median": 121.0},
    ]
    overhead = {
        "blocks": blocks,
        "block_s": 5.0,
        "errors": [],
        **bc.overhead_stats(direct, lb, 100),
        "added_median_by_group": bc.group_differences(blocks),
        "round_ms": {"direct": direct, "lb": lb},
    }
    return {"config": cfg, "runs": {"1": one, "2": two}, "ratio": bc.capacity_ratio(one, two), "overhead": overhead}


def test_markdown_has_a_table_per_replica_count_capacities_ratio_overhead_and_caveat():
    md = bc.render_markdown(fake_result())
    assert md.count("| N | violations |") == 2
    assert "## 1 replica(s)" in md and "## 2 replica(s)" in md
    assert "| 1 | 2 |" in md and "| 2 | 4 |" in md  # capacities
    assert "**2.00**" in md and "met" in md
    assert "r0 2 / r1 2" in md  # spread over replicas
    assert "added by HAProxy" in md and "+1.00" in md and "ABBA group" in md and "+3.25 ms" in md
    assert "4 blocks" not in md and "2 blocks of 5 s per path" in md
    assert "`python -m tools.bench.cluster --n 2,4,6`" in md and "abc123" in md
    assert "sharing r0's core" in md and "2 cores" in md


def test_markdown_without_overhead_and_with_a_ratio_bounded_below():
    r = fake_result()
    r["overhead"] = None
    r["runs"]["2"]["points"] = r["runs"]["2"]["points"][:2]
    r["runs"]["2"].update(bc.fleet_capacity(r["runs"]["2"]["points"]))
    r["ratio"] = bc.capacity_ratio(r["runs"]["1"], r["runs"]["2"])
    md = bc.render_markdown(r)
    assert "Not measured." in md and "**>= 2.00** (aim >= 1.8: met)" in md  # at least 2: the aim is met


def test_markdown_says_when_both_capacities_are_lower_bounds():
    r = fake_result()
    for k in ("1", "2"):
        r["runs"][k]["points"] = r["runs"][k]["points"][:1]
        r["runs"][k].update(bc.fleet_capacity(r["runs"][k]["points"]))
    r["ratio"] = bc.capacity_ratio(r["runs"]["1"], r["runs"]["2"])
    md = bc.render_markdown(r)
    assert "**unknown (both grids passed to their end: 1.00 of lower bounds)**" in md and "not settled" in md


def test_plot_and_json_of_a_fake_result(tmp_path):
    r = fake_result()
    bc.plot(r, tmp_path / "b.png")
    assert (tmp_path / "b.png").stat().st_size > 1000
    assert json.loads(json.dumps(r)) == r


def test_describe_one_point():
    line = bc.describe(_point(2, 4, 0.0, True, {"r0": 3, "r1": 1}))
    assert "N=4" in line and "r0:3 r1:1" in line and "pass" in line
