"""Only actions the robot can take, with the real models (agent/robot/feasible.py): facing a wall, the step's
answer grammar holds no forward move, the prompt says why, and the answer is still the target's own answer to the
prompt and grammar it saw."""

import pytest

from tests.agent.app.test_robot_e2e import ar_text, make_daemon

pytestmark = pytest.mark.real


def test_facing_a_wall_the_answer_is_the_targets_choice_among_the_moves_that_can_run(tmp_path, drafter, verifier):
    # the demo room's east wall 0.4 m ahead (nav.feasible is on by default; said here for the test's sake)
    d = make_daemon(tmp_path, drafter, verifier.url, start=(5.4, 2.5, 0.0), **{"nav.feasible": "true"})
    try:
        rec = d.nav.step("go to the red box")
        assert rec.mode == "verified" and rec.parse == "exact"
        assert rec.refused == (  # and no stop (nav.grounded): nothing the instruction names is in view
            "forward 25 cm, forward 50 cm, forward 75 cm, stop: the way ahead is blocked, 0.4 m free ahead; "
            "nothing the instruction names is in view, so the task is not done"
        )
        prompt = drafter.detokenize(d.nav.last_prompt_ids)
        assert "Not possible now: moving forward, the way ahead is blocked, 0.4 m free ahead.\nCamera: " in prompt
        grammar = d.nav.answers.grammar
        assert "move forward" not in grammar and "turn left 45 degree" in grammar and "I think I should" not in grammar
        assert not rec.action.startswith("forward") and rec.stopped_by == ""
        assert rec.text == ar_text(drafter, verifier.url, d.nav)  # exact: the target's answer under that grammar
        assert d.world.collisions == 0
    finally:
        d.close()


def test_with_nothing_in_view_the_answer_says_so_and_is_the_targets_own(tmp_path, drafter, verifier):
    # the demo's start 2 faces away from the red box: the camera line says "nothing"; a 135M model would invent a
    # side for it ("The red box is to the left"); grounded (the default), the reason opens with what it was shown
    d = make_daemon(tmp_path, drafter, verifier.url, start=2)
    try:
        rec = d.nav.step("go to the red box")
        assert rec.observation == "nothing" and rec.mode == "verified" and rec.parse == "exact"
        assert rec.text.startswith(("I do not see the ", "I still do not see the ")), rec.text
        assert '("I do not see the " | "I still do not see the ")' in d.nav.answers.grammar
        assert rec.text == ar_text(drafter, verifier.url, d.nav)  # exact: the target's answer under that grammar
    finally:
        d.close()
