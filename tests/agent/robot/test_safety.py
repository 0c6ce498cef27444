"""The safety layer and the control loop, with a fake clock: clamps, rate limits, deadman, staleness, e-stop."""

import math

import pytest

from agent.robot.actions import Motion
from agent.robot.control import ControlLoop
from agent.robot.controllers.base import Command, Controller
from agent.robot.safety import SafetyLayer, SafetyLimits, clamp, rate_limit


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t

    def advance(self, dt):
        self.t += dt


class Recorder(Controller):
    """Records what reaches the motors (a controller at the right depth for the safety layer)."""

    name = "recorder"

    def __init__(self):
        self.sent, self.stops, self.estops, self.is_connected = [], 0, 0, True

    def connect(self):
        self.is_connected = True

    def disconnect(self):
        self.is_connected = False

    @property
    def connected(self):
        return self.is_connected

    def send_action(self, cmd):
        self.sent.append(cmd)
        return cmd

    def stop(self):
        self.stops += 1
        self.sent.append(Command())

    def estop(self):
        self.estops += 1
        self.sent.append(Command())

    @property
    def velocity(self):
        return self.sent[-1] if self.sent else Command()


LIM = SafetyLimits(
    max_vx=0.5, max_vy=0.3, max_wz=0.8, max_dvx=1.0, max_dvy=1.0, max_dwz=2.0, deadman_s=0.3, max_frame_age_s=1.0
)


def test_clamp_per_axis_and_non_finite():
    assert clamp(Command(3.0, -2.0, 9.0), LIM) == Command(0.5, -0.3, 0.8)
    assert clamp(Command(-0.2, 0.1, -0.1), LIM) == Command(-0.2, 0.1, -0.1)
    for bad in (Command(math.nan, 0, 0), Command(0, math.inf, 0), Command(0, 0, -math.inf)):
        assert clamp(bad, LIM) == Command()


def test_rate_limit_moves_each_axis_by_at_most_its_limit():
    got = rate_limit(Command(0.5, 0.3, 0.8), Command(), 0.05, LIM)
    assert got == pytest.approx(Command(0.05, 0.05, 0.1))
    assert rate_limit(Command(), Command(0.5, 0, 0), 0.1, LIM).vx == pytest.approx(0.4)


def test_send_action_returns_what_the_controller_got():
    clock, robot = Clock(), Recorder()
    s = SafetyLayer(robot, LIM, clock)
    sent = s.send_action(Command(2.0, 0, 0))  # first command: clamped, then one 50 ms step of 1 m/s^2
    assert sent == robot.sent[-1] and sent.vx == pytest.approx(0.05)
    for _ in range(12):
        clock.advance(0.05)
        sent = s.send_action(Command(2.0, 0, 0))
    assert sent.vx == pytest.approx(0.5) and robot.velocity.vx == pytest.approx(0.5)


def test_nan_command_stops_the_robot():
    clock, robot = Clock(), Recorder()
    s = SafetyLayer(robot, LIM, clock)
    s.send_action(Command(0.3, 0, 0))
    assert s.send_action(Command(math.nan, 0, 0)) == Command()
    assert robot.velocity == Command() and s.stops["non_finite_command"] == 1


def test_deadman_stops_within_300_ms_of_the_last_command():
    clock, robot = Clock(), Recorder()
    s = SafetyLayer(robot, LIM, clock)
    s.send_action(Command(0.3, 0, 0))
    t_last = clock()
    stopped_at = None
    for _ in range(20):  # the control loop ticks at 20 Hz, no new commands
        clock.advance(0.05)
        if s.tick():
            stopped_at = clock()
            break
    assert stopped_at is not None and stopped_at - t_last <= 0.3 + 0.05 + 1e-9
    assert robot.velocity == Command() and s.stops == {"deadman": 1}
    assert not s.tick()  # once stopped, nothing more to stop


def test_fresh_commands_keep_the_deadman_quiet():
    clock, robot = Clock(), Recorder()
    s = SafetyLayer(robot, LIM, clock)
    for _ in range(40):
        s.send_action(Command(0.3, 0, 0))
        clock.advance(0.05)
        assert not s.tick()
    assert robot.stops == 0


@pytest.mark.parametrize("age", [None, 1.5])
def test_stale_or_missing_frame_stops(age):
    clock, robot = Clock(), Recorder()
    s = SafetyLayer(robot, LIM, clock)
    s.send_action(Command(0.3, 0, 0), frame_age_s=0.1)
    assert s.send_action(Command(0.3, 0, 0), frame_age_s=age) == Command()
    assert robot.velocity == Command() and s.stops["stale_frame"] == 1


