"""The action parser: exact strings, the tolerant parse that snaps, and garbage that means stop."""

import math

import pytest

from agent.robot.actions import STOP, VOCABULARY, Action, complete, motion_for, parse_action, snap

EXACT = [
    ("The next action is move forward 25 cm.", Action("forward", 25)),
    ("The next action is move forward 75 cm", Action("forward", 75)),
    ("the next action is TURN LEFT 45 degree.", Action("left", 45)),
    ("The next action is turn right 15 degrees.", Action("right", 15)),
    ("I think I should stop because I have finished the instruction.", STOP),
    # reasoning first, then the sentence: the sentence decides
    ("The red box is ahead, so I move forward. The next action is move forward 50 cm.", Action("forward", 50)),
    # the first whole action wins over a later one
    (
        "The box is within reach, so I stop. I think I should stop because I have finished the instruction. "
        "The next action is turn right 15 degree.",
        STOP,
    ),
    ("The next  action   is\nturn left 30 degree.", Action("left", 30)),
]

TOLERANT = [
    ("The next action is turn right 27 degree.", Action("right", 30), "snapped 27"),
    ("The next action is turn left 120 degrees.", Action("left", 45), "snapped 120"),
    ("The next action is turn right 0 degrees.", Action("right", 15), "snapped 0"),
    ("The next action is move forward 60 cm.", Action("forward", 50), "snapped 60"),  # tie 50/75 -> nearer: 50
    ("The next action is move forward 1 m.", Action("forward", 75), "snapped 100"),
    ("I will walk forward 30 centimeters", Action("forward", 25), "snapped 30"),
    ("turn left", Action("left", 15), "no angle"),
    ("The next action is move forward.", Action("forward", 25), "no distance"),
    ("The box is ahead, so I move forward. The next action is turn left 37 degree.", Action("left", 30), "snapped 37"),
    ("Let me turn to the right by 44°", Action("right", 45), "snapped 44"),
    ("I should stop here", STOP, ""),
]

GARBAGE = [
    "",
    "   ",
    "blah blah",
    "The next action is jump.",
    "move backward 50 cm",
    "turn around",
    "\x00\xff",
    "The red box is to the left.",
    "forwards and backwards are words",
    None,
    42,
]


@pytest.mark.parametrize("text,want", EXACT)
def test_exact(text, want):
    p = parse_action(text)
    assert (p.action, p.how) == (want, "exact")


@pytest.mark.parametrize("text,want,note", TOLERANT)
def test_tolerant_snaps_to_allowed_values(text, want, note):
    p = parse_action(text)
    assert (p.action, p.how) == (want, "tolerant")
    assert note in p.note


@pytest.mark.parametrize("text", GARBAGE)
def test_garbage_means_stop_never_forward(text):
    p = parse_action(text)
    assert p.action == STOP and p.how == "miss" and p.note


def test_every_canonical_sentence_parses_to_itself():
    assert len(VOCABULARY) == 10
    for a in VOCABULARY:
        assert parse_action(a.text) == parse_action(a.text.upper())
        assert parse_action(a.text).action == a and parse_action(a.text).how == "exact"


def test_actions_outside_the_vocabulary_cannot_be_built():
    for kind, amount in (("forward", 100), ("left", 90), ("back", 25), ("stop", 5)):
        with pytest.raises(ValueError):
            Action(kind, amount)


def test_snap():
    assert snap(37.4, (15, 30, 45)) == 30 and snap(38, (15, 30, 45)) == 45 and snap(22.5, (15, 30, 45)) == 15
    assert snap(-5, (25, 50, 75)) == 25 and snap(1e9, (25, 50, 75)) == 75


def test_complete_needs_a_whole_sentence():
    assert not complete("The red box is ahead, so I move forward. The next action is move forward 2")
    assert not complete("The next action is move forward 25 cm")  # "25 cm" could still become more
    assert complete("The next action is move forward 25 cm.")
    assert complete("The next action is turn left 27 degree.")  # tolerant, finished
    assert complete("I think I should stop because I have finished the instruction.")
    assert not complete("The red box is within reach, so I stop")


def test_motion_follows_navila_bench():
    m = motion_for(Action("forward", 75))
    assert m.cmd.vx == 0.5 and m.cmd.wz == 0 and math.isclose(m.duration_s, 1.5)
    m = motion_for(Action("left", 30))
    assert m.cmd.wz > 0 and math.isclose(m.cmd.wz * m.duration_s, math.radians(30))
    m = motion_for(Action("right", 45))
    assert m.cmd.wz < 0 and math.isclose(-m.cmd.wz * m.duration_s, math.radians(45))
    assert motion_for(STOP).duration_s == 0


def test_observation_keeps_the_objects_the_task_names():
    from agent.app.prompt import observation_text, relevant
    from agent.robot.perception import Sighting

    seen = [
        Sighting("blue ball", 0.0, 1.0, "sim"),
        Sighting("red box", 38.0, 5.2, "sim"),
        Sighting("red ball", -20.0, 2.0, "sim"),
    ]
    assert observation_text(relevant(seen, "Go to the red box.")) == "red box 38 degrees to the left, 5.2 m away"
    assert observation_text(relevant(seen[:1], "go to the red box")) == "nothing"  # only a distractor in view
    detector = [Sighting("red object", -4.0, 0.4, "color")]
    assert observation_text(relevant(detector, "go to the red box")) == "red object ahead, within reach"
    assert relevant(seen, "look around") == []  # nothing named is in view
    # a same-coloured distractor is not the target, even when the target itself is out of view
    assert relevant([Sighting("yellow box", 10.0, 2.0, "sim")], "go to the yellow ball") == []
    assert observation_text(relevant(seen[2:], "go to the red box")) == "nothing"
