"""Step memory: the task's last steps as prompt lines, bounded in steps and in draft tokens, per task.

The prompt carries the task's last steps (`nav.memory_steps`, at most `nav.memory_max_tokens`
draft tokens; the oldest go first): what the camera showed, what the robot did, whether the
target verified it; observations and actions only, never advice. It is per task (a new task or
instruction empties it). Its lines sit between the task and the camera line of the prompt
(agent/app/prompt.py), oldest first, so a new step only appends a line.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Callable

from agent.robot.actions import Action

from .prompt import did_text, memory_line


@dataclass(frozen=True)
class Recall:
    """One remembered step: what the camera showed, what the robot did, whether the target verified it."""

    observation: str
    action: Action
    verified: bool
    completed: bool = True  # the motion ran to its end (False: cut short by a halt)
    under_way: bool = False  # the motion runs while the next step is decided (agent.overlap)

    def line(self) -> str:
        """The step as the prompt shows it, marked when unverified, cut short or still under way."""
        marks = [
            m
            for m, on in (
                ("unverified", not self.verified),
                ("under way", self.under_way),
                ("cut short", not self.completed and not self.under_way),
            )
            if on
        ]
        return memory_line(self.observation, did_text(self.action) + (f" ({', '.join(marks)})" if marks else ""))


class StepMemory:
    """The last steps of one task, as prompt lines; bounded in steps and in tokens, oldest dropped first
    (down to half a bound at once, see `add`).

    It holds observations and actions only (never advice): the decision stays the model's.
    Per task: `start(key)` with another task's key empties it. `count_tokens(text)` is the
    draft's tokenizer, so the token bound holds for what the model reads.
    """

    def __init__(self, max_steps: int, max_tokens: int, count_tokens: Callable[[str], int]) -> None:
        self.max_steps, self.max_tokens, self.count_tokens = max_steps, max_tokens, count_tokens
        self._steps: deque[Recall] = deque()
        self.key: object = None
        self.tokens = 0  # the tokens of the memory's lines now
        self.dropped = 0  # steps dropped (over a bound) since the task started

    def start(self, key: object) -> bool:
        """Make `key` the current task; a different one clears the memory. True when it was cleared."""
        if key == self.key:
            return False
        self.key, self.dropped, self.tokens = key, 0, 0
        self._steps.clear()
        return True

    def add(self, recall: Recall) -> None:
        """Append a step. Over a bound, the oldest go down to half of it in one cut: the prompts of the
        steps that follow only append a line (their prefix stays cached on both sides), where dropping
        one line a step would change everything after the task line, every step."""
        if self.max_steps == 0:
            return
        self._steps.append(recall)
        if len(self._steps) > self.max_steps:
            self._trim(lambda: len(self._steps) > max(1, self.max_steps // 2))
        self.tokens = self._count()
        if self.tokens > self.max_tokens:
            self._trim(lambda: self.tokens > self.max_tokens // 2)

    def settle(self, recall: Recall) -> None:
        """A step that acted: it replaces the same step's "under way" line (an overlapped step), else is added."""
        if self._steps and self._steps[-1].under_way:
            self._steps.pop()
        self.add(recall)

    def _trim(self, over: Callable[[], bool]) -> None:
        while self._steps and over():
            self._steps.popleft()
            self.dropped += 1
            self.tokens = self._count()

    def lines(self) -> list[str]:
        """The remembered steps as prompt lines, oldest first."""
        return [r.line() for r in self._steps]

    def __len__(self) -> int:
        return len(self._steps)

    def _count(self) -> int:
        return self.count_tokens("\n".join(self.lines())) if self._steps else 0


def check_memory(steps: int, max_tokens: int) -> None:
    """ValueError unless nav.memory_steps and nav.memory_max_tokens are within their bounds."""
    if not isinstance(steps, int) or not 0 <= steps <= 32:
        raise ValueError(f"nav.memory_steps must be 0..32 (0: no memory), got {steps!r}")
    if not isinstance(max_tokens, int) or not 32 <= max_tokens <= 2048:
        raise ValueError(
            f"nav.memory_max_tokens must be 32..2048 (one remembered step is ~25 tokens), got {max_tokens!r}"
        )