def test_estop_is_latched_until_reset():
    clock, robot = Clock(), Recorder()
    s = SafetyLayer(robot, LIM, clock)
    s.send_action(Command(0.3, 0, 0))
    s.estop().result(1)  # the driver's e-stop runs on its own lane
    assert robot.estops == 1 and robot.velocity == Command()
    clock.advance(0.05)
    assert s.send_action(Command(0.3, 0, 0)) == Command()
    s.reset().result(1)
    clock.advance(0.05)
    assert s.send_action(Command(0.3, 0, 0)).vx > 0


def _loop(clock, robot, frame_age=lambda: 0.0, watchdog=None, interval=None):
    return ControlLoop(
        SafetyLayer(robot, LIM, clock),
        hz=20,
        frame_age=frame_age,
        watchdog=watchdog,
        watchdog_interval_s=interval,
        clock=clock,
    )


def _run(loop, clock, seconds):
    for _ in range(round(seconds * 20)):
        loop.tick()
        clock.advance(0.05)


def test_control_loop_streams_a_motion_then_ramps_down_and_stops():
    clock, robot = Clock(), Recorder()
    loop = _loop(clock, robot)
    loop.start_motion(Motion(Command(vx=0.5), 1.0))
    _run(loop, clock, 1.0)
    streamed = [c for c in robot.sent if c.vx > 0]
    assert len(streamed) >= 19 and max(c.vx for c in streamed) == pytest.approx(0.5)
    _run(loop, clock, 1.0)  # the ramp down, then the stop
    assert loop.safety.drain(1.0)  # the driver's stop runs on the driver lane
    assert robot.velocity == Command() and loop._done.is_set() and robot.stops == 1
    # distance = integral of vx over ticks ~ 0.5 m despite the ramps (up and down give and take back)
    dist = sum(c.vx for c in robot.sent) * 0.05
    assert dist == pytest.approx(0.5, abs=0.06)


def test_control_loop_stops_on_stale_frames_mid_motion():
    clock, robot = Clock(), Recorder()
    age = [0.1]
    loop = _loop(clock, robot, frame_age=lambda: age[0])
    loop.start_motion(Motion(Command(vx=0.5), 2.0))
    _run(loop, clock, 0.5)
    assert robot.velocity.vx > 0
    age[0] = 5.0  # the camera froze
    loop.tick()
    assert robot.velocity == Command() and loop._done.is_set()
    assert loop.safety.stops["stale_frame"] == 1


def test_estop_stops_within_one_tick_and_drops_the_motion():
    clock, robot = Clock(), Recorder()
    loop = _loop(clock, robot)
    loop.start_motion(Motion(Command(vx=0.5), 5.0))
    _run(loop, clock, 0.5)
    loop.estop().result(1)  # from the API's thread, between two ticks
    assert robot.estops == 1 and robot.velocity == Command()
    n = len(robot.sent)
    _run(loop, clock, 0.5)
    assert all(c == Command() for c in robot.sent[n:])
    loop.start_motion(Motion(Command(vx=0.5), 1.0))  # latched: a new motion does not start
    _run(loop, clock, 0.5)
    assert robot.velocity == Command()


def test_watchdog_pings_from_the_loop_at_its_interval():
    clock, robot, pings = Clock(), Recorder(), []
    loop = _loop(clock, robot, watchdog=lambda: pings.append(clock()), interval=0.5)
    _run(loop, clock, 2.0)
    assert 4 <= len(pings) <= 5 and all(b - a >= 0.5 - 1e-9 for a, b in zip(pings, pings[1:], strict=False))


def test_control_loop_thread_keeps_running_after_a_driver_fault():
    class Faulty(Recorder):
        calls = 0

        def send_action(self, cmd):
            Faulty.calls += 1
            if Faulty.calls == 2:
                raise OSError("bus error")
            return super().send_action(cmd)

    import time

    robot = Faulty()
    loop = ControlLoop(SafetyLayer(robot, LIM), hz=100).start()
    try:
        ok = loop.execute(Motion(Command(vx=0.2), 0.2), timeout_s=2.0)
        assert not ok  # the fault cut the motion short
        time.sleep(0.05)
        assert loop.alive and robot.velocity == Command()
    finally:
        loop.stop()


