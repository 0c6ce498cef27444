"""The GPU roofline benchmark's own code, on a toy Llama on the CPU (no GPU here: the figures mean nothing)."""
import json

from tools import bench_gpu_engine


def test_the_gpu_benchmark_runs_end_to_end_on_a_toy_model(tmp_path):
    assert bench_gpu_engine.main(["--tiny", "--device", "cpu", "--dtype", "float32", "--sessions", "1,3",
                                  "--tokens", "1,2", "--iters", "2", "--cache", "8", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "gpu_engine.json").read_text())
    assert [(r["sessions"], r["tokens"]) for r in result["rows"]] == [(1, 1), (1, 2), (3, 1), (3, 2)]
    assert result["roofline_ms"] > 0 and all(r["pass_ms"] > 0 for r in result["rows"])
    assert (tmp_path / "gpu_engine.png").stat().st_size > 0 and "x roofline" in (tmp_path / "gpu_engine.md").read_text()
