"""Runs recorded as MCAP (agent/app/recording.py): written by `edge-agent run --record`, read back by two
independent readers (mcap-ros2-support's and rosbags' own CDR decoder), and served live through Foxglove's SDK."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

from agent.app import config
from agent.app.recording import CHANNELS, EVERY_STEP, MAX_PATH_POSES, Recorder, RecordingError, StepSample
from tests.agent.app.test_run_cli import SCENE, WalkingDrafter, _run

ROOT = Path(__file__).resolve().parents[3]
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


def read_cut_mcap(path: Path) -> list[tuple[str, int, object]]:
    """(topic, log time ns, decoded message) of a file cut short (no summary, a record cut in two): the mcap
    reader's own recovery, its reader for a stream read front to back, up to where the file ends."""
    from mcap.exceptions import McapError
    from mcap.reader import NonSeekingReader
    from mcap_ros2.decoder import DecoderFactory

    out: list[tuple[str, int, object]] = []
    with open(path, "rb") as f:
        try:
            for _, c, m, msg in NonSeekingReader(f, decoder_factories=[DecoderFactory()]).iter_decoded_messages(
                log_time_order=False
            ):
                out.append((c.topic, m.log_time, msg))
        except (McapError, EOFError, struct.error):  # the cut: what came before it is whole
            pass
    return out


