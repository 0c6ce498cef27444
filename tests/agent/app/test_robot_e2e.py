"""The robot daemon end to end with the real models: a sim episode, offline hold and local with the
link cut by the proxy, recovery, the local API's e-stop, and systemd's READY/WATCHDOG/STOPPING."""

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
from websockets.exceptions import ConnectionClosed

from agent.app import config
from agent.app.api import connect
from agent.app.daemon import Daemon
from agent.decoding import DecoderSettings, open_decoder
from agent.robot.controllers.sim import SimController
from tools.cluster.netem import LinkProfile, NetemProxy

pytestmark = pytest.mark.real


@pytest.fixture
def proxy(verifier):
    with NetemProxy("127.0.0.1", verifier.port, LinkProfile.from_rtt(10)) as p:
        yield p


def make_daemon(tmp_path, drafter, url, offline="local", start=0, **overrides):
    sets = [
        f'link.verifier="{url}"',
        f'offline.policy="{offline}"',
        f'api.listen="unix:{tmp_path / "api.sock"}"',
        f'telemetry.path="{tmp_path / "telemetry.jsonl"}"',
        "link.verify_timeout_s=6",
        # pongs are down-link bytes too: a ping every 2 s during a slow prefill on a loaded machine moved the
        # MID_ANSWER cut before the first result (5 s: the most the config takes); a lost link shows as the
        # proxy's close, not a ping timeout
        "link.keepalive_s=5",
        "agent.max_plan_age_s=30",
        "camera.fps=20",
    ] + [f"{k}={v}" for k, v in overrides.items()]
    d = Daemon(config.load(None, sets), drafter=drafter, controller=SimController(start=start), max_steps=8)
    return d.start()


def wait_for(pred, timeout=120.0, every=0.02):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(every)
    return False


def ar_answer(drafter, url, nav, observation=None):
    """The target's own greedy answer to a step's prompt (server alone, no draft) under the latest step's answer
    grammar: a first step's prompt from its observation (no memory yet), else the latest step's prompt,
    memory included."""
    dec = open_decoder(DecoderSettings(verifier=url), drafter)
    try:
        ids = nav.last_prompt_ids if observation is None else nav.prompt_ids("go to the red box", observation)
        grammar = nav.answers.grammar  # the latest step's (nav.grounded: its reason opens with what it saw)
        return dec.generate(ids, mode="ar", max_tokens=nav.max_tokens, until=nav.answers.until([]), grammar=grammar)
    finally:
        dec.close()


def ar_text(drafter, url, nav, observation=None):
    return ar_answer(drafter, url, nav, observation).text


# Down-link bytes after which the proxy cuts a step's answer: past the `opened` reply (~130 B with its
# resume secret) and two rounds' results (~55 B each, packed; a whole answer is ~400 B), so the target
# has committed some tokens, not all.
MID_ANSWER = 240


def test_episode_with_the_real_models(tmp_path, drafter, proxy, verifier):
    d = make_daemon(tmp_path, drafter, proxy.url())
    try:
        start = d.world.pose
        d.submit("go to the red box", max_steps=4)
        assert wait_for(lambda: d.history, timeout=240)
        records = [json.loads(line) for line in (tmp_path / "telemetry.jsonl").read_text().splitlines()]
        assert (
            1 <= len(records) <= 4
            and d.nav.steps == len(records)
            and d.history[-1]["state"] in ("done", "max_steps", "unparseable")
        )
        for r in records:
            assert r["mode"] == "verified" and r["perception"] == "sim" and r["text"] and r["parse"] != "refused"
            assert "older than" not in r["reason"]
            assert r["verified_tokens"] > 0 and r["unverified_tokens"] == 0
            assert abs(r["command"]["vx"]) <= d.cfg.safety.max_vx and abs(r["command"]["wz"]) <= d.cfg.safety.max_wz
            assert {"frame_age", "perceive", "generate", "step"} <= set(r["latency_ms"])
        # exact: the target's own answer to the latest step's prompt, under that step's answer grammar (nav.grounded
        # makes each step's own: its reason opens with what the camera line said)
        assert records[-1]["text"] == ar_text(drafter, verifier.url, d.nav)
        assert [r["memory_steps"] for r in records] == list(range(len(records)))  # seen and done, per step
        assert all(r["prefix_shared_tokens"] >= 0.8 * r["prompt_tokens"] for r in records)  # the cache is kept
        moved = [r for r in records if r["action"] != "stop"]
        if moved:
            assert d.world.pose != start and d.world.collisions == 0
    finally:
        d.close()


