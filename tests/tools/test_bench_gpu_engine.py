"""The GPU roofline benchmark's own code, on a toy Llama on the CPU (no GPU here: the figures mean nothing)."""

import json

import pytest

from tools.bench import gpu_engine as bench_gpu_engine


@pytest.mark.real
def test_the_gpu_benchmark_runs_both_engines_end_to_end_on_a_toy_model(tmp_path):
    """Each engine in its own process: a toy torch Llama, and the toy random GGUF on llama.cpp."""
    assert (
        bench_gpu_engine.main(
            [
                "--tiny",
                "--device",
                "cpu",
                "--dtype",
                "float32",
                "--sessions",
                "1,3",
                "--tokens",
                "1,2",
                "--iters",
                "2",
                "--cache",
                "8",
                "--threads",
                "1",
                "--model-dir",
                str(tmp_path / "models"),
                "--batched-bench",
                "none",
                "--out",
                str(tmp_path),
            ]
        )
        == 0
    )
    result = json.loads((tmp_path / "gpu_engine.json").read_text())
    for engine in ("torch", "llamacpp"):
        rows = [r for r in result["rows"] if r["engine"] == engine]
        assert [(r["sessions"], r["tokens"]) for r in rows] == [(1, 1), (1, 2), (3, 1), (3, 2)]
        assert all(r["pass_ms"] > 0 and r["x_roofline"] > 0 for r in rows)
    runs = {run["engine"]: run for run in result["runs"]}
    assert runs["llamacpp"]["dtype"] == "float16" and runs["torch"]["dtype"] == "float32"
    assert result["bandwidth_gbs"] > 0
    md = (tmp_path / "gpu_engine.md").read_text()
    assert (tmp_path / "gpu_engine.png").stat().st_size > 0 and "x roofline" in md and "| llamacpp | 3 | 2 |" in md
