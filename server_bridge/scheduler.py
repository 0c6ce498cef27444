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
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from itertools import chain
from typing import Any

import numpy as np

from protocol.wire import WireError

from .estimator import Member, Passes, VerifyTimeModel, passes_ms

POLICIES = ("slo", "fcfs", "fixed")
MIN_PASSES_IN_BOUND = 4  # a batch's time bound (max_batch_ms) is at least this many passes' fixed cost
RETRY_AFTER_S = (1.0, 10.0)  # the bounds of a refused robot's retry_after (Scheduler.retry_after_ms)


def deadline(slo: float, since: float, value: float) -> float:
    """When a round is due: since + value / slo; inf without a class (slo 0)."""
    return since + value / slo if slo > 0 else math.inf


@dataclass(slots=True)  # slots: the scheduler reads every waiting request's fields at every dispatch
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
    passed_over: bool = field(default=False, init=False)  # a batch was chosen without it (it may be shed now)
    slot: int = field(default=-1, init=False)  # its row in the scheduler's Columns while it waits (-1: none)


class Columns:
    """The waiting requests' numbers by slot, each written once as its request is queued (Scheduler.admit) and
    read by every decision: read from the requests' attributes at every decision, they were a quarter of a
    decision at 1,024 waiting (tools/bench/sched_decision.py). Bounded: `capacity` slots (the queue's)."""

    def __init__(self, capacity: int):
        self.shapes = np.zeros((capacity, 2), np.int64)  # (L_cached, L_new)
        self.numbers = np.zeros((3, capacity), np.float64)  # deadline, value, arrival
        self._free = list(range(capacity - 1, -1, -1))

    def put(self, r: Request) -> None:
        r.slot = slot = self._free.pop()
        self.shapes[slot] = r.member
        self.numbers[:, slot] = (r.deadline, r.value, r.arrival)

    def drop(self, gone: Iterable[Request]) -> None:
        for r in gone:
            self._free.append(r.slot)
            r.slot = -1

    def of(self, pending: Sequence[Request]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """pending's (L_cached, L_new) [n, 2], deadlines, values and arrivals [n], in pending's order."""
        slots = np.fromiter([r.slot for r in pending], np.intp, len(pending))
        deadlines, values, arrivals = self.numbers[:, slots]
        return self.shapes[slots], deadlines, values, arrivals


def _attributes(pending: Sequence[Request]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Columns.of, read from the requests themselves (a caller without a scheduler: tests, benchmarks)."""
    n = len(pending)
    shapes = np.fromiter(chain.from_iterable([r.member for r in pending]), np.int64, 2 * n).reshape(n, 2)
    return (
        shapes,
        np.fromiter([r.deadline for r in pending], np.float64, n),
        np.fromiter([r.value for r in pending], np.float64, n),
        np.fromiter([r.arrival for r in pending], np.float64, n),
    )


def slo_batch(
    pending: Sequence[Request],
    now: float,
    model: VerifyTimeModel,
    guard_s: float,
    fits_memory: Callable[[list[Member]], bool],
    max_batch: int,
    max_batch_s: float = math.inf,
    columns: Columns | None = None,
) -> list[Request]:
    """WISP Algorithm 1 at dispatch epoch `now`; returns the batch (a sub-list of pending). columns: the
    scheduler's, which hold every pending request (None: read from the requests).

    Every batch also ends within max_batch_s (its estimate), or MIN_PASSES_IN_BOUND passes' fixed cost where
    that is longer, late requests' included, which bound nothing else: a round waits for its whole pass, and
    an overloaded fleet, mostly late, would otherwise make one pass of everyone (one request alone may take
    longer). The floor keeps batching where one pass costs more than max_batch_s on its own (the shipped
    f32 target on 2 cores: 114 ms fixed; bounded at 100 ms, every pass held one request).

    The batch grows in the queue's order and stops at the first addition that does not fit. Every test
    a tentative batch must pass is monotone: the count; the memory (fits_memory must be, as
    batch_memory_bytes is: a batch that fits still fits without its last member); now + T(B) against the
    earliest deadline (T never shrinks as B grows, the earliest deadline never grows). So the batch is
    the longest prefix of the queue that fits, which bounds find while pricing at most a few prefixes
    exactly (_longest_fit), and memory in a few looks (_fits_memory): O(n log n) in the waiting requests,
    where trying every addition with a fresh split took O(n^4) (tools/bench/sched_decision.py times both).
    """
    if not pending:
        return []
    order, shapes, deadlines = _queue(pending, now, model, guard_s, max_batch, columns)
    deadlines = np.minimum(deadlines, now + max(max_batch_s, MIN_PASSES_IN_BOUND * model.scale * model.c / 1e3))
    queue = [pending[k] for k in order.tolist()]
    fit = _longest_fit(queue, shapes, deadlines, now, model, fits_memory)
    return queue[: max(fit, 1)]  # not even the first fits (memory, or its own deadline): serve it alone


def _queue(
    pending: Sequence[Request],
    now: float,
    model: VerifyTimeModel,
    guard_s: float,
    max_batch: int,
    columns: Columns | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The order Algorithm 1 tries pending in, one request per session, at most max_batch [k]; sets each
    one's `late`. Also theirs, in that order: (L_cached, L_new) [k, 2] and deadline, inf for a late one [k].

    Requests past their latest start time first, earliest deadline first; then the rest by utility
    density, most expected tokens per second of verifying alone first; ties by arrival, then pending's order."""
    shapes, deadlines, values, arrivals = _attributes(pending) if columns is None else columns.of(pending)
    cached, new = shapes[:, 0], shapes[:, 1]
    solo = (  # v_i, seconds: model.member_ms to the last bit
        model.scale * np.maximum(0.0, model.a * new + model.b_c * ((cached + new) * new) + model.b_r * cached + model.c)
    ) / 1e3
    late = now + solo > deadlines
    for r, is_late in zip(pending, late.tolist(), strict=True):
        r.late = is_late
    critical = now >= deadlines - solo - guard_s
    density = -values / np.maximum(solo, 1e-9)
    order = np.lexsort((arrivals, np.where(critical, deadlines, density), ~critical))  # stable
    sids = [r.sid for r in pending]
    if len(set(sids)) < len(sids):  # one request per session and pass; the other waits its turn
        first: dict[str, int] = {}
        for k in order.tolist():
            first.setdefault(sids[k], k)
        order = np.fromiter(first.values(), np.intp, len(first))  # in the order first seen
    order = order[: max(max_batch, 1)]
    return order, shapes[order], np.where(late, math.inf, deadlines)[order]


def _longest_fit(
    queue: list[Request],
    shapes: np.ndarray,
    deadlines: np.ndarray,
    now: float,
    model: VerifyTimeModel,
    fits_memory: Callable[[list[Member]], bool],
) -> int:
    """How many of the queue's first requests fit memory and finish, now + batch_ms, before every deadline
    among them.

    shapes [k, 2] their (L_cached, L_new), deadlines [k] theirs (inf: none, or late: it bounds nothing).
    T(first k) lies between bounds kept as running sums and maxima: above, one padded pass (what T is
    when one pass is cheapest); below, the lesser of one pass and two passes' fixed cost plus every row
    unpadded (two or more passes cost at least that). Where the upper bound fits the prefix fits, where
    the lower one does not it does not. In between, estimator.Passes: the next prefix's best split into
    one pass or two (O(k) in numpy, an upper bound), or if that does not fit while a lower bound still
    might, its exact split (split_passes); then members join that split one by one, its cost staying an
    upper bound and its floor plus every row joined since, unpadded, a lower one (a member never adds
    less than its own row); where neither decides, the exact split again. So a few exact prices at most.
    """
    if model.packed:
        return _longest_packed(queue, shapes, deadlines, now, model, fits_memory)
    cached, new = shapes[:, 0], shapes[:, 1]
    rows = np.arange(1, len(shapes) + 1)
    one_pass = passes_ms(model, rows, np.maximum.accumulate(cached), np.maximum.accumulate(new))  # [k]
    rows_ms = model.scale * np.cumsum(model.a * new + model.b_c * ((cached + new) * new) + model.b_r * cached)
    lower = np.minimum(one_pass, rows_ms + 2 * model.scale * model.c) * (1 - 1e-9)  # a hair: rounding
    bound = np.minimum.accumulate(deadlines)  # [k] the earliest deadline among the first k

    def leading(ms: np.ndarray) -> int:
        """How many first prefixes fit if T were ms."""
        fit = now + ms / 1e3 <= bound
        return len(fit) if fit[-1] else int(np.argmin(fit))

    def fits(ms: float, k: int) -> bool:
        return now + ms / 1e3 <= bound[k - 1]

    possible = _fits_memory(queue, leading(lower), fits_memory)  # no search past what memory holds
    k = min(leading(one_pass), possible)
    passes: Passes | None = None
    while k < possible:
        if passes is None:  # one pass or two: O(k) in numpy
            passes = Passes.cheap(shapes[: k + 1], model)
        elif fits(passes.add(queue[k].member), k + 1):  # a split of the first k: the next one joins it
            k += 1
            continue
        if not fits(passes.floor, k + 1):
            break
        if not fits(passes.ms, k + 1):
            passes = Passes.best(shapes[: k + 1], model)  # exact: batch_ms to the last bit
            if not fits(passes.ms, k + 1):
                break
        k += 1
    return k


def _longest_packed(
    queue: list[Request],
    shapes: np.ndarray,
    deadlines: np.ndarray,
    now: float,
    model: VerifyTimeModel,
    fits_memory: Callable[[list[Member]], bool],
) -> int:
    """_longest_fit for a packed engine: a batch is one unpadded pass, so T of every prefix is a running sum
    (predict_ms to the last bit: the same integer sums, the same float operations in the same order)."""
    cached, new = shapes[:, 0], shapes[:, 1]
    n_linear, n_interactions, n_cached = np.cumsum(new), np.cumsum((cached + new) * new), np.cumsum(cached)
    ms = model.scale * np.maximum(0.0, model.a * n_linear + model.b_c * n_interactions + model.b_r * n_cached + model.c)
    fit = now + ms / 1e3 <= np.minimum.accumulate(deadlines)
    k = len(fit) if fit[-1] else int(np.argmin(fit))
    return _fits_memory(queue, k, fits_memory)


def _fits_memory(queue: list[Request], most: int, fits_memory: Callable[[list[Member]], bool]) -> int:
    """The longest prefix of at most `most` that fits memory: one look at `most` when it fits (mostly), else
    doubling from one and then bisection, so a batch that memory holds to a few costs only a few looks."""
    if most == 0 or fits_memory([r.member for r in queue[:most]]):
        return most
    lo, hi = 0, 1  # the first lo fit; hi is the next to look at
    while hi < most and fits_memory([r.member for r in queue[:hi]]):
        lo, hi = hi, 2 * hi
    hi = min(hi, most) - 1  # the first hi + 1 do not fit
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits_memory([r.member for r in queue[:mid]]) else (lo, mid - 1)
    return lo


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
        max_batch_ms: float = math.inf,
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
        self.max_batch_s = max_batch_ms / 1e3
        self.pending: list[Request] = []  # arrival order
        self.columns = Columns(max_queue)  # theirs: each decision reads them
        self._seen: dict[str, _Seen] = {}  # sid -> its robot's rhythm; bounded, see _forget
        self._running: set[str] = set()  # sids of the batches handed out and not yet finished
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
        self.columns.put(r)
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
        model = self.model
        shapes, deadlines, _, _ = self.columns.of(self.pending)
        cached, new = shapes[:, 0], shapes[:, 1]
        solo = model.scale * np.maximum(  # model.member_ms, as _queue takes it
            0.0, model.a * new + model.b_c * ((cached + new) * new) + model.b_r * cached + model.c
        )
        return float(np.min(deadlines - solo / 1e3 - self.guard_s))

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
        passed = [r.arrival for r in self.pending if r.passed_over]  # only those can expire
        t = min(passed) + self.max_wait_s if passed else math.inf
        if self.policy == "fixed":
            return min(t, oldest + self.batch_wait_s)
        if self.policy == "slo":
            return min(t, self._critical_at(), self._free_since + self.batch_wait_s)
        return t if math.isfinite(t) else None  # fcfs: ready whenever a request waits

    def saturated(self, now: float) -> str | None:
        """Why a new robot should wait (its open refused with `overloaded`), or None: the oldest waiting request
        has waited half of max_wait. The robots already served then finish before others start, instead of
        every robot's rounds waiting past max_wait and being shed."""
        if self.pending and (waited := now - self.pending[0].arrival) >= self.max_wait_s / 2:
            return f"the verifier is saturated (its oldest waiting request has waited {1e3 * waited:.0f} ms)"
        return None

    def retry_after_ms(self, now: float) -> int:
        """A refused robot's hint (Error.retry_after_ms): twice as long as the oldest request has waited, 1 to 10 s
        (3 s and more when `saturated`): by then the queue that made the server refuse has been served twice
        over. A fleet's retries then come as fast as it drains, not at each robot's first backoff (0.2 s
        doubling): at 512 robots where the target serves ~200, the robots' retries at their own backoff were
        ~160 refusals a second (docs/benchmarks/fleet_cpu/)."""
        waited = now - self.pending[0].arrival if self.pending else 0.0
        return round(1e3 * min(RETRY_AFTER_S[1], max(RETRY_AFTER_S[0], 2 * waited)))

    def expired(self, now: float) -> list[Request]:
        """Remove and return the requests to be shed: those that waited longer than max_wait and that a batch
        was chosen without (now = inf: every one, the server stopping).

        A request that waited only for the pass running when it came is not shed, however long that pass
        took: the next batch takes it. Shedding it would not shorten anyone's wait, and its robot would come
        back with a re-open to queue again. On this project's 2-core machine, 8 robots starting at once took
        the cores from the server's passes (a 5-token verify took 17 s, 37 ms alone) and every request that
        came during one was shed as it ended, their retries too (docs/benchmarks/burst/)."""
        gone = [r for r in self.pending if now - r.arrival > self.max_wait_s and (r.passed_over or now == math.inf)]
        if gone:
            shed = {id(r) for r in gone}
            self.pending = [r for r in self.pending if id(r) not in shed]
            self.columns.drop(gone)
        return gone

    def finished(self, batch: list[Request]) -> None:
        """A batch next_batch handed out is done (answered, failed or dropped): its sessions are not running."""
        self._running.difference_update(r.sid for r in batch)

    def fits_memory(self, members: list[Member]) -> bool:
        return self.memory_of(members) <= self.memory_budget

    def next_batch(self, now: float) -> list[Request]:
        """Remove and return the next batch by the policy (empty only when nothing waits)."""
        if not self.pending:
            return []
        if self.policy == "slo":
            batch = slo_batch(
                self.pending,
                now,
                self.model,
                self.guard_s,
                self.fits_memory,
                self.max_batch,
                self.max_batch_s,
                self.columns,
            )
        else:  # fcfs (max_batch 1) and fixed: arrival order
            batch = [self.pending[0]]
            for r in self.pending[1:]:
                if len(batch) == self.max_batch or not self.fits_memory([m.member for m in batch + [r]]):
                    break
                if r.sid not in {m.sid for m in batch}:
                    batch.append(r)
        chosen = {id(r) for r in batch}
        self.pending = [r for r in self.pending if id(r) not in chosen]
        self.columns.drop(batch)
        for r in self.pending:
            r.passed_over = True
        self._running |= {r.sid for r in batch}  # until the batcher says it is finished
        return batch
