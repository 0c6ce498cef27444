"""Driver calls that wait for a reply, kept off every thread that must not wait.

The Go2's StopMove, Damp, RecoveryStand and BalanceStand wait for the robot's
reply (up to the SDK's timeout, 10 s); a serial controller's STOP and ESTOP
wait for the MCU's ACK. None of them may run on the control loop (its rate and
systemd's watchdog), under the safety layer's lock (the e-stop latch) or on the
local API's event loop. A `CallLane` is one named daemon thread that runs such
calls in order; the safety layer keeps two, so a hung stop never delays an
e-stop:

    estop lane    the controller's e-stop, nothing else
    driver lane   stops, reset and stand-up

`submit` returns a concurrent.futures.Future at once and never blocks. The
queue is bounded by coalescing: at most one pending request per call name, and
a repeat joins the pending one (twenty deadman stops behind a stuck StopMove
are one more StopMove, not twenty).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from concurrent.futures import Future
from typing import Callable

log = logging.getLogger(__name__)


class CallLane:
    def __init__(self, name: str):
        self.name = name
        self._cond = threading.Condition()
        self._pending: deque[tuple[str, Callable[[], object], Future]] = deque()
        self._running: tuple[str, float] | None = None  # (call name, monotonic start) of the call in progress
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=f"lane-{name}", daemon=True)
        self._thread.start()

    def submit(self, name: str, fn: Callable[[], object]) -> Future:
        """Queue fn (or join the pending call of the same name); returns its future at once."""
        with self._cond:
            for pending_name, _, queued in self._pending:
                if pending_name == name:
                    return queued
            fut: Future = Future()
            if self._closed:
                fut.set_exception(RuntimeError(f"lane {self.name} is closed"))
                return fut
            self._pending.append((name, fn, fut))
            self._cond.notify()
            return fut

    def busy(self) -> dict | None:
        """The call in progress and for how long ({"call", "for_s"}), None when idle: a hung driver shows here."""
        with self._cond:
            running = self._running
        return None if running is None else {"call": running[0], "for_s": round(time.monotonic() - running[1], 3)}

    def drain(self, timeout_s: float) -> bool:
        """Wait (at most timeout_s) until nothing is pending or running; True when that happened."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._pending or self._running is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def close(self, timeout_s: float = 1.0) -> None:
        """Run what is pending for at most timeout_s, then stop; calls still waiting are cancelled."""
        self.drain(timeout_s)
        with self._cond:
            self._closed = True
            for _, _, fut in self._pending:
                fut.cancel()
            self._pending.clear()
            self._cond.notify_all()
        # a call stuck in the driver keeps this daemon thread; the process may still exit
        self._thread.join(0.1)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._pending and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                name, fn, fut = self._pending.popleft()
                if not fut.set_running_or_notify_cancel():
                    continue
                self._running = (name, time.monotonic())
            try:
                fut.set_result(fn())
            except Exception as e:  # the caller may never look at the future: say it here
                log.error("%s lane: %s failed: %s", self.name, name, e)
                fut.set_exception(e)
            finally:
                with self._cond:
                    self._running = None
                    self._cond.notify_all()
