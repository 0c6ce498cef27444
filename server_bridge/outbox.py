"""A bounded per-connection outbox for early-exit messages, drained by one sender task (FSD).

Exit verdicts are hints that lose their value as soon as the round's `result`
is out. When a robot's link is slower than the verifier produces them they
pile up here, never beyond `maxsize`: the least valuable one is dropped and
counted. Policies (order of sending / what a full outbox drops):

  priority  highest confidence first / the lowest confidence (the oldest of equals)
  fifo      oldest first             / the oldest
  random    any                      / any (the newcomer included)

Event-loop only, not thread-safe: the model thread reaches it through
`loop.call_soon_threadsafe`. Items need `sid`, `round` and `confidence`
attributes (wire.Exit).
"""

from __future__ import annotations

import asyncio
import random
from typing import Any

POLICIES = ("priority", "fifo", "random")


class Outbox:
    def __init__(self, maxsize: int, policy: str = "priority", rng: random.Random | None = None):
        if maxsize < 1:
            raise ValueError(f"outbox maxsize must be >= 1, got {maxsize}")
        if policy not in POLICIES:
            raise ValueError(f"outbox policy must be one of {POLICIES}, got {policy!r}")
        self.maxsize = maxsize
        self.policy = policy
        self.rng = rng or random.Random()
        self.dropped = 0  # items dropped because the outbox was full
        self.purged = 0  # items removed by `purge` (their round was answered)
        self.closed = False
        self._items: list[tuple[int, Any]] = []  # (arrival number, item), in arrival order
        self._seq = 0
        self._ready = asyncio.Event()

    def __len__(self) -> int:
        return len(self._items)

    def put(self, item: Any) -> int:
        """Queue an item; returns how many items were dropped to keep the bound (0 or 1).

        On a closed outbox (the connection is gone) the item is discarded silently.
        """
        if self.closed:
            return 0
        entry = (self._seq, item)
        self._seq += 1
        if len(self._items) < self.maxsize:
            self._items.append(entry)
            self._ready.set()
            return 0
        self.dropped += 1
        victim = self._victim(self._items + [entry])
        if victim is not entry:
            self._items.remove(victim)
            self._items.append(entry)
        return 1

    async def get(self) -> Any:
        """The next item by the policy; waits while the outbox is empty."""
        while not self._items:
            self._ready.clear()
            await self._ready.wait()
        if self.policy == "priority":
            entry = max(self._items, key=lambda e: (e[1].confidence, -e[0]))
        elif self.policy == "fifo":
            entry = self._items[0]
        else:
            entry = self.rng.choice(self._items)
        self._items.remove(entry)
        return entry[1]

    def purge(self, sid: str, round: int | None = None) -> int:
        """Remove the pending items of (sid, round), or of every round of sid; returns how many."""
        keep = [e for e in self._items if not (e[1].sid == sid and (round is None or e[1].round == round))]
        n = len(self._items) - len(keep)
        self._items = keep
        self.purged += n
        return n

    def close(self) -> None:
        """The connection ended: drop what is pending and accept nothing more."""
        self.closed = True
        self._items.clear()

    def _victim(self, entries: list[tuple[int, Any]]) -> tuple[int, Any]:
        if self.policy == "priority":
            return min(entries, key=lambda e: (e[1].confidence, e[0]))
        if self.policy == "fifo":
            return entries[0]
        return self.rng.choice(entries)