def test_offline_local_marks_unverified_and_recovers(tmp_path, drafter, proxy, verifier):
    d = make_daemon(tmp_path, drafter, proxy.url(), offline="local")
    try:
        s1 = d.nav.step("go to the red box")
        assert s1.mode == "verified" and d.status()["mode"] == "verified"
        # cut the link part way through the next answer and keep it down
        proxy.refuse_new(True)
        proxy.schedule_disconnect(after_bytes_down=MID_ANSWER)
        s2 = d.nav.step("go to the red box")
        assert s2.mode == "offline" and s2.unverified_tokens > 0 and "unverified" in s2.reason
        assert s2.verified_tokens > 0 and "lost mid-answer" in s2.reason
        assert d.status()["mode"] == "offline" and d.world.tag == "offline"
        # what the target committed before the cut is kept: the answer starts with the target's own tokens
        reference = ar_answer(drafter, verifier.url, d.nav).token_ids
        assert s2.text.startswith(drafter.detokenize(reference[: s2.verified_tokens]))
        s3 = d.nav.step("go to the red box")  # still down: local again, no long stall
        assert s3.mode == "offline" and s3.latency_ms["generate"] < 15_000
        proxy.refuse_new(False)
        time.sleep(d.nav.links.backoff + 0.1)
        s4 = d.nav.step("go to the red box")
        assert s4.mode == "verified" and d.world.tag == "verified" and s4.unverified_tokens == 0
        assert s4.text == ar_text(drafter, verifier.url, d.nav) and 1 <= s4.memory_steps <= 3
    finally:
        d.close()


def test_offline_hold_stops_and_resumes_the_same_answer(tmp_path, drafter, proxy, verifier):
    d = make_daemon(tmp_path, drafter, proxy.url(), offline="hold", **{"agent.max_plan_age_s": 12.0})
    try:
        d.nav.step("go to the red box")
        proxy.refuse_new(True)
        proxy.schedule_disconnect(after_bytes_down=MID_ANSWER)

        def restore():  # the link comes back 1 s after the robot lost it
            wait_for(lambda: d.nav.link == "down", timeout=60, every=0.01)
            time.sleep(1.0)
            proxy.refuse_new(False)

        threading.Thread(target=restore, daemon=True).start()
        rec = d.nav.step("go to the red box")
        assert rec.mode == "verified" and "resumed" in rec.reason and "lost mid-answer" in rec.reason
        assert rec.text == ar_text(drafter, verifier.url, d.nav)  # nothing lost, nothing redone
        # a link that stays down: the robot holds, stopped, and says so
        proxy.refuse_new(True)
        proxy.disconnect_all()
        held = d.nav.step("go to the red box")
        assert held.mode == "offline" and held.parse == "refused" and held.action == "stop"
        assert "offline hold" in held.reason and d.world.velocity.vx == 0 and d.world.velocity.wz == 0
    finally:
        proxy.refuse_new(False)
        d.close()


