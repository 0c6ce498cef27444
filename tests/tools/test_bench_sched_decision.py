"""The scheduling-decision benchmark's own code: it times both implementations and finds they choose alike."""

import json

from tools.bench import sched_decision


def test_the_decision_benchmark_runs_and_both_implementations_agree(tmp_path):
    assert sched_decision.main(["--quick", "--out", str(tmp_path)]) == 0  # 1: the old code chose another batch
    result = json.loads((tmp_path / "sched_decision.json").read_text())
    assert {row["fleet"] for row in result["rows"]} == set(sched_decision.FLEETS)
    for row in result["rows"]:
        assert row["same"] == [1, 1] and 0 < row["now_ms"] and 1 <= row["batch"] <= row["waiting"]
    assert "before issue 51" in (tmp_path / "sched_decision.md").read_text()
    assert (tmp_path / "sched_decision.png").stat().st_size > 0
