import json
import logging

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


def test_a_full_disk_stops_it_with_one_warning_and_close_does_not_raise(caplog):
    """/dev/full (ENOSPC on every write): one warning, later records skipped, close() raises nothing. Failed
    before: close() flushed the line that had failed again and raised, so the daemon never closed its
    recording and exited 1 without its summary."""
    import os

    import pytest

    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full on this system")
    w = TelemetryWriter("/dev/full")
    for i in range(3):
        w.write({"step": i})
    w.close()
    w.close()
    warned = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warned) == 1 and "No space left on device" in warned[0].getMessage() and w.records == 0
