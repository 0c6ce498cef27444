"""The answer says what the camera shows (nav.grounded, agent/app/prompt.py grounded_openings): the openings a step's
reason may take from its sightings, and the answer grammar they make (agent/robot/actions.py answer_grammar)."""

import pytest

from agent.app.prompt import grounded_openings
from agent.robot.actions import REASON_MAX_CHARS, VOCABULARY, answer_grammar, answer_max_tokens
from agent.robot.perception import Sighting
from protocol.grammar import GrammarError


def ball(bearing_deg: float, distance_m: float, name: str = "yellow ball") -> Sighting:
    return Sighting(name=name, bearing_deg=bearing_deg, distance_m=distance_m, source="sim")


@pytest.mark.parametrize(
    "seen, openings",
    [
        ([], ("I do not see the ", "I still do not see the ")),
        ([ball(3.0, 0.4)], ("The yellow ball is within reach",)),
        ([ball(-4.0, 2.0)], ("The yellow ball is ahead", "The yellow ball is still ahead")),
        ([ball(25.0, 2.0)], ("The yellow ball is to the left",)),
        ([ball(-25.0, 2.0), ball(25.0, 3.0)], ("The yellow ball is to the right",)),  # the nearest, as sorted
        ([ball(25.0, 2.0, name="ball <b>")], ()),  # a name the reason's letters cannot say: nothing forced
    ],
)
def test_the_reason_opens_with_what_the_camera_line_says(seen, openings):
    assert grounded_openings(seen, reach_m=0.6, ahead_deg=10.0) == openings


def test_the_openings_keep_the_answer_within_its_bound():
    long = "The " + "x" * 40 + " is to the left"
    g = answer_grammar(openings=("I do not see the ", long))
    assert '("I do not see the " | "The ' in g
    assert f"{{0,{REASON_MAX_CHARS - 1 - len(long)}}}" in g  # the longest opening, the rest and the period: 100
    assert answer_grammar(openings=()) == answer_grammar() and "move forward 75 cm" in g
    for bad in ("lowercase start", 'The "quoted" box', "x" * REASON_MAX_CHARS):
        with pytest.raises(ValueError):
            answer_grammar(openings=(bad,))


@pytest.mark.real
def test_the_grammar_refuses_a_side_the_camera_did_not_show(drafter):
    g = drafter.grammars.compile("gbnf", answer_grammar(openings=grounded_openings([])))
    said = "I do not see the yellow ball, so I look around. The next action is turn left 45 degree."
    assert g.walk(drafter.tokenize(said)).is_accepting() and len(drafter.tokenize(said)) < answer_max_tokens()
    with pytest.raises(GrammarError):
        g.walk(drafter.tokenize("The yellow ball is to the right, so I turn right. " + VOCABULARY[7].text))
    seen = drafter.grammars.compile("gbnf", answer_grammar(openings=grounded_openings([ball(-30.0, 2.0)])))
    seen.walk(drafter.tokenize("The yellow ball is to the right, so I turn right. " + VOCABULARY[7].text))
    with pytest.raises(GrammarError):
        seen.walk(drafter.tokenize("The yellow ball is to the left, so I turn left. " + VOCABULARY[4].text))