def test_recording_stops_at_its_cap_and_stays_readable(tmp_path, caplog):
    """The file never passes record.max_bytes (the summary its close writes included): a step that would take
    it past stops the recording, said once in the log, and the file is closed readable at once. Failed before:
    mcap's writer held a 1 MiB chunk in memory, so the file ended up to a chunk over its cap."""
    path = tmp_path / "capped.mcap"
    recorder = Recorder(str(path), max_bytes=64 * 1024)
    t = time.time()
    big = synthetic(1, t)
    noisy = os.urandom(30_000)  # a frame zstd cannot shrink
    for n in range(1, 30):
        recorder.record(StepSample({**big.step, "step": n, "t": t + n}, noisy, pose=None))
    assert read_mcap(path)  # closed readable before the recorder is
    recorder.close()
    said = [r for r in caplog.records if "record.max_bytes" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.WARNING and "stopped" in said[0].getMessage()
    assert path.stat().st_size <= 64 * 1024
    images = [m for topic, _, m in read_mcap(path) if topic == "/camera/image/compressed"]
    assert 0 < len(images) < 29


def test_every_step_is_on_the_disk_before_the_next(tmp_path):
    """Nothing waits in memory: after each step the file as it is on disk (no summary yet) reads back every
    step so far. Failed before: a 1 MiB chunk in the writer's memory, 0 bytes of messages on disk."""
    path = tmp_path / "live.mcap"
    recorder = Recorder(str(path))
    t = time.time()
    try:
        for n in range(1, 4):
            recorder.record(synthetic(n, t + n))
            steps = on(read_cut_mcap(path), "/step")
            assert [json.loads(m.data)["step"] for m in steps] == list(range(1, n + 1))
    finally:
        recorder.close()
    check_recording(path, 3, 3)


KILLED_RUN = """
import sys

import agent.decoding.drafter
from tests.agent.app.test_run_cli import WalkingDrafter

agent.decoding.drafter.Drafter = WalkingDrafter
from agent.app import cli

sys.exit(cli.main(sys.argv[1:]))
"""


def test_a_run_killed_by_sigkill_reads_back_every_step_but_the_last(tmp_path):
    """`edge-agent run --record` SIGKILLed while it runs: the MCAP, with no summary, reads back (the mcap
    reader's recovery) every step the telemetry saw but at most the last. Failed before: 0 bytes."""
    scene = tmp_path / "ahead.json"
    scene.write_text(json.dumps(SCENE))
    record, telemetry = tmp_path / "run.mcap", tmp_path / "telemetry.jsonl"
    args = ["run", "--listen", f"unix:{tmp_path}/api.sock", "--telemetry", str(telemetry), "--record", str(record)]
    args += ["--controller", "sim", "--scene", str(scene), "--camera", "sim", "--perception", "sim"]
    args += ["--offline", "local", "--instruction", "go to the red box", "--max-steps", "40"]
    args += ["--set", "nav.grammar=false"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-c", KILLED_RUN, *args], cwd=ROOT, env=env, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        while not (telemetry.exists() and len(telemetry.read_text().splitlines()) >= 3):
            assert proc.poll() is None, proc.stderr.read().decode()[-2000:] if proc.stderr else ""
            assert time.monotonic() < deadline, "no three steps in 120 s"
            time.sleep(0.05)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    seen = [json.loads(line)["step"] for line in telemetry.read_text().splitlines()]
    recorded = [json.loads(m.data)["step"] for m in on(read_cut_mcap(record), "/step")]
    assert recorded == seen[: len(recorded)] and len(recorded) >= len(seen) - 1 >= 2, (seen, recorded)


def test_a_full_disk_stops_recording_and_telemetry_and_the_run_ends_well(tmp_path, capsys, monkeypatch, caplog):
    """The recording and the telemetry on a full device (/dev/full: every write fails with ENOSPC): one warning
    for both (the second stop an INFO line), no traceback, and the robot walks its steps and ends with its
    --json summary and exit 0. Failed before: TelemetryWriter.close raised, the recorder was never closed,
    exit 1 with no summary."""
    import agent.decoding.drafter

    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full on this system")
    monkeypatch.setattr(agent.decoding.drafter, "Drafter", WalkingDrafter)
    caplog.set_level(logging.INFO)
    scene = tmp_path / "ahead.json"
    scene.write_text(json.dumps(SCENE))
    rc, out, err = _run(
        capsys,
        *("--controller", "sim", "--scene", str(scene), "--camera", "sim", "--perception", "sim"),
        *("--offline", "local", "--instruction", "go to the red box", "--max-steps", "3"),
        *("--exit-when-done", "--json", "--set", "nav.grammar=false"),
        *("--telemetry", "/dev/full", "--record", "/dev/full"),
    )
    assert rc == 0, err
    assert out["steps"] >= 3
    said = [(r.levelno, r.getMessage()) for r in caplog.records if "/dev/full stopped" in r.getMessage()]
    assert [level for level, _ in said] == [logging.WARNING, logging.INFO], said
    assert {m.split()[0] for _, m in said} == {"telemetry", "recording"}
    assert all("No space left on device" in m for _, m in said)
    warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and r.name.startswith("agent")]
    assert len([w for w in warned if "/dev/full" in w or "No space" in w]) == 1, warned
    assert not [r for r in caplog.records if r.exc_info], "a traceback in the log"


def test_a_disk_that_fills_mid_run_stops_the_recording_once(tmp_path, caplog):
    """The disk fills after the first step (the file's descriptor turned into /dev/full's: ENOSPC from then
    on): recording stops with one warning and no traceback, later steps and close() raise nothing, and the
    step recorded before reads back."""
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full on this system")
    path = tmp_path / "full.mcap"
    recorder = Recorder(str(path))
    t = time.time()
    recorder.record(synthetic(1, t))
    full = os.open("/dev/full", os.O_WRONLY)
    try:
        os.dup2(full, recorder.sinks[0]._fh.fileno())
    finally:
        os.close(full)
    for n in range(2, 5):
        recorder.record(synthetic(n, t + n))
    recorder.close()
    assert recorder.sinks == [] and recorder.steps == 4
    warned = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warned) == 1 and "No space left on device" in warned[0].getMessage(), warned
    assert not warned[0].exc_info
    assert [json.loads(m.data)["step"] for m in on(read_cut_mcap(path), "/step")] == [1]


def test_run_record_writes_what_two_readers_read_back(tmp_path, capsys, monkeypatch, caplog):
    """`edge-agent run --record --foxglove`: the simulated robot walks three steps (a fake draft, no model: offline
    local), and the file holds a message per step on every per-step channel."""
    import agent.decoding.drafter

    monkeypatch.setattr(agent.decoding.drafter, "Drafter", WalkingDrafter)
    caplog.set_level(logging.INFO, logger="agent.app.senses")  # the recorder is opened (and logged) there
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
        f'record.foxglove_token="{TOKEN}"',
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
    import agent.decoding.drafter

    monkeypatch.setattr(agent.decoding.drafter, "Drafter", lambda *a, **k: drafter)
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