class Ranges:
    """A range source at the right depth: the clearance (m) per direction, None where nothing looks."""

    def __init__(self, ahead=5.0, behind=None):
        self.ahead, self.behind, self.asked = ahead, behind, []

    def clearance_m(self, heading_rad):
        self.asked.append(heading_rad)
        return self.ahead if abs(heading_rad) <= math.pi / 2 else self.behind


OBST = SafetyLimits(**{**LIM.__dict__, "min_clearance_m": 0.5, "max_dvx": 100.0, "max_dwz": 100.0})


def test_obstacle_stop_refuses_forward_motion_and_counts_it_once():
    clock, robot, ranges = Clock(), Recorder(), Ranges(ahead=2.0)
    s = SafetyLayer(robot, OBST, clock, ranges=ranges)
    assert s.send_action(Command(0.3, 0, 0)).vx == 0.3
    ranges.ahead = 0.3  # something came within 0.5 m ahead
    for _ in range(5):
        clock.advance(0.05)
        assert s.send_action(Command(0.3, 0, 0)) == Command()
    assert robot.velocity == Command() and s.stops == {"obstacle": 1} and s.clearance_m == 0.3
    clock.advance(0.05)  # turning away stays allowed, and so does backing off
    assert s.send_action(Command(0.3, 0, 0.5)) == Command(0, 0, 0.5)
    clock.advance(0.05)
    assert s.send_action(Command(-0.2, 0, 0)).vx == -0.2
    ranges.ahead = 1.0
    clock.advance(0.05)
    assert s.send_action(Command(0.3, 0, 0)).vx == 0.3


def test_obstacle_stop_without_a_reading_refuses_forward_only():
    clock, robot = Clock(), Recorder()
    s = SafetyLayer(robot, OBST, clock, ranges=Ranges(ahead=None, behind=None))
    assert s.send_action(Command(0.3, 0, 0)) == Command() and s.stops == {"obstacle": 1}
    assert s.send_action(Command(-0.2, 0, 0)).vx == -0.2  # nothing looks behind: backing is not blind-refused


def test_obstacle_rule_needs_a_range_source():
    with pytest.raises(ValueError, match="needs a range source"):
        SafetyLayer(Recorder(), OBST)
    SafetyLayer(Recorder(), LIM)  # min_clearance_m 0: no rule, no source needed


def test_the_obstacle_stop_is_on_by_default_where_the_robot_has_ranges(caplog):
    """No config: on at AUTO_CLEARANCE_M with a range source; off, and said so, without one."""
    from agent.robot.safety import AUTO_CLEARANCE_M

    default = SafetyLimits(**{**LIM.__dict__, "min_clearance_m": None, "max_dvx": 100.0})
    clock, robot, ranges = Clock(), Recorder(), Ranges(ahead=AUTO_CLEARANCE_M / 2)
    s = SafetyLayer(robot, default, clock, ranges=ranges)
    assert s.limits.min_clearance_m == AUTO_CLEARANCE_M > 0
    assert s.send_action(Command(0.3, 0, 0)) == Command() and s.stops == {"obstacle": 1}
    with caplog.at_level("WARNING"):
        blind = SafetyLayer(Recorder(), default, Clock())
    assert blind.limits.min_clearance_m == 0 and "no range source: the obstacle stop is off" in caplog.text
    assert blind.send_action(Command(0.3, 0, 0)).vx > 0
    explicit = SafetyLayer(
        Recorder(), SafetyLimits(**{**default.__dict__, "min_clearance_m": 0.0}), Clock(), ranges=ranges
    )
    assert explicit.limits.min_clearance_m == 0  # 0 in a config still turns it off


def test_the_simulated_robot_keeps_off_the_walls_with_no_config():
    """The scripted policy from the start where it walks into the block (15 contact ticks with the stop off)."""
    from agent.robot.scene import load_scene
    from agent.robot.scripted import FakeClock, run_scripted
    from agent.robot.sim import make_world

    scene = load_scene("green_box_behind_block")
    contacts = {}
    for clearance in (0.0, None):
        world = make_world(scene, start=1, clock=FakeClock())
        run_scripted(
            world,
            None,
            scene.target,
            max_steps=30,
            limits=SafetyLimits(max_frame_age_s=None, min_clearance_m=clearance),
        )
        contacts[clearance] = world.collisions
    assert contacts[0.0] > 0 and contacts[None] == 0
