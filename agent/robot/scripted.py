"""A scripted reactive policy in NaVILA's vocabulary, and an episode runner on a fake clock.

`scripted_action` is the baseline a language model must beat (and the oracle the
tests use): search by turning left, turn toward the target, walk, stop within reach.
`run_scripted` drives the simulator the way the robot is driven (frame -> sightings ->
policy text -> parse_action -> motion_for -> SafetyLayer -> SimController), on a
`FakeClock`, so an episode takes no real time; its steps go through the one episode
loop (agent/robot/episode.py run_episode), so it ends as the model's episodes do.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

from .actions import FORWARD_CM, TURN_DEG, Action, motion_for, parse_action, snap
from .camera import Frame
from .controllers.base import Command
from .controllers.sim import SimController
from .episode import run_episode
from .perception import Sighting, SimPerception
from .safety import SafetyLayer, SafetyLimits
from .sim import SimWorld


def scripted_action(
    sightings: list[Sighting], target: str = "red box", reach_m: float = 0.6, ahead_deg: float = 10.0
) -> str:
    """One of NaVILA's 10 sentences: search left, turn toward the target, walk, or stop within reach."""
    seen = [s for s in sightings if s.name.lower() == target.lower()]
    if not seen:
        return Action("left", TURN_DEG[-1]).text
    s = min(seen, key=lambda s: s.distance_m)
    if s.distance_m <= reach_m:
        return Action("stop").text
    if abs(s.bearing_deg) >= ahead_deg:
        return Action("left" if s.bearing_deg > 0 else "right", snap(abs(s.bearing_deg), TURN_DEG)).text
    cm = FORWARD_CM[2] if s.distance_m > 1.6 else FORWARD_CM[1] if s.distance_m > 1.1 else FORWARD_CM[0]
    return Action("forward", cm).text


class FakeClock:
    """A callable clock that moves only when told to."""

    def __init__(self, t: float = 0.0) -> None:
        self.t = float(t)

    def __call__(self) -> float:
        return self.t

    def advance(self, dt: float) -> None:
        if dt < 0:
            raise ValueError("a clock does not go back")
        self.t += dt


@dataclass
class EpisodeResult:
    reached: bool  # within reach of the target when the episode ended
    steps: int  # policy calls
    actions: list[Action] = field(default_factory=list)  # one per step, as parsed
    collisions: int = 0  # collisions during the episode
    path_len_m: float = 0.0  # distance the robot travelled
    final_distance_m: float = math.inf  # to the target's surface at the end
    end: str = "max_steps"  # done | unparseable | max_steps (agent/robot/episode.py)


@dataclass(frozen=True)
class ScriptedStep:
    """One step of a scripted episode, as the episode loop reads it."""

    action: str  # str(Action) of the parsed answer
    parse: str  # how parse_action read the policy's text: exact | tolerant | miss
    envelope: str = ""  # the scripted runner never changes an action itself


def execute(
    safety: SafetyLayer,
    clock: FakeClock,
    cmd: Command,
    duration_s: float,
    period_s: float,
    frame_t: float,
    max_ramp_steps: int = 200,
) -> None:
    """Send `cmd` every period for duration_s of fake time, then zero until the rate-limited ramp-down ends."""
    for _ in range(int(round(duration_s / period_s))):
        safety.send_action(cmd, frame_age_s=clock() - frame_t)
        clock.advance(period_s)
        safety.tick()
    for _ in range(max_ramp_steps):
        if safety.send_action(Command(), frame_age_s=clock() - frame_t) == Command():
            break
        clock.advance(period_s)
        safety.tick()


def run_scripted(
    world: SimWorld,
    policy: Callable[[list[Sighting]], str] | None,
    target: str = "red box",
    max_steps: int = 40,
    control_hz: float = 20.0,
    limits: SafetyLimits = SafetyLimits(max_frame_age_s=None),
) -> EpisodeResult:
    """Run the policy from the world's current pose until it says stop or max_steps pass.

    The world's clock must be a FakeClock (the runner moves it); policy None is scripted_action.
    """
    clock = world.clock
    if not isinstance(clock, FakeClock):
        raise TypeError("run_scripted needs a world made with clock=FakeClock() (it advances the clock itself)")
    say = policy or (lambda s: scripted_action(s, target=target))
    perception = SimPerception(world)
    controller = SimController(world)
    safety = SafetyLayer(controller, limits, clock=clock, ranges=controller.ranges)  # the obstacle stop as deployed
    safety.controller.connect()
    t0, collisions0 = clock(), world.collisions
    actions: list[Action] = []
    period = 1.0 / control_hz

    def step(n: int) -> ScriptedStep:
        pose = world.pose
        frame = Frame(world.render_camera(pose=pose), clock(), n, {"pose": tuple(pose), "source": "sim"})
        parsed = parse_action(say(perception.describe(frame)))
        actions.append(parsed.action)
        if parsed.action.kind != "stop":
            motion = motion_for(parsed.action)
            execute(safety, clock, motion.cmd, motion.duration_s, period, frame.t)
        return ScriptedStep(str(parsed.action), parsed.how)

    try:
        end, records = run_episode(step, max_steps)
    finally:
        safety.stop("episode_end")
    path = [p for p in world.path if p[0] >= t0]
    return EpisodeResult(
        reached=world.reached(target),
        steps=len(records),
        actions=actions,
        collisions=world.collisions - collisions0,
        path_len_m=sum(math.hypot(b[1] - a[1], b[2] - a[2]) for a, b in zip(path, path[1:], strict=False)),
        final_distance_m=world.distance_to(target),
        end=end,
    )
