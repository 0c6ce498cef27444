"""agent/app/episode.py: an episode ends on the model's stop, never on the robot's own offline halt."""

from types import SimpleNamespace

from agent.app.episode import navigate
from agent.app.navigator import Step
from agent.robot.sim import make_world


class ScriptedNav:
    """Navigator stand-in: returns the given records one step at a time."""

    def __init__(self, records):
        self.records, self.cfg = list(records), SimpleNamespace(agent=SimpleNamespace(reach_m=0.6))

    def step(self, instruction, task="", cancel=None):
        return self.records.pop(0)


def _rec(n, action, envelope="", mode="verified"):
    return Step(
        n,
        "t",
        "go to the red box",
        0.0,
        mode=mode,
        action=action,
        parse="exact",
        envelope=envelope,
        latency_ms={"step": 1.0},
    )


def test_an_offline_turn_away_stop_does_not_end_the_episode_the_models_stop_does():
    world = make_world("red_box", start=0)
    nav = ScriptedNav(
        [
            _rec(1, "stop", "turned_away_stop", "offline"),
            _rec(2, "turn left 15 deg"),
            _rec(3, "stop"),
            _rec(4, "turn left 15 deg"),
        ]
    )
    summary, records = navigate(nav, world, "go to the red box", max_steps=4)
    assert len(records) == 3 and summary["end"] == "done" and summary["offline_steps"] == 1
