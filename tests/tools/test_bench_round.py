"""The round benchmark's own code: raw llama.cpp and our streamed AR give the same ids, and it says so."""

import json

import pytest

from tools.bench import round as bench_round

pytestmark = pytest.mark.real


def test_the_round_benchmark_compares_the_same_ids_end_to_end(tmp_path):
    assert bench_round.main(["--tokens", "4", "--repeats", "1", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "round.json").read_text())
    assert len(result["rows"]) == len(bench_round.PROMPTS)
    for row in result["rows"]:
        assert row["same_ids"] and row["tokens"] == 4
        assert 0 < row["ours_pass_ms_per_token"] <= row["ours_ms_per_token"] and row["ratio"] > 0
    assert "ours/raw" in (tmp_path / "round.md").read_text() and (tmp_path / "round.png").stat().st_size > 0
