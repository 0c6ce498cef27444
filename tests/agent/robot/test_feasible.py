"""Only actions the robot can take (agent/robot/feasible.py): the rules, and that they agree with the safety layer
in the simulator (every forward move they allow runs to its end; the largest they refuse is cut short)."""

import math

import pytest

from agent.robot.actions import FORWARD_CM, STOP, VOCABULARY, Action, answer_grammar
from agent.robot.feasible import (
    CUT_SHORT_TURN,
    EVERYTHING,
    Feasibility,
    feasible_actions,
    target_ahead,
    toward_target,
)
from agent.robot.perception import Sighting

TURNS = {a for a in VOCABULARY if a.kind in ("left", "right")}


def forwards(f):
    return [a.amount for a in f.allowed if a.kind == "forward"]


def test_forward_moves_are_kept_only_where_the_obstacle_stop_would_not_cut_them():
    assert feasible_actions(3.0, 0.2) == EVERYTHING and EVERYTHING.note == "" and not EVERYTHING.refused
    assert forwards(feasible_actions(0.76, 0.2)) == [25, 50]  # 0.75 + 0.2 + 0.05 > 0.76
    some = feasible_actions(0.5, 0.2)
    assert forwards(some) == [25] and {a.amount for a in some.refused} == {50, 75}
    assert some.note == "Not possible now: moving forward more than 25 cm, only 0.5 m free ahead."
    none = feasible_actions(0.3, 0.2)
    assert forwards(none) == [] and set(none.refused) == {Action("forward", d) for d in FORWARD_CM}
    assert none.note == "Not possible now: moving forward, the way ahead is blocked, 0.3 m free ahead."
    for f in (some, none, feasible_actions(None, 0.2), feasible_actions(3.0, 0.2, cut_short=CUT_SHORT_TURN)):
        assert TURNS <= set(f.allowed) and STOP in f.allowed  # turning and stopping are always possible
    assert forwards(feasible_actions(None, 0.2)) == []  # blind: the safety layer refuses it anyway
    assert feasible_actions(0.0, 0.0) == EVERYTHING  # the obstacle stop off: nothing to refuse for it


def test_the_smallest_step_toward_the_target_itself_stays():
    assert forwards(feasible_actions(0.3, 0.2, target_ahead=True)) == [25]
    seen = [Sighting("red box", 4.0, 0.7, "sim")]
    assert target_ahead(seen, 0.3, 10.0, 0.6) and not target_ahead(seen, None, 10.0, 0.6)
    assert not target_ahead([Sighting("red box", 4.0, 1.5, "sim")], 0.3, 10.0, 0.6)  # something else is nearer
    assert not target_ahead([Sighting("red box", 25.0, 0.7, "sim")], 0.3, 10.0, 0.6)  # not ahead


class Ranges:
    def __init__(self, ahead):
        self.ahead = ahead

    def clearance_m(self, heading_rad):
        return self.ahead


def test_two_forward_moves_cut_short_in_a_row_make_the_robot_turn():
    f = Feasibility(Ranges(2.0), 0.2)
    assert f.now([], 10.0, 0.6) == EVERYTHING
    f.moved(Action("forward", 25), "obstacle")
    assert f.now([], 10.0, 0.6) == EVERYTHING  # once may be the target's approach
    f.moved(Action("forward", 25), "obstacle")
    turn = f.now([], 10.0, 0.6)
    assert forwards(turn) == [] and "last 2 forward moves were cut short" in turn.note
    f.moved(Action("left", 30), "")
    assert f.now([], 10.0, 0.6) == EVERYTHING
    f.moved(Action("forward", 25), "obstacle")
    f.reset()  # a new task
    f.moved(Action("forward", 25), "obstacle")
    assert f.now([], 10.0, 0.6) == EVERYTHING
    assert Feasibility(None, 0.2).now([], 10.0, 0.6) == EVERYTHING  # no range source: no obstacle stop


def test_the_grammar_holds_the_allowed_actions_alone():
    assert answer_grammar(allowed=VOCABULARY) == answer_grammar()  # nothing refused: the grammar of old
    g = answer_grammar(allowed=feasible_actions(0.5, 0.2).allowed)
    assert "move forward 25 cm" in g and "move forward 50 cm" not in g and "turn left 45 degree" in g
    assert answer_grammar(allowed=list(reversed(VOCABULARY))) == answer_grammar()  # one text per set
    with pytest.raises(ValueError):
        answer_grammar(allowed=())


