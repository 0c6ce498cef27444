"""The vision step benchmark's own code, on the test VLM: the image goes up with each step's open and costs
positions on the draft; the same step in words sends no image."""

import json

import pytest

from tools.bench import vision as bench_vision

pytestmark = pytest.mark.real


def test_the_vision_benchmark_runs_both_kinds_of_step(tmp_path):
    assert bench_vision.main(["--steps", "2", "--tokens", "4", "--max-side", "128", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "vision.json").read_text())
    text, image = result["steps"]["text"], result["steps"]["image"]
    assert len(text) == len(image) == 2 and result["image_positions"] > 1
    assert all(r["image_bytes"] == 0 for r in text) and all(r["image_bytes"] > 0 for r in image)
    for t, i in zip(text, image, strict=True):  # the image's bytes travel on the step's open
        assert i["bytes_up"] >= t["bytes_up"] + i["image_bytes"] - 512
        assert t["tokens"] == i["tokens"] == 4 and i["encode_ms"] > 0 and i["draft_prefill_ms"] > 0
    assert "with the image" in (tmp_path / "vision.md").read_text() and (tmp_path / "vision.png").stat().st_size > 0
    with pytest.raises(SystemExit):
        bench_vision.main(["--draft", "x.gguf", "--out", str(tmp_path)])
