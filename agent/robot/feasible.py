"""Only actions the robot can take: the NaVILA vocabulary narrowed to what the safety layer would let run now.

SayCan (arXiv 2204.01691) weighs what a language model would choose by what the robot can do; here the weight
is 0 or 1 and it is exact. Each step the navigator asks `Feasibility.now()` which actions can run from where the
robot stands, decodes the answer under a grammar of those alone (agent/robot/actions.py `answer_grammar(allowed=)`,
on the draft and on the target as ever: the answer is the target's choice among the allowed actions), and says in
the prompt what was left out and why (`Feasible.note`).

The rules, for a robot with a range source and the obstacle stop on (`safety.min_clearance_m` > 0; without
them every action stays, as before):

    forward d cm  refused when the range ahead minus d leaves less than min_clearance_m + FORWARD_MARGIN_M
                  (the obstacle stop would cut it short), or when there is no reading ahead (the safety layer
                  refuses a blind forward motion); except the smallest step toward the target itself, seen
                  ahead no farther than the reading plus the reach: walking up to it is the task, and the
                  obstacle stop ends that step next to it.
    any forward   refused after CUT_SHORT_TURN forward moves in a row that the obstacle stop cut short, until
                  the robot turns (the reading said the way was free and was wrong twice: a thin obstacle, a
                  corner the rays miss).
    turns, stop   always allowed: turning in place is what the safety layer always lets through, and a stop
                  is safe anywhere.

With nav.grounded (`Feasibility(toward=True)`) four rules on the target narrow what is left (`toward_target`; not
said in the prompt, which the model copies: agent/app/prompt.py grounded_openings says what it sees instead):

    once the target is within reach only a stop or a turn toward it stays: it is there (a forward move would
                  be cut short against it, a turn away loses it from view; both were answered next to it).
    stop is left out while nothing the instruction names is in view: its sentence says the instruction is
                  finished, which the camera contradicts (with a range source and the obstacle stop a note on
                  what cannot run made the model end its reason there and stop: docs/benchmarks/navigation.md).
    a turn toward the target seen to one side, of more than twice its bearing, is left out: it would swing the
                  target farther past ahead than it is now (a 135M model copies "45" from its memory lines and
                  swings left and right around a target 11 degrees off, measured in nav_eval's `cluttered` 2).
    after a full circle of turns with nothing the instruction names in view (CIRCLE_DEG, no forward move
                  since), the turns are left out while a forward move can run: turning on the spot shows
                  nothing new, so the robot moves to look from elsewhere.

Pure: the range reading comes in as a number; `Feasibility` keeps the count of cut-short forwards and the turns made
without a sighting (per task).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Sequence

from .actions import FORWARD_CM, VOCABULARY, Action
from .controllers.base import RangeSource
from .perception import Sighting

log = logging.getLogger(__name__)

FORWARD_MARGIN_M = 0.05  # past the obstacle stop's distance: the ramp down at the end of a motion
CUT_SHORT_TURN = 2  # forward moves in a row cut short by the obstacle stop, after which the robot turns
CIRCLE_DEG = 360  # degrees turned with nothing in view, after which the robot moves before it turns again
TURNS = ("left", "right")


@dataclass(frozen=True)
class Feasible:
    """The actions a step may answer with, and why the others are left out."""

    allowed: tuple[Action, ...]  # in VOCABULARY's order; always holds stop
    why: str = ""  # why the safety layer's refused ones are ("" when none is): the prompt's note
    steer: str = ""  # why the target's rules (toward_target) left others out ("" when they did not)

    @property
    def refused(self) -> tuple[Action, ...]:
        return tuple(a for a in VOCABULARY if a not in self.allowed)

    @property
    def note(self) -> str:
        """The prompt's line on what cannot be done now ("" when everything can)."""
        forwards = [a.amount for a in self.allowed if a.kind == "forward"]
        if not self.why:
            return ""
        what = "moving forward" if not forwards else f"moving forward more than {max(forwards)} cm"
        return f"Not possible now: {what}, {self.why}."


EVERYTHING = Feasible(VOCABULARY)


def feasible_actions(
    clearance_m: float | None,
    min_clearance_m: float,
    cut_short: int = 0,
    target_ahead: bool = False,
    margin_m: float = FORWARD_MARGIN_M,
    turn_after: int = CUT_SHORT_TURN,
) -> Feasible:
    """The actions that can run now (the module docstring's rules).

    clearance_m: the range reading straight ahead, from the robot's edge (None: no reading); min_clearance_m: the
    obstacle stop's distance (0: off); cut_short: forward moves in a row the obstacle stop cut short;
    target_ahead: what the reading sees is the target (seen ahead, no farther than the reading plus the reach).
    """
    if not min_clearance_m > 0:
        return EVERYTHING
    others = tuple(a for a in VOCABULARY if a.kind != "forward")
    if cut_short >= turn_after:
        return Feasible(others, f"my last {cut_short} forward moves were cut short by an obstacle")
    if clearance_m is None:
        return Feasible(others, "there is no range reading ahead")
    room = clearance_m - min_clearance_m - margin_m
    forwards = [d for d in FORWARD_CM if d / 100.0 <= room + 1e-9 or (target_ahead and d == FORWARD_CM[0])]
    allowed = tuple(a for a in VOCABULARY if a.kind != "forward" or a.amount in forwards)
    if len(forwards) == len(FORWARD_CM):
        return Feasible(allowed)
    free = f"{max(clearance_m, 0.0):.1f} m free ahead"
    return Feasible(allowed, f"only {free}" if forwards else f"the way ahead is blocked, {free}")