@pytest.mark.parametrize("clearance", [0.3, 0.45, 0.6, 0.85, 1.2])
def test_what_is_allowed_runs_to_its_end_in_the_simulator(clearance):
    """Facing the cabinet of green_box_behind_block at `clearance` m: every allowed forward move runs through the
    deployed safety layer without an obstacle stop, and the largest refused one is stopped."""
    from agent.robot.controllers.sim import SimController
    from agent.robot.safety import SafetyLayer, SafetyLimits
    from agent.robot.scripted import FakeClock, execute
    from agent.robot.sim import make_world

    limits = SafetyLimits(max_frame_age_s=None)  # the obstacle stop at its default distance

    def run(action):
        clock = FakeClock()
        world = make_world(
            "green_box_behind_block", start=(2.8, 2.8 - world_radius - clearance, math.pi / 2), clock=clock
        )
        controller = SimController(world)
        safety = SafetyLayer(controller, limits, clock=clock, ranges=controller.ranges)
        controller.connect()
        if action is None:
            return safety, controller
        from agent.robot.actions import motion_for

        motion = motion_for(action)
        execute(safety, clock, motion.cmd, motion.duration_s, 0.05, clock())
        return safety.stops.get("obstacle", 0), world.collisions

    world_radius = make_world("green_box_behind_block").radius
    safety, controller = run(None)
    f = Feasibility(controller.ranges, safety.limits.min_clearance_m).now([], 10.0, 0.6)
    for d in forwards(f):
        assert run(Action("forward", d)) == (0, 0), f"forward {d} cm allowed at {clearance} m was cut short"
    refused = [a for a in f.refused if a.kind == "forward"]
    if refused:
        stops, collisions = run(max(refused, key=lambda a: a.amount))
        assert stops == 1 and collisions == 0


def ball(bearing_deg, distance_m=2.0):
    return Sighting(name="yellow ball", bearing_deg=bearing_deg, distance_m=distance_m, source="sim")


def test_no_turn_swings_the_target_farther_past_ahead_than_it_is():
    f = toward_target(EVERYTHING, [ball(11.0)], unseen_deg=0.0)  # 11 degrees to the left: left 15 brings it to -4
    assert {a for a in VOCABULARY if a not in f.allowed} == {Action("left", 30), Action("left", 45)}
    assert f.note == "" and f.steer == "a turn left of more than 22 degrees would swing past the yellow ball"
    assert toward_target(EVERYTHING, [ball(-34.0)], 0.0) is EVERYTHING  # every right turn brings it nearer ahead
    assert Action("right", 15) not in toward_target(EVERYTHING, [ball(-4.0)], 0.0).allowed  # ahead: no turn toward
    assert toward_target(EVERYTHING, [ball(0.3)], 0.0) is EVERYTHING  # dead ahead: either way is away
    safe = feasible_actions(0.3, 0.2)  # a wall ahead: the safety layer's refusals stay, with their note
    both = toward_target(safe, [ball(20.0)], 0.0)
    assert set(both.allowed) == set(safe.allowed) - {Action("left", 45)} and both.note == safe.note


def test_with_nothing_in_view_no_stop_and_after_a_full_circle_the_robot_moves_before_it_turns_again():
    f = Feasibility(None, None, toward=True)
    looking = tuple(a for a in VOCABULARY if a != STOP)  # nothing in view: the instruction is not finished
    for _ in range(7):
        assert f.now([], 10.0, 0.6).allowed == looking
        f.moved(Action("left", 45), "")
    assert f.now([], 10.0, 0.6).allowed == looking  # 315 degrees
    f.moved(Action("left", 45), "")
    circled = f.now([], 10.0, 0.6)
    assert all(a.kind == "forward" for a in circled.allowed) and "360 degrees" in circled.steer
    assert circled.note == ""  # not said in the prompt: the model copies notes (docs/benchmarks/navigation.md)
    f.moved(Action("forward", 25), "")
    assert f.now([], 10.0, 0.6).allowed == looking  # moved: it looks around again
    f.moved(Action("left", 45), "")
    f.unseen_deg = 400.0
    assert f.now([ball(30.0)], 10.0, 0.6) == EVERYTHING and f.unseen_deg == 0.0  # a sighting ends the circle
    assert f.now([ball(0.5, 0.4)], 10.0, 0.6).allowed == (STOP,)  # within reach, ahead: the task is done
    near = f.now([ball(-14.0, 0.4)], 10.0, 0.6)  # within reach, to the right: a stop or a turn to face it
    assert near.allowed == (Action("right", 15), STOP) and "within reach" in near.steer
    f.unseen_deg = 400.0
    f.reset()
    assert f.unseen_deg == 0.0
    wall = feasible_actions(0.1, 0.2)  # nothing forward can run: the turns stay, with the safety layer's note
    blocked = toward_target(wall, [], unseen_deg=720.0)
    assert blocked.allowed == tuple(a for a in wall.allowed if a != STOP) and blocked.note == wall.note
