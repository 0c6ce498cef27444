"""Overlapped stepping (`agent.overlap`, the default): the robot decides step k + 1 while motion k runs.

    sequential   look k, think k, move k | look k+1, think k+1, move k+1 | ...   (the robot stands while it thinks)
    overlapped   look k, think k, move k ......................| move k+1 .............| move k+2
                                  look k+1, think k+1 (during k) | look k+2, think k+2 |

One `Overlapped.step` call acts on the plan decided during the previous call's motion (or, when there is none,
decides first, standing), starts its motion, looks and decides the next step while it runs, waits for the motion
to end and returns its record, as `Navigator.step` does. The look for step k + 1 happens as motion k starts, and
with `agent.overlap_look = "end"` what it sees is moved to the pose motion k will reach (agent/app/lookahead.py);
the prompt's memory says that action k is under way.

Today's rules keep their meaning: the plan is acted on only if it is fresh (its frame at most
`agent.max_plan_age_s` old when motion k ends: a plan that went stale during the motion is refused, the robot
halts, and the next step decides again from a new frame); a plan made during a motion that was cut short (the
obstacle stop, an e-stop, a cancel, the link lost) is refused too, since the pose it was made for was never
reached; a stop, an unparseable answer, the offline envelope and the watchdog are the navigator's as before.

Each record says what overlapped: `decided_during` (the step whose motion its decision ran in),
latency_ms["think_moving"] (the part of its generation that ran while the robot moved) and
latency_ms["standing"] (how long the robot stood between the previous motion's end and this one's start).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from agent.robot.actions import STOP, parse_action
from agent.robot.camera import Frame

from .navigator import Navigator, Plan, Step


@dataclass
class Ahead:
    """The next step's decision, made during a motion."""

    plan: Plan | Step  # the Plan, or the finished Step when nothing was decided (holding, no frame)
    key: tuple[str, str]  # (task, instruction) it was made for
    after: Step  # the step during whose motion it was made
    thought: tuple[float, float]  # when its look began and its decision was made (the navigator's clock)
    motion_end: float = 0.0  # when that motion ended


class Overlapped:
    """`Navigator.step` with the next decision made while the current motion runs (see the module's doc)."""

    def __init__(self, nav: Navigator) -> None:
        self.nav = nav
        self._ahead: Ahead | None = None
        self.refused_stale = 0  # plans decided during a motion, stale when it ended
        self.refused_cut = 0  # plans decided during a motion that was cut short

    def step(
        self,
        instruction: str,
        task: str = "",
        cancel: threading.Event | None = None,
        frame: Frame | None = None,
        last: bool = False,
    ) -> Step:
        """One step (see the module's doc). `last`: no next step follows (the task's max_steps): none is decided."""
        nav, key = self.nav, (task, instruction.strip())
        ahead, self._ahead = self._ahead, None
        if ahead is not None and (ahead.key != key or frame is not None):
            ahead = None  # another task (or an image from the API to look at): decided afresh
        plan = nav.plan(instruction, task, cancel, frame) if ahead is None else ahead.plan
        if isinstance(plan, Step):
            return plan
        if ahead is not None:
            if not ahead.after.completed:
                return self._refuse_cut(plan, ahead)
            plan.rec.latency_ms["standing"] = round(max(0.0, nav.clock() - ahead.motion_end) * 1e3, 1)
        moving = nav.act(plan, cancel, wait=False)  # a stale plan is refused there, as in a sequential step
        if isinstance(moving, Step):
            if ahead is not None and moving.parse == "refused":
                self.refused_stale += 1
            return moving
        if not last and not (cancel is not None and cancel.is_set()):
            t = nav.clock()
            nxt = nav.plan(instruction, task, cancel, None, during=moving)
            self._ahead = Ahead(nxt, key, moving.rec, (t, nav.clock()))
        rec = nav.settle(moving, cancel)
        if self._ahead is not None:
            self._ahead.motion_end = end = getattr(nav.control, "ended_at", None) or nav.clock()
            nxt_rec = self._ahead.plan.rec if isinstance(self._ahead.plan, Plan) else self._ahead.plan
            t_look, t_decided = self._ahead.thought
            nxt_rec.decided_during = rec.step
            nxt_rec.latency_ms["think_moving"] = round(max(0.0, min(t_decided, end) - t_look) * 1e3, 1)
        return rec

    def drop(self) -> None:
        """Forget the decision made ahead (the task ended)."""
        self._ahead = None

    def _refuse_cut(self, plan: Plan, ahead: Ahead) -> Step:
        """A plan made for where a motion would end, which was cut short: refused, the robot halts."""
        rec, self.refused_cut = plan.rec, self.refused_cut + 1
        parsed = parse_action(rec.text)
        self.nav.control.halt("replan")
        rec.parse_note = f"{parsed.action} ({parsed.how}) not acted on"
        rec.action, rec.action_text, rec.parse = str(STOP), STOP.text, "refused"
        why = f"decided for where step {ahead.after.step} would end, but its motion was cut short: not acted on"
        return self.nav.finish(rec, plan.t0, reason=why)


def mark_decision(world: object, rec: Step) -> None:
    """Put where the step looked and decided on the simulator's map (a ring when it decided while moving)."""
    mark = getattr(world, "mark_decision", None)
    if mark is not None and len(rec.decided_at) >= 2:
        mark(rec.decided_at[0], rec.decided_at[1], bool(rec.decided_during))