TOKEN = "live-view-credential-0123456789"
SUBPROTOCOLS = ["foxglove.sdk.v1", "foxglove.websocket.v1"]


def watch_live(port: int, recorder: Recorder, topic: str = "/instruction", **connect) -> tuple[dict, bytes]:
    """Connect as Foxglove does, wait for every channel's advertisement, subscribe to `topic`, record a step
    and return (the channels by topic, the first message-data frame)."""
    import websockets

    async def watch() -> tuple[dict, bytes]:
        url = f"ws://127.0.0.1:{port}/?token={TOKEN}"
        async with websockets.connect(connect.pop("url", url), subprotocols=SUBPROTOCOLS, **connect) as ws:
            channels: dict = {}
            while len(channels) < len(CHANNELS):
                msg = json.loads(await asyncio.wait_for(ws.recv(), 5))
                channels.update({c["topic"]: c for c in msg.get("channels", [])} if msg["op"] == "advertise" else {})
            sub = {"op": "subscribe", "subscriptions": [{"id": 7, "channelId": channels[topic]["id"]}]}
            await ws.send(json.dumps(sub))
            await asyncio.sleep(0.3)
            recorder.record(synthetic(1, time.time()))
            data = await asyncio.wait_for(ws.recv(), 5)
            return channels, data

    return asyncio.run(watch())


def refused(port: int, path: str = "/", **headers) -> int:
    """The HTTP status a websocket upgrade to the live view gets (101: let in), with these headers."""
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    hello = {
        "Connection": "Upgrade",
        "Upgrade": "websocket",
        "Sec-WebSocket-Key": "dGhlIHNhbXBsZSBub25jZQ==",
        "Sec-WebSocket-Version": "13",
        "Sec-WebSocket-Protocol": "foxglove.sdk.v1",
    }
    conn.putrequest("GET", path, skip_host="Host" in headers)
    for name, value in {**hello, **headers}.items():
        conn.putheader(name, value)
    conn.endheaders()
    try:
        return conn.getresponse().status
    finally:
        conn.close()


def test_foxglove_serves_the_channels_live():
    """A client connects as Foxglove does (subprotocol foxglove.sdk.v1, the credential in the URL), sees every
    channel advertised with its ROS 2 schema, subscribes to one and gets the step's message (CDR)."""
    recorder = Recorder(foxglove=("127.0.0.1", 0), foxglove_credential=TOKEN)
    try:
        channels, data = watch_live(recorder.foxglove_port, recorder)
    finally:
        recorder.close()
    assert {t: c["schemaName"] for t, c in channels.items()} == CHANNELS
    assert {c["encoding"] for c in channels.values()} == {"cdr"}
    assert isinstance(data, bytes) and data[0] == 1  # a message-data frame ...
    assert struct.unpack("<I", data[1:5]) == (7,)  # ... of subscription 7 ...
    assert data.endswith(b"go to the red box\x00")  # ... with the instruction's CDR string last


def test_the_live_view_refuses_a_foreign_origin_a_missing_credential_and_a_rebound_host(caplog):
    """Another local user (no credential, a wrong one) and a web page in a browser on the robot's machine (its
    Origin; a DNS-rebound Host) are refused before the websocket opens; with the credential, a listed Origin
    (Foxglove's web app) gets the camera. Failed before: Foxglove's SDK server let every one of them in, and
    an upgrade with Origin https://evil.example received camera frames."""
    recorder = Recorder(
        foxglove=("127.0.0.1", 0), foxglove_credential=TOKEN, foxglove_origins=frozenset({"https://app.foxglove.dev"})
    )
    port = recorder.foxglove_port
    good = f"/?token={TOKEN}"
    try:
        assert refused(port, good) == 101
        assert refused(port, good, Origin="https://evil.example") == 403
        assert refused(port, good, Origin="https://app.foxglove.dev") == 101
        assert refused(port, "/") == 401  # another local user: no credential
        assert refused(port, "/?token=guessed-guessed-guessed-0000") == 401
        assert refused(port, "/", Authorization=f"Bearer {TOKEN}") == 101
        assert refused(port, good, Host=f"evil.example:{port}") == 403  # DNS rebinding
        assert refused(port, good, Origin="https://evil.example", Authorization=f"Bearer {TOKEN}") == 403
        _, data = watch_live(
            port, recorder, "/camera/image/compressed", additional_headers={"Origin": "https://app.foxglove.dev"}
        )
        assert data[0] == 1 and b"\xff\xd8 a jpeg" in data
    finally:
        recorder.close()
    assert "live view: refused" in caplog.text and TOKEN not in caplog.text