def target_ahead(seen: Sequence[Sighting], clearance_m: float | None, ahead_deg: float, reach_m: float) -> bool:
    """Whether the range reading ahead is the target itself: seen ahead, no farther than the reading plus the
    reach (agent/app/prompt.py blocked_text's test)."""
    if clearance_m is None:
        return False
    return any(abs(s.bearing_deg) < ahead_deg and s.distance_m <= clearance_m + reach_m for s in seen)


def toward_target(
    safe: Feasible,
    seen: Sequence[Sighting],
    unseen_deg: float,
    reach_m: float = 0.6,
    circle_deg: float = CIRCLE_DEG,
) -> Feasible:
    """`safe` narrowed by the target's rules (the module docstring's): within reach a stop or a turn toward it; no
    stop with nothing in view; no turn that swings the nearest sighting farther past ahead than it is; no turn
    after a full circle without one while a forward move can run."""
    allowed, steer = safe.allowed, ""
    if seen:
        bearing, name = seen[0].bearing_deg, seen[0].name
        side = TURNS[0] if bearing > 0 else TURNS[1]
        if abs(bearing) >= 1.0:
            allowed = tuple(a for a in allowed if a.kind != side or a.amount <= 2 * abs(bearing))
            if len(allowed) < len(safe.allowed):
                steer = f"a turn {side} of more than {2 * abs(bearing):.0f} degrees would swing past the {name}"
        if seen[0].distance_m < reach_m:
            allowed = tuple(a for a in allowed if a.kind == "stop" or (a.kind == side and abs(bearing) >= 1.0))
            steer = f"the {name} is within reach: a stop, or a turn to face it"
    else:
        allowed = tuple(a for a in allowed if a.kind != "stop")
        steer = "nothing the instruction names is in view, so the task is not done"
        if unseen_deg >= circle_deg and any(a.kind == "forward" for a in allowed):
            allowed = tuple(a for a in allowed if a.kind not in TURNS)
            steer += f"; I turned {unseen_deg:.0f} degrees and saw nothing, so I move to look from elsewhere"
    return Feasible(allowed, safe.why, steer) if steer else safe


def every_allowed() -> list[tuple[Action, ...]]:
    """Every set of actions `feasible_actions` can return (the forward moves up to 75, 50, 25 cm or none, with
    the turns and stop): the answer grammars a robot may need, compiled once before its first task."""
    others = [a for a in VOCABULARY if a.kind != "forward"]
    return [
        tuple(a for a in VOCABULARY if a.kind != "forward" or a.amount <= top)
        for top in sorted(FORWARD_CM, reverse=True)
    ] + [tuple(others)]


class Feasibility:
    """What the robot can do now, from its range source and the obstacle stop's distance; counts the forward moves
    in a row the obstacle stop cut short (per task: `reset`)."""

    def __init__(
        self,
        ranges: RangeSource | None,
        min_clearance_m: float | None,
        turn_after: int = CUT_SHORT_TURN,
        toward: bool = False,
    ):
        self.ranges = ranges
        self.min_clearance_m = (min_clearance_m or 0.0) if ranges is not None else 0.0
        self.turn_after = turn_after
        self.toward = toward  # the target's rules too (toward_target; nav.grounded)
        self.cut_short = 0  # forward moves in a row cut short by the obstacle stop
        self.unseen_deg = 0.0  # degrees turned since the last sighting or forward move

    def now(self, seen: Sequence[Sighting], ahead_deg: float, reach_m: float) -> Feasible:
        """The actions that can run from here; `seen`: the sightings the instruction names, nearest first."""
        if seen:
            self.unseen_deg = 0.0
        safe = EVERYTHING
        if self.min_clearance_m > 0:
            clearance = self.clearance_ahead()
            safe = feasible_actions(
                clearance,
                self.min_clearance_m,
                self.cut_short,
                target_ahead(seen, clearance, ahead_deg, reach_m),
                turn_after=self.turn_after,
            )
        return toward_target(safe, seen, self.unseen_deg, reach_m) if self.toward else safe

    def clearance_ahead(self) -> float | None:
        """The range reading straight ahead; None without one (a fault reads as none: no forward move)."""
        if self.ranges is None:
            return None
        try:
            return self.ranges.clearance_m(0.0)
        except Exception:
            log.exception("reading the range ahead failed: no forward move this step")
            return None

    def moved(self, action: Action, stopped_by: str) -> None:
        """An action ran: `stopped_by` is the safety stop that cut it short ("" when it ran to its end)."""
        if action.kind == "forward" and stopped_by == "obstacle":
            self.cut_short += 1
        elif action.kind != "forward" or not stopped_by:
            self.cut_short = 0
        self.unseen_deg = self.unseen_deg + action.amount if action.kind in TURNS else 0.0

    def reset(self) -> None:
        self.cut_short, self.unseen_deg = 0, 0.0
