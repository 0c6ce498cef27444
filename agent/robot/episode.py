"""The one episode loop: step until the policy says stop, MAX_MISSES unparseable answers in a row, or max_steps.

    run_episode(step, max_steps, before_step=, on_step=) -> (end, records)
    verdict(record, misses) -> (end or "", misses)        the end rule alone, one step at a time

Every runner steps through it: agent/app/episode.py `navigate` (the Navigator: the models, the link,
the robot), agent/robot/scripted.py `run_scripted` (the scripted policy on a fake clock) and
tools/robot/episode.py (the demo's and nav_eval's runs: a link cut, a printer, telemetry). A step is
anything that returns a record with the three fields of `Outcome`.

Every step counts toward max_steps, a refused one too (offline hold, a stale frame): an episode is
bounded in steps whatever the link does. The end: "done" (the policy's own stop, parsed exactly or
tolerantly; a stop the robot made itself, such as the offline envelope's turn-away halt, is not the
task done), "not_seen" (a camera's detector saw nothing the instruction names and the robot stopped
itself: agent/app/navigator.py), "unparseable" (MAX_MISSES misses in a row; a refused step neither counts
nor breaks the run) or "max_steps".
"""

from __future__ import annotations

from typing import Callable, Protocol, TypeVar

from .actions import STOP

MAX_MISSES = 3  # unparseable answers in a row that end an episode (as the daemon's tasks)


class Outcome(Protocol):
    """What the loop reads of one step's record (agent/app/navigator.py Step, agent/robot/scripted.py ScriptedStep)."""

    @property
    def action(self) -> str: ...  # str(Action): "stop", "turn left 15 deg", ...

    @property
    def parse(self) -> str: ...  # exact | tolerant | miss | refused (no plan made)

    @property
    def envelope(self) -> str: ...  # "" unless the robot changed the action itself (offline: clamped, turned_away_stop)


R = TypeVar("R", bound=Outcome)


def verdict(rec: Outcome, misses: int) -> tuple[str, int]:
    """(end, misses) after one step: end "done", "not_seen", "unparseable" or "" (go on); misses: unparseable
    answers in a row."""
    if rec.parse == "refused":
        return "", misses
    if rec.envelope == "not_seen":  # a camera that sees nothing the instruction names: stopped, not done
        return "not_seen", misses
    misses = misses + 1 if rec.parse == "miss" else 0
    if rec.action == str(STOP) and rec.parse in ("exact", "tolerant") and not rec.envelope:
        return "done", misses
    return ("unparseable" if misses >= MAX_MISSES else ""), misses


def run_episode(
    step: Callable[[int], R],
    max_steps: int,
    *,
    before_step: Callable[[int], None] | None = None,
    on_step: Callable[[int, R], None] | None = None,
) -> tuple[str, list[R]]:
    """Call step(n) for n = 1, 2, ... until the episode ends; returns (end, the records in order).

    before_step(n) runs before step n (a link cut goes here), on_step(n, record) after it (a printer, telemetry).
    """
    records: list[R] = []
    misses = 0
    for n in range(1, max_steps + 1):
        if before_step is not None:
            before_step(n)
        rec = step(n)
        records.append(rec)
        if on_step is not None:
            on_step(n, rec)
        end, misses = verdict(rec, misses)
        if end:
            return end, records
    return "max_steps", records