ANOTHER_USER = """
import http.client
import sys

conn = http.client.HTTPConnection("127.0.0.1", int(sys.argv[1]), timeout=5)
conn.putrequest("GET", "/")
for name, value in (
    ("Connection", "Upgrade"),
    ("Upgrade", "websocket"),
    ("Sec-WebSocket-Key", "dGhlIHNhbXBsZSBub25jZQ=="),
    ("Sec-WebSocket-Version", "13"),
    ("Sec-WebSocket-Protocol", "foxglove.sdk.v1"),
):
    conn.putheader(name, value)
conn.endheaders()
print(conn.getresponse().status)
try:
    open(sys.argv[2]).read()
    print("read the credential")
except OSError:
    print("cannot read the credential")
"""


def _runs_as_nobody(python: str) -> bool:
    try:
        return subprocess.run([python, "-c", ""], user=65534, cwd="/", capture_output=True).returncode == 0
    except OSError:  # not executable by that user
        return False


def test_another_local_user_cannot_watch(tmp_path):
    """Another user of the robot's machine (uid 65534, nobody) reaches the loopback port but cannot read the
    credential's file, and its upgrade is refused (401). Failed before: 101, and the camera's frames."""
    if os.geteuid() != 0:
        pytest.skip("needs root to run a client as another user")
    runnable = [exe for exe in (sys.executable, "/usr/bin/python3") if os.access(exe, os.F_OK)]
    python = next((exe for exe in runnable if _runs_as_nobody(exe)), None)
    if python is None:
        pytest.skip("no Python that uid 65534 may run")
    token = tmp_path / "foxglove.token"
    token.write_text(TOKEN + "\n")
    token.chmod(0o600)
    cfg = config.load(None, ['record.foxglove="127.0.0.1:0"', f'record.foxglove_token_file="{token}"']).record
    recorder = Recorder(foxglove=cfg.foxglove_address(), foxglove_credential=cfg.foxglove_credential())
    try:
        got = subprocess.run(
            [python, "-c", ANOTHER_USER, str(recorder.foxglove_port), str(token)],
            user=65534,
            cwd="/",
            capture_output=True,
            text=True,
            timeout=30,
        )
    finally:
        recorder.close()
    assert got.stdout.split("\n")[:2] == ["401", "cannot read the credential"], got


def test_the_live_view_needs_a_credential_from_the_config(tmp_path):
    with pytest.raises(config.ConfigError, match="foxglove_token_file"):
        config.load(None, ['record.foxglove="127.0.0.1:8765"'])
    with pytest.raises(config.ConfigError, match="at least 16"):
        config.load(None, ['record.foxglove="127.0.0.1:8765"', 'record.foxglove_token="short"'])
    with pytest.raises(config.ConfigError, match="foxglove_origins"):
        config.load(None, ['record.foxglove_origins=["app.foxglove.dev"]'])
    token = tmp_path / "foxglove.token"
    token.write_text(TOKEN + "\n")
    token.chmod(0o644)
    cfg = config.load(None, ['record.foxglove="127.0.0.1:8765"', f'record.foxglove_token_file="{token}"'])
    with pytest.raises(config.ConfigError, match="readable by every user"):
        cfg.record.foxglove_credential()
    token.chmod(0o600)
    assert cfg.record.foxglove_credential() == TOKEN
    assert cfg.record.foxglove_origins == []  # no browser page by default


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
        config.load(None, ['record.foxglove="0.0.0.0:8765"', f'record.foxglove_token="{TOKEN}"'])
    with pytest.raises(config.ConfigError, match="HOST:PORT"):
        config.load(None, ['record.foxglove="8765"'])
    remote = ['record.foxglove="0.0.0.0:8765"', "record.allow_remote=true", f'record.foxglove_token="{TOKEN}"']
    assert config.load(None, remote).record.allow_remote


