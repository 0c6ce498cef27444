"""tools/bench/compile_sandbox.py --quick: it finds where a chain overflows a worker's stack (past the cap, and each
try's crash costs only that try), times the paths of a schema's compile, and a robot's schemas beside a flood."""

from __future__ import annotations

import json

from protocol import structured
from tools.bench import compile_sandbox


def test_the_quick_run_finds_the_crash_past_the_cap_and_the_robot_served(tmp_path):
    assert compile_sandbox.main(["--quick", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "compile_sandbox.json").read_text())
    for row in result["limits"]:
        assert row["crashes_at"] > row["longest"] and row["chain"] > 4 * structured.MAX_REFERENCE_CHAIN, row
    paths = {r["path"]: r["ms"] for r in result["cost"]}
    assert len(paths) == 4 and all(ms >= 0 for ms in paths.values())
    assert all(r["compiles"] == r["of"] for r in result["fairness"]), result["fairness"]
    assert (tmp_path / "compile_sandbox.md").exists() and (tmp_path / "compile_sandbox.png").exists()
