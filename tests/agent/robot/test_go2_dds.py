"""The go2 controller and camera through the real unitree_sdk2py over real CycloneDDS, against the simulated
Go2 (agent/robot/go2_sim.py: the SDK's own RPC server classes) on loopback, on a DDS domain of this test
process's own (tests/agent/go2_dds.py).

The robot's faults are the simulated robot's own: `hang` (its services stop answering: RPCs time out),
and the robot leaving the network (its process ends: the SDK's Move then waits in its DDS write, the case
that froze the e-stop and the watchdog for 10 s when Move ran under the safety lock). One simulated Go2
serves the whole module; a test that ends it starts it again.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time

import pytest

from agent.robot.actions import Motion
from agent.robot.controllers import Command, ControllerError, make_controller
from agent.robot.perception import ColorDetector
from agent.robot.safety import SafetyLayer, SafetyLimits
from tests.agent.app.test_go2_daemon import RESET_TOKEN, Api, RecordingNotifier, StubDrafter, wait_for
from tests.agent.app.test_recording import on, read_rosbags
from tests.agent.app.test_run_cli import WalkingDrafter
from tests.agent.go2_dds import DOMAIN, INTERFACE, ROOT, Go2Sim, skip_reason

pytestmark = pytest.mark.skipif(skip_reason() is not None, reason=skip_reason() or "")


@pytest.fixture(scope="module")
def robot():
    sim = Go2Sim().start()
    yield sim
    sim.stop()


@pytest.fixture
def go2(robot):
    """The module's simulated Go2, standing at the scene's start 0 and answering at the start of each test."""
    if not robot.alive:
        robot.start()
    robot.send("start 0")
    robot.send("answer")
    robot.send("delay 0")
    robot.send("mode 1")
    robot.send("sport normal")
    yield robot


def make_daemon(*sets):
    from agent.app import config
    from agent.app.daemon import Daemon

    cfg = config.load(
        None,
        [
            'robot.controller="go2"',
            f'robot.options={{network_interface="{INTERFACE}", domain_id={DOMAIN}}}',
            'camera.source="go2"',
            'perception.kind="color"',
            'telemetry.path=""',
            "robot.control_hz=50",
            "camera.max_age_ms=1000",
            f'api.reset_token="{RESET_TOKEN}"',
            *sets,
        ],
    )
    d = Daemon(cfg, drafter=StubDrafter(), notifier=RecordingNotifier()).start()
    assert wait_for(lambda: d.grabber.latest_age_s() is not None, 10.0)  # the first frame: motion is allowed
    return d


def state(d):
    return d.controller.state.get(1.0)


def test_the_driver_stands_a_lying_go2_up_and_moves_it(go2):
    go2.send("mode 5")  # lying down
    c = make_controller("go2", network_interface=INTERFACE, domain_id=DOMAIN)
    with c:
        assert c.state.get(1.0).mode == 1  # RecoveryStand, BalanceStand: balancing
        x0 = c.state.get(1.0).position[0]
        for _ in range(20):  # 1 s of Move at 20 Hz, 0.3 m/s ahead
            c.send_action(Command(vx=0.3))
            time.sleep(0.05)
        assert wait_for(lambda: c.state.get(1.0).position[0] - x0 > 0.15, 2.0)
        ahead = c.ranges.clearance_m(0.0)
        assert ahead is not None and 0 < ahead < 5  # the scene's wall, through rt/utlidar/range_info
        c.send_action(Command())
        c.estop()
        assert c.state.get(1.0).mode == 7 or wait_for(lambda: c.state.get(1.0).mode == 7, 1.0)  # Damp: limp


@pytest.mark.parametrize("mode", [5, 7])  # lying down, damped
def test_connect_stands_a_lying_go2_up_and_leaves_a_balancing_one_alone(go2, mode):
    go2.send(f"mode {mode}")
    before = go2.report()["calls"]
    with make_controller("go2", network_interface=INTERFACE, domain_id=DOMAIN) as c:
        calls = go2.report()["calls"]
        assert calls.get("RecoveryStand", 0) == before.get("RecoveryStand", 0) + 1
        assert calls.get("BalanceStand", 0) == before.get("BalanceStand", 0) + 1 and c.state.get(1.0).mode == 1
    before = go2.report()["calls"]
    with make_controller("go2", network_interface=INTERFACE, domain_id=DOMAIN):
        calls = go2.report()["calls"]
        for name in ("RecoveryStand", "BalanceStand"):
            assert calls.get(name, 0) == before.get(name, 0)  # balancing already: left alone


def test_connect_refuses_when_sport_mode_is_off(go2):
    go2.send('sport ""')  # released, as after low-level control: Move would be ignored
    before = go2.report()["calls"].get("Move", 0)
    with pytest.raises(ControllerError, match="sport mode is off"):
        make_controller("go2", network_interface=INTERFACE, domain_id=DOMAIN).connect()
    assert go2.report()["calls"].get("Move", 0) == before


def test_reset_after_an_estop_stands_up_before_motion_and_a_failed_one_keeps_the_latch(go2):
    with make_controller("go2", network_interface=INTERFACE, domain_id=DOMAIN) as c:
        s = SafetyLayer(c, SafetyLimits(max_frame_age_s=None, max_dvx=100.0, min_clearance_m=0.0))
        assert s.send_action(Command(0.3, 0, 0)).vx == 0.3
        s.estop().result(5)
        assert wait_for(lambda: c.state.get(1.0).mode == 7, 2.0) and s.send_action(Command(0.3, 0, 0)) == Command()
        s.reset().result(10)  # RecoveryStand, BalanceStand: balancing before motion
        assert c.state.get(1.0).mode == 1 and not s.estopped
        assert s.send_action(Command(0.3, 0, 0)).vx == 0.3
        s.estop().result(5)
        c.client.SetTimeout(0.3)
        go2.send("hang")  # the robot stops answering: RecoveryStand times out
        with pytest.raises(ControllerError, match="RecoveryStand returned 3104"):
            s.reset().result(10)
        assert s.estopped and s.send_action(Command(0.3, 0, 0)) == Command()
        go2.send("answer")
        s.close()


def test_the_range_finder_is_the_simulators_geometry(go2):
    import math

    go2.send("pose 5.4 2.5 0")  # 0.6 m from the east wall, facing it; the red box north, the blue ball south
    with make_controller("go2", network_interface=INTERFACE, domain_id=DOMAIN) as c:
        assert wait_for(lambda: c.ranges.clearance_m(0.0) is not None and c.ranges.clearance_m(0.0) < 0.5, 2.0)
        assert c.ranges.clearance_m(0.0) == pytest.approx(0.4, abs=0.02)  # from the body's edge (r 0.2 m)
        assert c.ranges.clearance_m(math.pi / 2) == pytest.approx(1.4, abs=0.05)
        assert c.ranges.clearance_m(-math.pi / 2) == pytest.approx(1.45, abs=0.05)  # the blue ball
        assert c.ranges.clearance_m(math.pi) is None  # behind: the range finder does not look there


def test_obstacle_stop_on_the_go2_range_finder_is_in_the_telemetry(go2, tmp_path):
    go2.send("pose 5.4 2.5 0")  # the wall 0.4 m ahead
    d = make_daemon("safety.min_clearance_m=0.5", f'telemetry.path="{tmp_path / "t.jsonl"}"')
    try:
        x0 = state(d).position[0]
        assert not d.control.execute(Motion(Command(vx=0.3), 1.0))  # refused at once
        assert abs(state(d).position[0] - x0) < 0.01
        d.submit("go to the red box", max_steps=1)  # offline (hold): refused steps, each recorded
        assert wait_for(lambda: (tmp_path / "t.jsonl").exists() and (tmp_path / "t.jsonl").read_text(), 10.0)
        d.cancel()
        record = json.loads((tmp_path / "t.jsonl").read_text().splitlines()[0])
        assert record["safety_stops"]["obstacle"] == 1 and record["clearance_m"] == pytest.approx(0.4, abs=0.02)
    finally:
        d.close()


def test_go2_camera_frames_and_a_stale_camera_is_reported(go2):
    d = make_daemon()  # at start 0: the red box in view
    api = Api(d)
    try:
        frame = d.grabber.read_latest(1000)
        assert frame.meta["source"] == "go2" and frame.image.shape == (240, 320, 3)  # the robot's JPEG, decoded
        assert any("red" in s.name for s in ColorDetector().describe(frame))  # the box the simulator rendered
        assert wait_for(lambda: api.call(op="status")["status"]["camera"]["state"] == "ok")
        go2.send("hang")  # the video service stops answering
        assert wait_for(lambda: api.call(op="status")["status"]["camera"]["state"] == "stale", 5.0)
        assert any("camera go2 stale" in s for s in d.notifier.statuses())
        go2.send("answer")
        assert wait_for(lambda: d.status()["camera"]["state"] == "ok", 8.0)
        assert "stale" not in d.notifier.statuses()[-1]
    finally:
        api.close()
        go2.send("answer")
        d.close()


def test_control_loop_keeps_its_rate_and_the_watchdog_while_damp_hangs(go2):
    d = make_daemon()
    try:
        d.control.start_motion(Motion(Command(vx=0.2), 30.0))
        time.sleep(0.1)
        go2.send("hang")
        d.estop()  # Damp hangs, and so does every StopMove
        d.control.halt("again")
        ticks0, t0 = d.control.ticks, time.monotonic()
        time.sleep(1.0)
        rate = (d.control.ticks - ticks0) / (time.monotonic() - t0)
        pings = [t for t in d.notifier.times("WATCHDOG") if t >= t0]
        assert rate >= 0.6 * 50, rate  # 50 Hz asked; loose on a shared 2-core machine
        assert len(pings) >= 8 and max(b - a for a, b in zip([t0, *pings[:-1]], pings, strict=True)) < 0.5
        assert d.status()["driver_calls"]["estop"]["for_s"] >= 0.9  # and the hang shows in status
    finally:
        go2.send("answer")
        d.close()


def estop_latency(api) -> tuple[float, dict]:
    t0 = time.perf_counter()
    reply = api.call(op="estop")
    return time.perf_counter() - t0, reply


def watchdog_gaps(d, since: float) -> float:
    times = [t for t in d.notifier.times("WATCHDOG") if t >= since]
    return max(b - a for a, b in zip(times[:-1], times[1:], strict=True))


def test_estop_with_the_sport_service_hung_is_answered_in_tens_of_ms(go2):
    d = make_daemon()
    api = Api(d)
    latencies = []
    try:
        for _ in range(5):
            go2.send("answer")
            assert wait_for(lambda: d.grabber.latest_age_s() < 0.5, 5.0)  # the camera too was hung
            if d.safety.estopped:
                assert api.call(op="reset", reset_token=RESET_TOKEN)["ok"]
            d.control.start_motion(Motion(Command(vx=0.2), 30.0))
            assert wait_for(lambda: state(d).velocity[0] != 0 or state(d).mode == 3, 3.0)
            go2.send("hang")  # from now on the robot answers nothing (its RPCs wait 10 s)
            d.control.halt("test")  # a StopMove that hangs ...
            d.control.start_motion(Motion(Command(vx=0.2), 30.0))  # ... and the robot moves again
            time.sleep(0.05)
            since = time.monotonic()
            latency, reply = estop_latency(api)
            latencies.append(latency)
            assert reply == {"ok": True, "latched": True, "delivered": False, "op": "estop"}
            assert d.safety.estopped and d.status()["driver_calls"]["estop"]["call"] == "estop"
            time.sleep(1.0)
            assert watchdog_gaps(d, since) < 1.0
        print(
            f"\nAPI e-stop with the Go2's services hung, real SDK over DDS: median "
            f"{statistics.median(latencies) * 1e3:.1f} ms, max {max(latencies) * 1e3:.1f} ms"
        )
        assert max(latencies) < 0.1
        go2.send("answer")  # the Damp that waited reaches the robot: limp
        assert wait_for(lambda: state(d).mode == 7, 12.0)
        d.safety.drain(12.0)
        assert api.call(op="reset", reset_token=RESET_TOKEN)["ok"] and state(d).mode == 1  # stood up again
    finally:
        api.close()
        go2.send("answer")
        t0 = time.monotonic()
        d.close()
        assert time.monotonic() - t0 < 10.0


def test_a_late_damp_is_latched_at_once_and_reaches_the_robot_late(go2):
    d = make_daemon()
    api = Api(d)
    try:
        go2.send("delay 0.5")  # every answer 0.5 s late
        latency, reply = estop_latency(api)
        assert reply["latched"] and not reply["delivered"] and latency < 0.1, (latency, reply)
        assert wait_for(lambda: state(d).mode == 7, 3.0)  # Damp got there, late
        assert d.safety.drain(3.0)
    finally:
        api.close()
        go2.send("delay 0")
        d.close()


def test_a_go2_gone_from_the_network_never_stalls_estop_watchdog_or_shutdown(go2):
    d = make_daemon()
    api = Api(d)
    closed = False
    try:
        d.control.start_motion(Motion(Command(vx=0.2), 60.0))
        assert wait_for(lambda: state(d).mode == 3, 3.0)
        go2.stop()  # the robot is switched off: the SDK's Move now waits in its DDS write
        since = time.monotonic()
        time.sleep(1.5)  # the camera goes stale, the robot is halted: the zero Move waits (10 s)
        latency, reply = estop_latency(api)
        assert reply["ok"] and reply["latched"] and latency < 0.1, (latency, reply)
        other = api.connect()  # another API client is not frozen either
        t0 = time.perf_counter()
        other.send('{"op": "status"}')
        other.recv(timeout=2.0)
        assert time.perf_counter() - t0 < 0.5
        other.__exit__(None, None, None)
        time.sleep(2.0)
        gap = watchdog_gaps(d, since)
        print(f"\nGo2 gone: API e-stop {latency * 1e3:.1f} ms, the longest watchdog gap {gap * 1e3:.0f} ms")
        assert gap < 1.0
        api.close()
        t0 = time.monotonic()
        d.close()
        closed = True
        took = time.monotonic() - t0
        print(f"shutdown with the robot gone: {took:.1f} s")
        assert took < 10.0  # systemd's TimeoutStopSec
    finally:
        if not closed:
            api.close()
            d.close()


class SteeringDrafter(WalkingDrafter):
    """The draft model for an episode without a model (nav.grammar=false: fixed answers, one byte a token):
    the scripted policy on what the camera's colour detector says of the red object: turn toward it,
    walk by the distance rule, stop within reach, search left when it is out of view."""

    name, vocab_hash = "steering", "steering"

    def answer(self, camera: str) -> str:
        import re

        camera = camera.split("\n", 1)[0]  # the camera's line of the prompt
        red = next((part for part in camera.split(";") if "red" in part), "")
        if not red:
            return "The next action is turn left 45 degree."
        if "within reach" in red:
            return "The next action is stop."
        turn = re.search(r"(\d+) degrees to the (left|right)", red)
        if turn and int(turn.group(1)) >= 10:
            deg = min(45, max(15, 15 * round(int(turn.group(1)) / 15)))
            return f"The next action is turn {turn.group(2)} {deg} degree."
        m = re.search(r"(\d+(?:\.\d+)?) m away", red)
        d = float(m.group(1)) if m else 2.0
        return f"The next action is move forward {75 if d > 1.6 else 50 if d > 1.1 else 25} cm."


def test_edge_agent_run_on_the_go2_reaches_the_red_box_through_the_sdk(go2, capsys, monkeypatch, tmp_path):
    """`edge-agent run --controller go2 --camera go2` against the simulated Go2 in the shipped red_box scene:
    every Move, frame and range reading through unitree_sdk2py over DDS; the robot's own account says where
    it ended; the recording's /tf and /odom (the robot's rt/sportmodestate) read back with rosbags."""
    import json
    import tempfile

    import agent.decoding.drafter
    from agent.app import cli

    monkeypatch.setattr(agent.decoding.drafter, "Drafter", SteeringDrafter)
    # start 0 (the fixture's): the red box 37 degrees to the left, in view
    with tempfile.TemporaryDirectory(prefix="api-") as folder:
        rc = cli.main(
            [
                "run",
                "--listen",
                f"unix:{folder}/api.sock",
                "--telemetry",
                "",
                "--controller",
                "go2",
                "--set",
                f'robot.options={{network_interface="{INTERFACE}", domain_id={DOMAIN}}}',
                "--set",
                'camera.source="go2"',
                "--set",
                'perception.kind="color"',
                "--set",
                "nav.grammar=false",
                "--offline",
                "local",
                "--instruction",
                "go to the red box",
                "--max-steps",
                "25",
                "--exit-when-done",
                "--json",
                "--quiet",
                "--record",
                str(tmp_path / "run.mcap"),
            ]
        )
    out = capsys.readouterr()
    assert rc == 0, out.err[-2000:]
    summary = json.loads(out.out.strip().splitlines()[-1])
    robot = go2.report()
    print(f"\nGo2 over DDS, red_box start 0: {summary}, the robot's account: {robot}")
    assert summary["end"] == "done"
    assert robot["collisions"] == 0 and robot["distance_m"]["red box"] <= 0.6
    assert robot["calls"].get("Move", 0) > 20  # it walked on Move, streamed through the SDK
    types, messages = read_rosbags(tmp_path / "run.mcap")
    assert types["/tf"] == "tf2_msgs/msg/TFMessage" and types["/odom"] == "nav_msgs/msg/Odometry"
    odom = on(messages, "/odom")
    tf = on(messages, "/tf")
    assert len(odom) == len(tf) >= summary["steps"] - 1 and "/pose" not in {t for t, _, _ in messages}
    steps = [json.loads(m.data) for m in on(messages, "/step")]
    assert sum(bool(s["decided_during"]) for s in steps) >= 2  # agent.overlap: decided while the Go2 walked
    last = odom[-1].pose.pose.position  # the robot's own odometry at the end: where it says it is
    assert (last.x, last.y) == pytest.approx(tuple(robot["pose"][:2]), abs=0.1)
    assert [(t.header.frame_id, t.child_frame_id) for t in tf[-1].transforms][:2] == [
        ("map", "odom"),
        ("odom", "base_link"),
    ]


def test_a_wrong_network_interface_is_one_line():
    """In a process of its own: the DDS participant is a per-process singleton."""
    code = (
        "from agent.robot.controllers import make_controller\n"
        "from agent.robot.controllers.base import ControllerError\n"
        "try:\n"
        "    make_controller('go2', network_interface='nosuch9', domain_id=%d).connect()\n"
        "except ControllerError as e:\n"
        "    print('ERROR', e)\n" % DOMAIN
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    lines = [line for line in out.stdout.splitlines() if line.startswith("ERROR")]
    assert len(lines) == 1 and "nosuch9" in lines[0] and "network_interface" in lines[0], out
    assert "Traceback" not in out.stderr
