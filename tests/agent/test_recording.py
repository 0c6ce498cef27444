"""Runs recorded as MCAP (agent/app/recording.py): written by `edge-agent run --record`, read back by two
independent readers (mcap-ros2-support's and rosbags' own CDR decoder), and served live through Foxglove's SDK."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import sys
import time
from pathlib import Path

import pytest

from agent.app import config
from agent.app.recording import CHANNELS, EVERY_STEP, MAX_PATH_POSES, Recorder, RecordingError, StepSample
from tests.agent.test_run_cli import SCENE, WalkingDrafter, _run

ROOT = Path(__file__).resolve().parents[2]
LAYOUT = ROOT / "deploy" / "foxglove" / "edgespec-layout.json"


def read_mcap(path: Path) -> list[tuple[str, int, object]]:
    """(topic, log time ns, decoded message) in file order, by mcap-ros2-support's reader."""
    from mcap.reader import make_reader
    from mcap_ros2.decoder import DecoderFactory

    with open(path, "rb") as f:
        reader = make_reader(f, decoder_factories=[DecoderFactory()])
        return [(c.topic, m.log_time, msg) for _, c, m, msg in reader.iter_decoded_messages(log_time_order=False)]


def read_rosbags(path: Path) -> tuple[dict[str, str], list[tuple[str, int, object]]]:
    """({topic: ROS 2 type}, [(topic, log time ns, message)]) by rosbags, from the definitions in the file."""
    from rosbags.highlevel import AnyReader

    with AnyReader([path]) as reader:
        types = {c.topic: c.msgtype for c in reader.connections}
        return types, [(c.topic, t, reader.deserialize(raw, c.msgtype)) for c, t, raw in reader.messages()]


def on(messages: list[tuple[str, int, object]], topic: str) -> list:
    """The messages on one topic, in order."""
    return [m for t, _, m in messages if t == topic]


def check_recording(path: Path, steps: int, with_frame: int) -> list[tuple[str, int, object]]:
    """Both readers: every channel there with its type, log times monotonic, a message per step on each
    per-step channel (the camera's on the steps that had a frame), and the same messages decoded alike."""
    ours = read_mcap(path)
    types, theirs = read_rosbags(path)
    assert types == CHANNELS
    for messages in (ours, theirs):
        times = [t for _, t, _ in messages]
        assert times == sorted(times)
        counts = {topic: sum(t == topic for t, _, _ in messages) for topic in CHANNELS}
        assert counts == {**dict.fromkeys(CHANNELS, steps), "/camera/image/compressed": with_frame}, counts
        per_topic = [t for topic, t, _ in messages if topic == "/link"]
        assert len(set(per_topic)) == len(per_topic)  # one step, one time
    for (topic, t, a), (topic2, t2, b) in zip(ours, theirs, strict=True):
        assert (topic, t) == (topic2, t2)
        if topic == "/cmd_vel":
            assert (a.linear.x, a.angular.z) == (b.linear.x, b.angular.z)
        elif CHANNELS[topic] == "std_msgs/msg/String":
            assert a.data == b.data
    return ours


def synthetic(n: int, t: float, **over) -> StepSample:
    step = {
        "t": t,
        "step": n,
        "instruction": "go to the red box",
        "perception": "sim",
        "observation": "a red box 2.0 m away, ahead",
        "text": "The next action is move forward 75 cm.",
        "mode": "verified",
        "verified_tokens": 9,
        "unverified_tokens": 0,
        "action": "move forward 75 cm",
        "action_text": "move forward 75 cm",
        "parse": "exact",
        "parse_note": "",
        "envelope": "",
        "completed": True,
        "reason": "",
        "command": {"vx": 0.5, "vy": 0.0, "wz": 0.0},
        **over,
    }
    path = [(t - 1 + k * 0.01, 1.0 + k * 0.001, 1.5, 0.0) for k in range(MAX_PATH_POSES + 50)]
    return StepSample(step, b"\xff\xd8 a jpeg", t - 0.1, [{"name": "red box"}], (1.0 + n, 1.5, 0.3), path, {})


