"""The fleet CPU benchmark (tools/bench/fleet_cpu.py) and the loadtest's fleet in several processes.

The quick run is one fleet of 4 robots in 2 processes against a real server on the tiny random target: its figures
must be measurements (CPU spent, rounds verified, every robot served, the ids the target's), not what they say.
"""

import json

import pytest

from server_bridge.ops import loadtest
from server_bridge.ops.loadtest import Generation, PointLog


def test_what_the_server_spent_is_read_from_two_pages():
    start = {"bridge_rounds_total": 100.0, "bridge_batch_verify_seconds_total": 1.0, loadtest.PROC_CPU: 10.0}
    end = {"bridge_rounds_total": 600.0, "bridge_batch_verify_seconds_total": 2.0, loadtest.PROC_CPU: 12.0}
    end |= {'bridge_errors_total{code="overloaded"}': 3.0, "bridge_sessions_evicted_total": 2.0}
    got = loadtest.server_spend({"start": start, "end": end, "start_at": 0.1, "end_at": 4.1, "asked_s": 4.0})
    # no engine CPU counter (a server before issue 51): the passes' wall time stands for it
    assert got["measured"] == {"process": loadtest.PROC_CPU, "engine": loadtest.PASS_SECONDS}
    assert got["cpu_ms_per_round"] == pytest.approx(4.0) and got["engine_ms_per_round"] == pytest.approx(2.0)
    assert got["host_ms_per_round"] == pytest.approx(2.0) and got["engine_busy"] == pytest.approx(0.25)
    assert got["rounds_per_s"] == pytest.approx(125.0) and (got["sheds"], got["evicted"]) == (3, 2)
    assert got["late_s"] == pytest.approx(0.1)
    # with the threads sampled, the busiest but the main one stands for the engine (it also does some host work)
    main, model = f'{loadtest.THREAD_CPU}{{tid="main"}}', f'{loadtest.THREAD_CPU}{{tid="7"}}'
    got = loadtest.server_spend(
        {"start": start | {main: 1.0, model: 1.0}, "end": end | {main: 2.1, model: 1.9}, "start_at": 0, "end_at": 4}
    )
    assert got["measured"]["engine"] == loadtest.MODEL_THREAD and got["engine_ms_per_round"] == pytest.approx(1.8)
    assert got["host_ms_per_round"] == pytest.approx(2.2) and got["host_wall_ms_per_round"] == pytest.approx(2.0)
    # the server's own counters, where it has them and the reader sampled no /proc
    start |= {loadtest.ENGINE_CPU: 0.0, loadtest.PROCESS_CPU: 0.0}
    end |= {loadtest.ENGINE_CPU: 0.5, loadtest.PROCESS_CPU: 1.5}
    del start[loadtest.PROC_CPU], end[loadtest.PROC_CPU]
    got = loadtest.server_spend({"start": start, "end": end, "start_at": 0.0, "end_at": 4.0})
    assert got["measured"] == {"process": loadtest.PROCESS_CPU, "engine": loadtest.ENGINE_CPU}
    assert got["host_ms_per_round"] == pytest.approx(2.0) and got["engine_ms_per_round"] == pytest.approx(1.0)
    assert got["pass_ms_per_round"] == pytest.approx(2.0) and got["counter_ms_per_round"] == pytest.approx(3.0)
    # pages of a server too busy to answer: not read, or answered together long after the window opened
    late = loadtest.server_spend({"start": start, "end": end, "start_at": 30.0, "end_at": 30.5, "asked_s": 8.0})
    assert late == {"window_s": 0.5, "late_s": 30.0}
    assert loadtest.server_spend({"start": {loadtest.PROC_CPU: 1.0}, "end": end, "start_at": 0, "end_at": 0}) == {}


def test_the_processes_logs_merge_into_one_fleets():
    logs = [
        PointLog(generations=[Generation(i, 8.0, 0, 4, 1.0)], stale=i, client_cpu_s=0.5, ended=2.0 + i) for i in (0, 1)
    ]
    logs[1].errors.append("robot 1: TimeoutError")
    out = loadtest.merge_logs(logs, (1.0, 2.0), {"start": {}})
    assert [g.robot for g in out.generations] == [0, 1] and out.errors == ["robot 1: TimeoutError"]
    assert (out.processes, out.stale, out.client_cpu_s, out.ended, out.window) == (2, 1, 1.0, 3.0, (1.0, 2.0))


@pytest.mark.real
def test_the_quick_run_measures_a_fleet_in_two_processes(tmp_path):
    from tools.bench import fleet_cpu

    assert fleet_cpu.main(["--quick", "--out", str(tmp_path), "--save-trace", str(tmp_path / "trace.json")]) == 0
    result = json.loads((tmp_path / "fleet_cpu.json").read_text())
    (p,) = result["points"]
    assert p["server"] == "after" and p["n"] == 4 and p["procs"] == 2 and p["exact"] and not p["errors"]
    assert p["measured"] == {"process": loadtest.PROC_CPU, "engine": loadtest.ENGINE_CPU}
    assert p["cpu_ms_per_round"] > p["engine_ms_per_round"] > 0 and p["rounds_per_s"] > 0 and p["robot_rounds"] > 0
    assert p["counter_ms_per_round"] > 0 and 0 < p["engine_busy"] < 1
    assert p["model_thread_ms_per_round"] > 0  # the threads sampled too
    assert p["robots_sampled"] == 4 and p["speed_min"] > 0 and p["client_cpu"] > 0
    assert result["summary"][0]["after"]["host_ms_per_round"] == p["host_ms_per_round"]
    assert "after: host ms" in (tmp_path / "fleet_cpu.md").read_text()
    assert (tmp_path / "fleet_cpu.png").stat().st_size > 0
    replayed = loadtest.Trace.load(tmp_path / "trace.json")  # what `server-bridge loadtest --trace` reads
    assert replayed.target.startswith("random-tiny") and len(replayed.prompts) == 10
