"""Overlapped stepping (agent/app/overlap.py): step k + 1 decided while motion k runs, acted on when it ends only
if its plan is still fresh and motion k ran to its end; the look moved to where motion k ends (lookahead.py).

The robot is the simulator behind the real safety layer and control loop (motions take their real time); the
decoder is test_nav_memory's scripted one (the prompt and memory run as on the robot, without a model).
"""

from __future__ import annotations

import math

import pytest

from agent.app import config
from agent.app.lookahead import clearance_after, seen_after
from agent.app.navigator import Navigator
from agent.app.overlap import Overlapped
from agent.robot.actions import Action, Motion
from agent.robot.control import ControlLoop
from agent.robot.controllers.base import Command
from agent.robot.controllers.sim import SimController
from agent.robot.perception import Sighting
from agent.robot.safety import SafetyLayer, SafetyLimits
from agent.robot.sim import SimWorld

from .test_nav_memory import INSTRUCTION, ListGrabber, ListPerception, ScriptedDecoder, WordDrafter, answer, box

FORWARD = answer(Action("forward", 25))  # 0.5 s at 0.5 m/s


@pytest.fixture
def robot():
    """A started control loop over the simulator in an empty room (the robot at (1, 2.5) facing +x)."""
    world = SimWorld(size_m=(8.0, 5.0), obstacles=[], pose=(1.0, 2.5, 0.0))
    ctl = SimController(world)
    ctl.connect()
    safety = SafetyLayer(ctl, SafetyLimits(min_clearance_m=0.3, max_frame_age_s=None), ranges=ctl.ranges)
    loop = ControlLoop(safety, hz=50).start()
    yield world, loop
    loop.stop()
    ctl.disconnect()


def make(loop, answers, *sets):
    cfg = config.load(None, ["link.reconnect_backoff_s=60.0", "link.reconnect_backoff_max_s=60.0", *sets])
    nav = Navigator(ScriptedDecoder(WordDrafter(), answers), ListGrabber(), ListPerception([box(0.0, 3.0)]), loop, cfg)
    nav.check_link()
    return nav, Overlapped(nav)


def test_the_next_step_is_decided_during_the_motion_and_acted_on_when_it_ends(robot):
    world, loop = robot
    nav, runner = make(loop, [FORWARD])
    first = runner.step(INSTRUCTION, "1")
    assert first.completed and first.decided_during == 0 and first.action == "forward 25 cm"
    assert nav.steps == 2  # step 2 was decided while step 1 moved
    assert "(under way)" not in nav.memory.lines()[-1]  # settled: step 1 ran to its end
    second = runner.step(INSTRUCTION, "1", last=True)
    assert second.decided_during == 1 and second.completed and second.parse == "exact"
    assert second.latency_ms["think_moving"] >= 0 and second.latency_ms["standing"] < 250  # acted on at once
    assert nav.steps == 2  # the last step decides nothing ahead
    assert world.pose.x == pytest.approx(1.5, abs=0.06)  # both motions ran
    assert runner.refused_stale == 0 and world.collisions == 0


def test_a_plan_that_goes_stale_during_the_motion_is_not_acted_on(robot):
    """agent.max_plan_age_s 0.2 s, a 0.5 s motion: step 2's plan (its frame taken as motion 1 began) is 0.5 s old
    when motion 1 ends, so the robot halts instead of moving, and the next step decides from a new frame."""
    world, loop = robot
    nav, runner = make(loop, [FORWARD], "agent.max_plan_age_s=0.2")
    runner.step(INSTRUCTION, "1")
    x = world.pose.x
    stale = runner.step(INSTRUCTION, "1")
    assert stale.decided_during == 1 and stale.parse == "refused" and not stale.completed
    assert "older than its frame" in stale.reason and stale.parse_note == "forward 25 cm (exact) not acted on"
    assert world.pose.x == pytest.approx(x, abs=0.01)
    assert runner.refused_stale == 1
    fresh = runner.step(INSTRUCTION, "1", last=True)  # decided standing, from a new frame: fresh, acted on
    assert fresh.decided_during == 0 and fresh.completed and world.pose.x > x + 0.2


def test_a_plan_made_during_a_motion_that_is_cut_short_is_not_acted_on(robot):
    world, loop = robot
    nav, runner = make(loop, [answer(Action("forward", 75))])
    nav.decoder.generate = _halting(nav.decoder.generate, loop)  # the e-stop-like halt while step 2 is decided
    first = runner.step(INSTRUCTION, "1")
    assert not first.completed and "cut short" in first.reason
    x = world.pose.x
    replan = runner.step(INSTRUCTION, "1", last=True)
    assert replan.parse == "refused" and "cut short" in replan.reason and world.pose.x == pytest.approx(x, abs=0.01)
    assert runner.refused_cut == 1 and runner.refused_stale == 0


def _halting(generate, loop):
    calls = []

    def gen(*a, **kw):
        calls.append(1)
        if len(calls) == 2:  # step 2's generation, during motion 1
            loop.halt("test_halt")
        return generate(*a, **kw)

    return gen


def test_another_task_drops_the_decision_made_ahead(robot):
    _, loop = robot
    nav, runner = make(loop, [FORWARD])
    runner.step(INSTRUCTION, "1")
    rec = runner.step(INSTRUCTION, "2", last=True)
    assert rec.decided_during == 0 and rec.memory_steps == 0  # decided afresh for task 2, standing


def test_the_look_is_moved_to_where_the_motion_ends():
    ahead = [Sighting("red box", 0.0, 3.0, "sim"), Sighting("blue ball", 30.0, 2.0, "sim")]
    forward = seen_after(ahead, Motion(Command(vx=0.5), 1.0), 90.0)  # 0.5 m forward
    assert [s.name for s in forward] == ["blue ball", "red box"]
    assert forward[1].distance_m == pytest.approx(2.5) and forward[1].bearing_deg == pytest.approx(0.0)
    assert 30.0 < forward[0].bearing_deg < 45.0  # passing it: it moves further to the side
    left = seen_after(ahead, Motion(Command(wz=math.radians(30)), 1.0), 90.0)  # 30 degrees left
    assert [round(s.bearing_deg) for s in left] == [0, -30]  # the ball now ahead, the box 30 deg right
    right = seen_after(ahead, Motion(Command(wz=-math.radians(30)), 1.0), 90.0)
    assert [s.name for s in right] == ["red box"]  # the ball at 60 deg: out of the 90 deg field of view
    assert clearance_after(lambda a: 2.0 if a == 0 else 9.0, Motion(Command(vx=0.5), 1.0)) == pytest.approx(1.5)
    assert clearance_after(lambda a: 2.0 if a == 0 else 9.0, Motion(Command(wz=0.5), 1.0)) == 9.0