def test_recorded_steps_read_back_with_two_readers(tmp_path):
    path = tmp_path / "run.mcap"
    recorder = Recorder(str(path))
    t = time.time()
    recorder.record(synthetic(1, t))
    # the wall clock stepped back between steps: the log times still increase; an offline step with a stop
    back = synthetic(2, t - 5.0, mode="offline", unverified_tokens=4, command={"vx": 0.0, "vy": 0.0, "wz": 0.4})
    stops = {"obstacle": 2, "deadman": 1, "motion_done": 1}
    recorder.record(StepSample(back.step, None, None, [], back.pose, back.path, stops))
    third = synthetic(3, t + 1)
    recorder.record(StepSample(third.step, third.jpeg, pose=None, stops={**stops, "obstacle": 3}))
    recorder.close()
    recorder.close()  # twice is harmless
    assert recorder.steps == 3
    # the third step had no pose source: no /pose or /path; the second no frame
    ours = read_mcap(path)
    assert len(on(ours, "/pose")) == 2 and len(on(ours, "/camera/image/compressed")) == 2
    assert [json.loads(m.data)["verified"] for m in on(ours, "/answer")] == [True, False, True]
    safety = [json.loads(m.data) for m in on(ours, "/safety")]
    assert safety[1]["this_step"] == {"obstacle": 2, "deadman": 1, "motion_done": 1}
    assert safety[1]["interventions"] == {"obstacle": 2, "deadman": 1} and safety[2]["this_step"] == {"obstacle": 1}
    links = [m.data for m in on(ours, "/link")]
    assert links == ["verified", "offline", "verified"]
    paths = on(ours, "/path")
    assert len(paths[0].poses) == MAX_PATH_POSES and paths[0].header.frame_id == "map"
    pose = on(ours, "/pose")[0]
    assert pose.pose.position.x == 2.0 and pose.pose.orientation.z == pytest.approx(0.149438, abs=1e-6)  # sin(0.15)
    image = on(ours, "/camera/image/compressed")[0]
    assert image.format == "jpeg" and bytes(image.data) == b"\xff\xd8 a jpeg"
    assert [(m.linear.x, m.angular.z) for m in on(ours, "/cmd_vel")] == [(0.5, 0.0), (0.0, 0.4), (0.5, 0.0)]
    # the independent reader: the same channels, types, times and values
    types, theirs = read_rosbags(path)
    assert types == CHANNELS and len(theirs) == len(ours)
    times = [t for _, t, _ in theirs]
    assert times == sorted(times) and len({t for topic, t, _ in theirs if topic == "/step"}) == 3
    assert [m.data for m in on(theirs, "/link")] == links


def test_recording_stops_at_its_cap_and_stays_readable(tmp_path, caplog):
    path = tmp_path / "capped.mcap"
    recorder = Recorder(str(path), max_bytes=64 * 1024)
    t = time.time()
    big = synthetic(1, t)
    noisy = os.urandom(50_000)  # a frame zstd cannot shrink
    for n in range(1, 30):
        recorder.record(StepSample({**big.step, "step": n, "t": t + n}, noisy, pose=None))
    recorder.close()
    assert "reached its cap" in caplog.text
    assert path.stat().st_size < 64 * 1024 + 2 * 1024 * 1024  # at most a chunk over the cap
    images = [m for topic, _, m in read_mcap(path) if topic == "/camera/image/compressed"]
    assert 0 < len(images) < 29


def test_run_record_writes_what_two_readers_read_back(tmp_path, capsys, monkeypatch, caplog):
    """`edge-agent run --record --foxglove`: the simulated robot walks three steps (a fake draft, no model: offline
    local), and the file holds a message per step on every per-step channel."""
    import agent.spec.drafter

    monkeypatch.setattr(agent.spec.drafter, "Drafter", WalkingDrafter)
    caplog.set_level(logging.INFO, logger="agent.app.daemon")
    scene = tmp_path / "ahead.json"
    scene.write_text(json.dumps(SCENE))
    record = tmp_path / "run.mcap"
    rc, out, err = _run(
        capsys,
        "--controller",
        "sim",
        "--scene",
        str(scene),
        "--camera",
        "sim",
        "--perception",
        "sim",
        "--offline",
        "local",
        "--instruction",
        "go to the red box",
        "--max-steps",
        "3",
        "--exit-when-done",
        "--json",
        "--record",
        str(record),
        "--foxglove",
        "127.0.0.1:0",  # served live at the same time (a free port)
        "--set",
        "nav.grammar=false",
    )
    assert rc == 0, err
    assert re.search(r"Foxglove on ws://127\.0\.0\.1:[1-9]\d+", caplog.text), caplog.text
    steps = out["steps"]
    assert steps >= 3
    messages = read_mcap(record)
    records = [json.loads(m.data) for m in on(messages, "/step")]
    with_frame = sum("frame_age" in r["latency_ms"] for r in records)
    assert with_frame == steps - sum(r["parse"] == "refused" and "frame_age" not in r["latency_ms"] for r in records)
    messages = check_recording(record, steps, with_frame)
    answers = [json.loads(m.data) for m in on(messages, "/answer")]
    assert [a["text"] for a in answers] == [r["text"] for r in records]
    assert not any(a["verified"] for a in answers)  # offline local: the draft alone
    assert {m.data for m in on(messages, "/instruction")} == {"go to the red box"}
    assert on(messages, "/pose")[-1].pose.position.x > 1.0  # it walked toward the box (x 3.4) from x 1.0
    assert len(on(messages, "/path")[-1].poses) >= 2
    image = on(messages, "/camera/image/compressed")[0]
    assert image.format == "jpeg" and bytes(image.data[:2]) == b"\xff\xd8"


