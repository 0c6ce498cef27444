"""The loop that keeps the target busy: requests in, batches through the model thread, results out.

Every model job of the server (an open's prefill, a verify round, one ar
token) is submitted here with its estimated shape, value and deadline. The
loop asks the scheduler for a batch the moment the target is free, runs it in
the one model thread and resolves each request's future.

A chosen batch runs as one pass. On an engine that pads a pass to a
rectangle (torch) it may run as a few, when a long prefill would pad every
draft to its length (estimator.split_passes): shortest runs first, each
pass's results out as soon as it returns. An engine that packs its tokens
(llama.cpp) pads nothing, so there a batch is always one pass: each pass
costs the server's own work around it, whatever its size.

Pipelined (the pipelined-serving paper's point, on one verifier): while a
batch runs in the model thread, the event loop goes on receiving and
decoding the next rounds, queueing them, and sending the previous batch's
results. With `pipeline` (on a GPU by default: the pass runs on the device
while the loop works; on one CPU core they take turns, and choosing early
would only shrink the batches: docs/benchmarks/fleet_cpu/), up to
PIPELINE_DEPTH batches are in flight: the next one is chosen
PIPELINE_LEAD_MS before the running one is estimated to end (scheduled for
that end: its deadlines are priced from there), so it is in the model
thread's queue when the pass returns and the target never waits on the
event loop while requests wait (except under the `fixed` baseline, which
waits for a full batch by design). Chosen that late, it still takes the
rounds that came during the pass; chosen at once, it would not.

Bounded: the scheduler's queue holds at most `max_queue` requests; a
newcomer beyond it, or a request that waited past `max_wait_ms` and that a
batch was already chosen without (Scheduler.expired), is shed with
`overloaded`: the robot backs off and re-opens, or its fallback policy takes
over. A new robot's open is refused the same way while the oldest waiting
request has waited half of `max_wait_ms` (Scheduler.saturated), and while
every session is in a request or was answered within `protect_active_s`.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from concurrent.futures import Executor
from typing import Any

from protocol.wire import WireError

from .estimator import split_passes
from .metrics import ServerMetrics
from .requests import Request as ModelRequest
from .scheduler import Request, Scheduler
from .verifier import Verifier

log = logging.getLogger(__name__)

PIPELINE_DEPTH = 2  # batches in flight: the one running and the next, queued behind it in the model thread
PIPELINE_LEAD_MS = 5.0  # the next batch is chosen this long before the running one's estimated end


class Batcher:
    def __init__(
        self, verifier: Verifier, scheduler: Scheduler, executor: Executor, metrics: ServerMetrics, pipeline: bool
    ):
        self.verifier = verifier
        self.depth = PIPELINE_DEPTH if pipeline else 1  # batches in flight at most
        self.scheduler = scheduler
        self.executor = executor
        self.metrics = metrics
        self._wake = asyncio.Event()  # a request came, or a batch was answered
        self._answered = asyncio.Event()  # a batch was answered
        self._task: asyncio.Task | None = None
        self._inflight: set[asyncio.Task] = set()  # the batches handed to the model thread, not yet answered
        self._ends_at = 0.0  # when the last of them should end (monotonic s, the estimator's)

    def start(self) -> None:
        self._task = asyncio.create_task(self._run_forever(), name="batcher")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        for task in list(self._inflight):
            task.cancel()
        await asyncio.gather(*self._inflight, return_exceptions=True)
        for r in self.scheduler.expired(math.inf):
            _fail(r, WireError("shutting_down", "the verifier is shutting down; retry elsewhere", r.sid))

    async def submit(
        self, job: ModelRequest, member: tuple[int, int], value: float, deadline: float, slo: float = 0.0
    ) -> Any:
        """Queue one request for the model thread and wait for its outcome; raises its WireError (or
        `overloaded`)."""
        future = asyncio.get_running_loop().create_future()
        request = Request(job.sid, member, value, deadline, time.monotonic(), slo, job, future)
        try:
            self.scheduler.admit(request)
        except WireError:
            self.metrics.count_shed(slo)
            raise
        self._wake.set()
        return await future

    async def _run_forever(self) -> None:
        while True:
            try:
                await self._step()
            except asyncio.CancelledError:
                raise
            except Exception:  # the loop outlives any one batch
                log.exception("batcher step failed")
                await asyncio.sleep(0.01)

    async def _step(self) -> None:
        now = time.monotonic()
        for r in self.scheduler.expired(now):
            self.metrics.count_shed(r.slo)
            _fail(
                r,
                WireError(
                    "overloaded",
                    f"waited {1e3 * (now - r.arrival):.0f} ms for the verifier "
                    f"(limit {1e3 * self.scheduler.max_wait_s:.0f}): draft locally and retry later",
                    r.sid,
                ),
            )
        start = max(now, self._ends_at) if self._inflight else now  # when a batch chosen now would start
        if len(self._inflight) >= self.depth or start - now > PIPELINE_LEAD_MS / 1e3:  # too soon
            # arrivals do not matter until then (each one waking this loop would cost the event loop per round)
            full = len(self._inflight) >= self.depth
            await self._wait(self._answered, None if full else start - now - PIPELINE_LEAD_MS / 1e3)
            return
        if not self.scheduler.ready(start):
            wake_at = self.scheduler.wake_at()
            await self._wait(self._wake, None if wake_at is None else max(0.0, wake_at - now))
            return
        chosen = self.scheduler.next_batch(start)
        batch = [r for r in chosen if not r.future.done()]  # done: its robot left
        if not batch:
            self.scheduler.finished(chosen)
            return
        self.metrics.queue_wait_s += sum(now - r.arrival for r in batch)
        self._ends_at = start + self.scheduler.model.batch_ms([r.member for r in batch]) / 1e3
        task = asyncio.create_task(self._run_batch(batch), name="batch")
        self._inflight.add(task)
        task.add_done_callback(lambda task: self._batch_done(task, chosen))

    async def _wait(self, event: asyncio.Event, timeout_s: float | None) -> None:
        """Until event is set or timeout_s has passed (None: no timeout)."""
        event.clear()
        try:
            await asyncio.wait_for(event.wait(), timeout_s)
        except asyncio.TimeoutError:  # 3.10: not the builtin TimeoutError
            pass

    def _batch_done(self, task: asyncio.Task, chosen: list[Request]) -> None:
        self._inflight.discard(task)
        self.scheduler.finished(chosen)
        error = None if task.cancelled() else task.exception()
        if error is not None:  # outside its passes (their failures are each request's): none is left waiting
            log.error("a batch of %d failed", len(chosen), exc_info=error)
            for r in chosen:
                _fail(r, WireError("internal", f"verification failed ({type(error).__name__}); retry", r.sid))
        self._answered.set()
        self._wake.set()

    async def _run_batch(self, batch: list[Request]) -> None:
        """One chosen batch: its passes handed to the model thread at once (they run in order, behind any batch
        already there), each pass's results out as it returns."""
        now = time.monotonic()
        if log.isEnabledFor(logging.DEBUG):
            model = self.scheduler.model
            log.debug(
                "batch of %d (%d still waiting, %d late): estimated %.0f ms, scale %.2f, slack %s ms",
                len(batch),
                len(self.scheduler),
                sum(r.late for r in batch),
                model.batch_ms([r.member for r in batch]),
                model.scale,
                [round(1e3 * (r.deadline - now)) if r.deadline < math.inf else None for r in batch],
            )
        # Shortest runs first: a prefill that would pad every draft to its length gets a pass of its own (a padding
        # engine's; a packed one's batch is one pass)
        loop = asyncio.get_running_loop()
        passes = [[batch[i] for i in group] for group in split_passes([r.member for r in batch], self.scheduler.model)]
        running = [loop.run_in_executor(self.executor, self.verifier.run_batch, [r.job for r in p]) for p in passes]
        for p, pass_future in zip(passes, running, strict=True):
            await self._run_pass(p, pass_future)

    async def _run_pass(self, batch: list[Request], running: asyncio.Future) -> None:
        try:
            results, pass_ms, members = await running
        except Exception as e:
            log.exception("a batch of %d failed", len(batch))
            for r in batch:
                _fail(r, WireError("internal", f"verification failed ({type(e).__name__}); retry", r.sid))
            return
        done = time.monotonic()
        log.debug("pass of %d %s: %.0f ms", len(members), members, pass_ms)
        if members:
            self.scheduler.model.observe(members, pass_ms)
            self.metrics.count_batch(len(members), pass_ms)
        for r, result in zip(batch, results, strict=True):
            self.scheduler.answered(r.sid, done)
            self.metrics.count_request(r.slo, late=done > r.deadline)
            if isinstance(result, WireError):
                _fail(r, result)
            elif not r.future.done():
                r.future.set_result(result)


def _fail(r: Request, error: WireError) -> None:
    if not r.future.done():
        r.future.set_exception(error)