def test_the_shipped_foxglove_layout_shows_recorded_channels():
    layout = json.loads(LAYOUT.read_text())
    text = json.dumps(layout)
    shown = {t for t in CHANNELS if f'"{t}' in text}
    assert {"/camera/image/compressed", "/answer", "/cmd_vel", "/path", "/pose", "/link"} <= shown
    assert set(EVERY_STEP) <= set(CHANNELS)
    panels = layout["configById"]
    assert {p.split("!")[0] for p in panels} >= {"Image", "3D", "RawMessages", "Plot", "StateTransitions"}


def test_tf_and_odom_follow_rep_105_and_rosbags_reads_them(tmp_path):
    """/tf: map -> odom -> base_link (and base_link -> camera); /odom: nav_msgs/Odometry in odom. The map pose
    and the odometry differ (drift): map -> odom is the correction, so map -> odom -> base_link lands on the pose."""
    import math

    path = tmp_path / "run.mcap"
    recorder = Recorder(str(path))
    t = time.time()
    first = synthetic(1, t)
    # the map pose (2.0, 1.5, 0.3); the odometry drifted: (1.8, 1.2) at yaw 0.1, walking 0.4 m/s, turning 0.2 rad/s
    recorder.record(StepSample(first.step, pose=first.pose, odom=(1.8, 1.2, 0.1, 0.4, 0.0, 0.2)))
    go2 = synthetic(2, t + 1)  # a robot with odometry alone (the Go2): map -> odom is the identity
    recorder.record(StepSample(go2.step, pose=None, odom=(0.5, -0.2, -1.0, 0.3, 0.0, 0.0)))
    recorder.record(StepSample(synthetic(3, t + 2).step))  # neither: no /tf, no /odom
    recorder.close()
    types, theirs = read_rosbags(path)
    assert types["/tf"] == "tf2_msgs/msg/TFMessage" and types["/odom"] == "nav_msgs/msg/Odometry"
    tfs, odoms = on(theirs, "/tf"), on(theirs, "/odom")
    assert len(tfs) == len(odoms) == 2
    frames = [(tr.header.frame_id, tr.child_frame_id) for tr in tfs[0].transforms]
    assert frames == [("map", "odom"), ("odom", "base_link"), ("base_link", "camera")]

    def planar(tr):
        q = tr.transform.rotation
        return tr.transform.translation.x, tr.transform.translation.y, 2 * math.atan2(q.z, q.w)

    (ax, ay, ath), (bx, by, bth) = planar(tfs[0].transforms[0]), planar(tfs[0].transforms[1])
    x = ax + math.cos(ath) * bx - math.sin(ath) * by  # map -> odom -> base_link
    y = ay + math.sin(ath) * bx + math.cos(ath) * by
    assert (x, y, ath + bth) == pytest.approx((2.0, 1.5, 0.3), abs=1e-9)
    assert planar(tfs[1].transforms[0]) == pytest.approx((0.0, 0.0, 0.0), abs=1e-12)  # no map: the identity
    odom = odoms[0]
    assert (odom.header.frame_id, odom.child_frame_id) == ("odom", "base_link")
    assert (odom.pose.pose.position.x, odom.pose.pose.position.y) == (1.8, 1.2)
    assert (odom.twist.twist.linear.x, odom.twist.twist.angular.z) == (0.4, 0.2)
    assert odoms[1].pose.pose.position.x == 0.5 and len(odoms[1].pose.covariance) == 36
    assert len(on(read_mcap(path), "/odom")) == 2  # the other reader too