@pytest.mark.real
def test_run_record_with_the_real_models_marks_verified_answers(tmp_path, capsys, monkeypatch, drafter, make_server):
    """The same with the real draft and a real verifier: the answers on /answer are verified, the link verified."""
    import agent.spec.drafter

    monkeypatch.setattr(agent.spec.drafter, "Drafter", lambda *a, **k: drafter)
    server = make_server()
    record = tmp_path / "real.mcap"
    rc, out, err = _run(
        capsys,
        "--controller",
        "sim",
        "--scene",
        "red_box",
        "--verifier",
        server.url,
        "--instruction",
        "go to the red box",
        "--max-steps",
        "3",
        "--exit-when-done",
        "--json",
        "--record",
        str(record),
    )
    assert rc == 0, err
    records = [json.loads(m.data) for m in on(read_mcap(record), "/step")]
    messages = check_recording(record, out["steps"], sum("frame_age" in r["latency_ms"] for r in records))
    answers = [json.loads(m.data) for m in on(messages, "/answer")]
    acted = [a for a in answers if a["text"]]
    assert acted and all(a["verified"] and a["verified_tokens"] > 0 for a in acted)
    assert out["verified_steps"] == len(acted)
    links = [m.data for m in on(messages, "/link")]  # a step without a fresh frame (a loaded machine) is halted
    assert links == [r["mode"] for r in records] and "verified" in links and set(links) <= {"verified", "halted"}


def test_foxglove_serves_the_channels_live():
    """A client connects as Foxglove does (subprotocol foxglove.sdk.v1), sees every channel advertised with its
    ROS 2 schema, subscribes to one and gets the step's message (CDR)."""
    import websockets

    recorder = Recorder(foxglove=("127.0.0.1", 0))
    port = recorder.foxglove_port

    async def watch() -> tuple[dict, bytes]:
        url = f"ws://127.0.0.1:{port}"
        async with websockets.connect(url, subprotocols=["foxglove.sdk.v1", "foxglove.websocket.v1"]) as ws:
            channels: dict = {}
            while len(channels) < len(CHANNELS):
                msg = json.loads(await asyncio.wait_for(ws.recv(), 5))
                channels.update({c["topic"]: c for c in msg.get("channels", [])} if msg["op"] == "advertise" else {})
            sub = {"op": "subscribe", "subscriptions": [{"id": 7, "channelId": channels["/instruction"]["id"]}]}
            await ws.send(json.dumps(sub))
            await asyncio.sleep(0.3)
            recorder.record(synthetic(1, time.time()))
            data = await asyncio.wait_for(ws.recv(), 5)
            return channels, data

    try:
        channels, data = asyncio.run(watch())
    finally:
        recorder.close()
    assert {t: c["schemaName"] for t, c in channels.items()} == CHANNELS
    assert {c["encoding"] for c in channels.values()} == {"cdr"}
    assert isinstance(data, bytes) and data[0] == 1  # a message-data frame ...
    assert data.endswith(b"go to the red box\x00")  # ... with the instruction's CDR string last


def test_missing_packages_and_bad_addresses_are_clear(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "mcap_ros2._dynamic", None)  # as if mcap-ros2-support were not installed
    with pytest.raises(RecordingError, match=r"pip install 'edgespec\[record\]'"):
        Recorder(str(tmp_path / "x.mcap"))
    rc, _, err = _run(capsys, "--controller", "sim", "--scene", "red_box", "--record", str(tmp_path / "x.mcap"))
    assert rc == 2 and "edgespec[record]" in err and len(err.strip().splitlines()[-1]) < 200
    monkeypatch.undo()
    with pytest.raises(RecordingError, match="cannot write the recording"):
        Recorder(str(tmp_path / "no" / "such" / "folder" / "x.mcap"))
    with pytest.raises(config.ConfigError, match="not loopback"):
        config.load(None, ['record.foxglove="0.0.0.0:8765"'])
    with pytest.raises(config.ConfigError, match="HOST:PORT"):
        config.load(None, ['record.foxglove="8765"'])
    assert config.load(None, ['record.foxglove="0.0.0.0:8765"', "record.allow_remote=true"]).record.allow_remote


def test_the_shipped_foxglove_layout_shows_recorded_channels():
    layout = json.loads(LAYOUT.read_text())
    text = json.dumps(layout)
    shown = {t for t in CHANNELS if f'"{t}' in text}
    assert {"/camera/image/compressed", "/answer", "/cmd_vel", "/path", "/pose", "/link"} <= shown
    assert set(EVERY_STEP) <= set(CHANNELS)
    panels = layout["configById"]
    assert {p.split("!")[0] for p in panels} >= {"Image", "3D", "RawMessages", "Plot", "StateTransitions"}
