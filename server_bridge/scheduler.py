"""Which waiting verifications go into the next batched pass (WISP Algorithm 1, and two baselines).

Pure and synchronous: the batcher (server_bridge/batcher.py) calls it in the
event loop whenever the target is free; tests call it with a clock of their own.

A request's deadline comes from its session's SLO class s (tokens/s), WISP's
per-iteration budget (Eq. 6): the round must commit its expected tokens at
s tokens a second, counted from when the robot got its previous result (so
the robot's drafting and the network's time are inside the budget, as Eq. 6
subtracts them):

    d_i = t_prev + g_i / s          g_i = alpha_i * k_i + 1

(alpha_i the session's running acceptance, k_i its draft length; t_prev the
session's last result, or its open for the first round, so the open and the
prefill count against the first round). A session without a class has no
deadline.

Policies:
  slo    WISP Algorithm 1: requests past their latest start time
         (LST_i = d_i - v_i - delta) first in earliest-deadline order, then the
         rest by utility density U_i = g_i / v_i (v_i: the estimated time of
         verifying i alone); the batch grows while every tentative batch fits
         the memory budget and finishes (now + T(B)) before every member's
         deadline, and stops at the first addition that does not. T(B) is the
         batch as the batcher runs it: one padded pass, or a few when a long
         prefill would pad everyone else (estimator.split_passes).
  fcfs   one request at a time in arrival order (SLED's FCFS verification).
  fixed  the oldest `max_batch` in arrival order, once `max_batch` wait or the
         oldest has waited `batch_wait_ms`.

When a batch is chosen (the dispatch epochs) is the scheduler's, not
Algorithm 1's. `slo` dispatches as soon as the target is free unless nothing
waiting is critical and a robot is due back within `batch_wait_ms` (one
answered lately, expected after its usual gap between answer and next request:
its drafting and its network); then it waits for that robot, so a closed loop
of robots shares passes instead of trickling in one by one. On a CPU a pass's
fixed cost (c, the weights read once) is ~130 ms and a row ~15 ms: one more
member beats one more pass. A critical request never waits.

One departure from Algorithm 1: a request that cannot meet its deadline even
alone (now + v_i > d_i) is late. Algorithm 1 would return an empty batch for
it, and the target would idle while it waits. Here it goes first among the
critical ones (its deadline is the earliest) and no longer bounds its batch:
bounding batches by deadlines already missed shrinks them exactly when the
target is behind, and on a CPU, where every row costs, that turns a backlog
into a collapse (tried: small batches, more late rounds, fewer served).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from protocol.wire import WireError

from .estimator import Member, VerifyTimeModel

POLICIES = ("slo", "fcfs", "fixed")


def deadline(slo: float, since: float, value: float) -> float:
    """When a round is due: since + value / slo; inf without a class (slo 0)."""
    return since + value / slo if slo > 0 else math.inf


@dataclass
class Request:
    """One verification waiting for the target."""

    sid: str
    member: Member  # (L_cached, L_new) it adds to a batch
    value: float  # g_i: expected committed tokens (>= 1 for any round)
    deadline: float  # monotonic seconds; inf for a session without an SLO class
    arrival: float  # monotonic seconds
    slo: float = 0.0  # the session's class in tokens/s; 0 = none (metrics label)
    job: Any = None  # what the model thread runs (a requests.Request: open, verify or ar)
    future: Any = None  # the batcher's asyncio future for the outcome
    late: bool = field(default=False, init=False)  # set when it could not meet its deadline even alone


def slo_batch(
    pending: Sequence[Request],
    now: float,
    model: VerifyTimeModel,
    guard_s: float,
    fits_memory: Callable[[list[Member]], bool],
    max_batch: int,
) -> list[Request]:
    """WISP Algorithm 1 at dispatch epoch `now`; returns the batch (a sub-list of pending)."""
    solo = {id(r): model.predict_ms([r.member]) / 1e3 for r in pending}  # v_i, seconds
    critical: list[Request] = []
    other: list[Request] = []
    for r in pending:
        r.late = now + solo[id(r)] > r.deadline
        (critical if now >= r.deadline - solo[id(r)] - guard_s else other).append(r)
    critical.sort(key=lambda r: (r.deadline, r.arrival))  # EDF
    other.sort(key=lambda r: (-r.value / max(solo[id(r)], 1e-9), r.arrival))  # density

    batch: list[Request] = []

    def feasible_add(r: Request) -> bool:
        trial = batch + [r]
        if len(trial) > max_batch or not fits_memory([m.member for m in trial]):
            return False
        bound = min((m.deadline for m in trial if not m.late), default=math.inf)
        return now + model.batch_ms([m.member for m in trial]) / 1e3 <= bound

    sids: set[str] = set()
    for queue in (critical, other):
        for r in queue:
            if r.sid in sids:  # one request per session and pass; the other waits its turn
                continue
            if not feasible_add(r):
                if not batch:  # not even alone (memory, or its own deadline): serve it alone
                    batch.append(r)
                return batch
            batch.append(r)
            sids.add(r.sid)
    return batch


@dataclass
class _Seen:
    """What the scheduler remembers of one robot between its requests."""

    heard: float  # when it last sent a request or got an answer (monotonic s)
    answered: float = math.nan  # its last answer; nan while a request of its is waiting or running
    gap: float = math.nan  # EWMA of answer -> next request (its drafting and network), seconds


class Scheduler:
    """The bounded queue of waiting requests and the policy that empties it."""

    def __init__(
        self,
        policy: str,
        model: VerifyTimeModel,
        *,
        max_queue: int,
        max_batch: int,
        guard_ms: float,
        memory_budget_bytes: int,
        memory_of: Callable[[list[Member]], int],
        batch_wait_ms: float,
        max_wait_ms: float,
    ):
        if policy not in POLICIES:
            raise ValueError(f"scheduler must be one of {', '.join(POLICIES)}, got {policy!r}")
        self.policy = policy
        self.model = model
        self.max_queue = max_queue
        self.max_batch = 1 if policy == "fcfs" else max_batch
        self.guard_s = guard_ms / 1e3
        self.memory_budget = memory_budget_bytes
        self.memory_of = memory_of
        self.batch_wait_s = batch_wait_ms / 1e3
        self.max_wait_s = max_wait_ms / 1e3
        self.pending: list[Request] = []  # arrival order
        self._seen: dict[str, _Seen] = {}  # sid -> its robot's rhythm; bounded, see _forget
        self._running: set[str] = set()  # sids of the last batch handed out (in the pass now running)
        self._free_since = 0.0  # when the target last finished a batch

    def __len__(self) -> int:
        return len(self.pending)

    def admit(self, r: Request) -> None:
        """Queue r, or refuse it with `overloaded` when the queue is full (the robot falls back)."""
        if len(self.pending) >= self.max_queue:
            raise WireError(
                "overloaded",
                f"the verifier is overloaded ({len(self.pending)} requests waiting): draft locally and retry later",
                r.sid,
            )
        self.pending.append(r)
        seen = self._seen.get(r.sid)
        if seen is not None:
            if math.isfinite(seen.answered):  # the robot's gap: drafting and network
                gap = r.arrival - seen.answered
                seen.gap = gap if math.isnan(seen.gap) else 0.7 * seen.gap + 0.3 * gap
            seen.answered, seen.heard = math.nan, r.arrival

    def answered(self, sid: str, at: float) -> None:
        """The batcher answered sid's request at `at`: its robot should be back after its usual gap."""
        seen = self._seen.setdefault(sid, _Seen(at))
        seen.answered = seen.heard = at
        self._free_since = at
        if len(self._seen) > 4 * self.max_queue + 64:
            self._forget()

    def _forget(self) -> None:
        """Bounded: drop a quarter of the table, the robots silent longest (last heard from first).

        A robot whose request waits or is in the running pass is the busiest, not the most silent: it
        stays, or its answer would start its gap afresh. One whose request was shed, or whose pass
        failed, was last heard when that request came."""
        busy = {r.sid for r in self.pending} | self._running
        idle = sorted((s for s in self._seen if s not in busy), key=lambda s: self._seen[s].heard)
        for sid in idle[: len(self._seen) // 4]:
            del self._seen[sid]

    def _due(self, now: float) -> list[float]:
        """When robots answered lately are expected back, within batch_wait from now (overdue ones: no)."""
        pending = {r.sid for r in self.pending}
        return [
            t
            for sid, seen in self._seen.items()
            if sid not in pending
            and math.isfinite(seen.answered)
            and math.isfinite(seen.gap)
            and now <= (t := seen.answered + seen.gap) <= now + self.batch_wait_s
        ]

    def _critical_at(self) -> float:
        """The earliest latest start time among the waiting requests (monotonic seconds)."""
        return min(r.deadline - self.model.predict_ms([r.member]) / 1e3 - self.guard_s for r in self.pending)

    def ready(self, now: float) -> bool:
        """Whether a batch should go now (fixed waits for a full batch or its oldest's timeout)."""
        if not self.pending:
            return False
        if self.policy == "fixed":
            return len(self.pending) >= self.max_batch or now - self.pending[0].arrival >= self.batch_wait_s
        if self.policy == "fcfs" or len(self.pending) >= self.max_batch or now >= self._critical_at():
            return True
        return now - self._free_since >= self.batch_wait_s or not self._due(now)

    def wake_at(self) -> float | None:
        """When ready() or expired() may change without a new arrival (monotonic seconds)."""
        if not self.pending:
            return None
        oldest = self.pending[0].arrival
        t = oldest + self.max_wait_s
        if self.policy == "fixed":
            return min(t, oldest + self.batch_wait_s)
        if self.policy == "slo":
            return min(t, self._critical_at(), self._free_since + self.batch_wait_s)
        return t

    def expired(self, now: float) -> list[Request]:
        """Remove and return the requests that waited longer than max_wait (to be shed)."""
        gone = [r for r in self.pending if now - r.arrival > self.max_wait_s]
        if gone:
            self.pending = [r for r in self.pending if now - r.arrival <= self.max_wait_s]
        return gone

    def fits_memory(self, members: list[Member]) -> bool:
        return self.memory_of(members) <= self.memory_budget

    def next_batch(self, now: float) -> list[Request]:
        """Remove and return the next batch by the policy (empty only when nothing waits)."""
        if not self.pending:
            return []
        if self.policy == "slo":
            batch = slo_batch(self.pending, now, self.model, self.guard_s, self.fits_memory, self.max_batch)
        else:  # fcfs (max_batch 1) and fixed: arrival order
            batch = [self.pending[0]]
            for r in self.pending[1:]:
                if len(batch) == self.max_batch or not self.fits_memory([m.member for m in batch + [r]]):
                    break
                if r.sid not in {m.sid for m in batch}:
                    batch.append(r)
        chosen = {id(r) for r in batch}
        self.pending = [r for r in self.pending if id(r) not in chosen]
        self._running = {r.sid for r in batch}  # the batcher runs one batch at a time: the last one is gone
        return batch