def test_local_api_estop_status_and_bad_requests(tmp_path, drafter, proxy):
    import asyncio

    from agent.app.api import LocalApi

    reset_token = "reset-token-of-the-tests"
    # start 1: the first action is a turn
    d = make_daemon(tmp_path, drafter, proxy.url(), start=1, **{"api.reset_token": f'"{reset_token}"'})
    loop = asyncio.new_event_loop()
    t = threading.Thread(target=loop.run_forever, daemon=True)
    t.start()
    api = asyncio.run_coroutine_threadsafe(LocalApi(d).start(), loop).result(10)
    events = []
    try:
        with connect(api.address) as ctl, connect(api.address) as sub:

            def call(**req):
                ctl.send(json.dumps(req))
                return json.loads(ctl.recv(10))

            sub.send(json.dumps({"op": "subscribe"}))
            assert json.loads(sub.recv(10))["ok"]

            def collect():
                try:
                    for m in sub:
                        events.append(json.loads(m))
                except ConnectionClosed:
                    pass

            threading.Thread(target=collect, daemon=True).start()

            assert call(op="status")["status"]["mode"] == "verified"
            assert not call(op="fly")["ok"] and "unknown op" in call(op="fly")["error"]
            ctl.send("{not json")
            assert not json.loads(ctl.recv(10))["ok"]
            assert "instruction" in call(op="submit", instruction="")["error"]
            assert "image" in call(op="submit", instruction="go", image="!!notbase64")["error"]
            refused = call(op="submit", instruction="go to the purple elephant")["error"]  # not in the scene
            assert "names no object in the scene 'red_box'; its objects: red box" in refused

            # 1. e-stop while the robot moves: stopped (and damped) before the reply comes back
            assert call(op="submit", instruction="go to the red box")["ok"]
            assert wait_for(lambda: any(e["event"] == "moving" for e in events), 120)
            assert call(op="estop")["ok"]
            v = d.world.velocity
            assert (v.vx, v.vy, v.wz) == (0, 0, 0) and d.world.damped and d.safety.estopped
            assert wait_for(lambda: d.history and d.history[-1]["state"] == "estopped", 30)

            # 2. e-stop while a generation is in flight: its action never reaches the motors
            assert call(op="reset", reset_token=reset_token)["ok"]
            assert not d.world.damped and not d.safety.estopped
            events.clear()
            assert call(op="submit", instruction="go to the red box")["ok"]
            assert wait_for(lambda: any(e["event"] == "observation" for e in events), 60)
            pose = d.world.pose
            assert call(op="estop")["ok"]
            assert wait_for(lambda: d.history and len(d.history) == 2, 60)
            assert d.history[-1]["state"] == "estopped"
            time.sleep(0.3)
            assert d.world.pose == pose and not any(e["event"] == "moving" for e in events)
            status = call(op="status")["status"]
            assert status["estopped"] and status["safety_stops"].get("estop", 0) >= 2
    finally:
        asyncio.run_coroutine_threadsafe(api.close(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        d.close()


def test_daemon_tells_systemd_ready_watchdog_and_stopping(tmp_path):
    sock_path = str(tmp_path / "notify.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(sock_path)
    sock.settimeout(1.0)
    env = {**os.environ, "NOTIFY_SOCKET": sock_path, "WATCHDOG_USEC": "200000"}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "agent.app.cli",
            "run",
            "--controller",
            "sim",
            "--camera",
            "sim",
            "--perception",
            "sim",
            "--listen",
            f"unix:{tmp_path / 'api.sock'}",
            "--telemetry",
            str(tmp_path / "t.jsonl"),
            "--set",
            "agent.threads=1",
        ],
        env=env,
        stderr=subprocess.PIPE,
        text=True,
    )
    got = []
    try:
        deadline = time.monotonic() + 120
        after_ready = lambda: got[got.index("READY=1") :].count("WATCHDOG=1") if "READY=1" in got else 0  # noqa: E731
        while time.monotonic() < deadline and after_ready() < 5:
            try:
                got += sock.recv(4096).decode().split("\n")
            except socket.timeout:
                assert proc.poll() is None, proc.stderr.read()
        assert after_ready() >= 5  # the control loop pings at half of WATCHDOG_USEC
        assert any(line.startswith("STATUS=offline (hold)") for line in got)  # no verifier: declared offline
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        while True:
            try:
                got += sock.recv(4096).decode().split("\n")
            except socket.timeout:
                break
        assert "STOPPING=1" in got
    finally:
        if proc.poll() is None:
            proc.kill()
        sock.close()
