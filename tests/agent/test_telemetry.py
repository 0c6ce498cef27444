import json

from agent.app.telemetry import TelemetryWriter


def test_jsonl_records_and_bounded_rotation(tmp_path):
    path = tmp_path / "t" / "telemetry.jsonl"
    w = TelemetryWriter(path, max_bytes=2048)
    for i in range(100):
        w.write({"step": i, "text": "x" * 50})
    w.close()
    lines = [json.loads(l) for l in path.read_text().splitlines()]
    older = [json.loads(l) for l in (tmp_path / "t" / "telemetry.jsonl.1").read_text().splitlines()]
    assert lines[-1]["step"] == 99 and older[-1]["step"] + 1 == lines[0]["step"]
    assert path.stat().st_size <= 2048 and w.rotations >= 2 and w.records == 100


def test_a_write_error_does_not_raise(tmp_path):
    w = TelemetryWriter(tmp_path / "t.jsonl")
    (tmp_path / "t.jsonl").mkdir()  # a directory where the file should be
    w.write({"step": 1})
    w.write({"step": 2})
    assert w.records == 0
