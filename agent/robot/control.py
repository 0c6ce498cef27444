"""The control loop: the one thread that talks to the motors, at a fixed rate.

Each tick it either streams the current motion's velocity through the safety
layer (the Go2 wants Move at >= 10 Hz; a serial MCU its set-point re-sent),
ramps it down through the rate limiter when the motion's time is up, or runs
the deadman. It also pings systemd's watchdog, so a hung loop gets the
service restarted (WATCHDOG=1 must come from here, not from a thread of its own).

The navigation thread hands it a Motion and waits; the local API's e-stop calls
`estop()`, which latches the safety layer's e-stop (no model in the way) and drops
the motion. Nothing here waits for a driver's reply: the safety layer runs the
driver calls that do (StopMove, Damp, stand-up) on lanes of their own, so the
loop keeps its rate and the watchdog is fed while the robot is slow to answer.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future
from typing import Callable

from .actions import Motion
from .controllers.base import Command
from .safety import SafetyLayer

log = logging.getLogger(__name__)


class ControlLoop:
    def __init__(
        self,
        safety: SafetyLayer,
        hz: float = 20.0,
        frame_age: Callable[[], float | None] = lambda: 0.0,
        watchdog: Callable[[], object] | None = None,
        watchdog_interval_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        if not 1.0 <= hz <= 500.0:
            raise ValueError(f"control rate must be 1..500 Hz, got {hz}")
        self.safety = safety
        self.period = 1.0 / hz
        self.frame_age = frame_age
        self.watchdog = watchdog
        self.watchdog_interval_s = watchdog_interval_s
        self.clock = clock
        self._lock = threading.Lock()
        self._motion: Motion | None = None
        self._until = 0.0
        self._ramping = False
        self._cut = False
        self._done = threading.Event()
        self._done.set()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._last_watchdog = -1e9
        self.ticks = 0
        self.last_sent = Command()
        self.first_sent: Command | None = None  # the first command of the current motion, after the safety layer
        self.peak_sent = Command()  # its largest set-point per axis (by magnitude)
        self.ended_at: float | None = None  # when the last motion ended or was dropped (self.clock())

    # -------------------------------------------------------------- lifecycle

    def start(self) -> "ControlLoop":
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="control", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 2.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
            self._thread = None
        self.safety.stop("shutdown")

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # -------------------------------------------------------------- commands from other threads

    def execute(self, motion: Motion, cancel: threading.Event | None = None, timeout_s: float | None = None) -> bool:
        """Run a motion to its end (blocking). False when it was cut short (e-stop, cancel, a halt)."""
        self.start_motion(motion)
        return self.wait_motion(cancel, timeout_s if timeout_s is not None else motion.duration_s + 5.0)

    def wait_motion(self, cancel: threading.Event | None = None, timeout_s: float = 5.0) -> bool:
        """Wait for the motion `start_motion` began to end (the navigator's overlapped steps start it, decide
        the next step, then wait here). False when it was cut short (e-stop, cancel, a halt, the timeout)."""
        deadline = time.monotonic() + timeout_s
        while not self._done.wait(0.01):
            if (cancel is not None and cancel.is_set()) or time.monotonic() > deadline:
                self.halt("cancelled" if cancel is not None and cancel.is_set() else "motion_timeout")
                return False
        with self._lock:
            return not self._cut

    def start_motion(self, motion: Motion) -> None:
        with self._lock:
            if self.safety.estopped:
                self._cut = True
                self._done.set()
                return
            self._motion, self._until, self._ramping, self._cut = motion, self.clock() + motion.duration_s, False, False
            self.first_sent, self.peak_sent = None, Command()
            self._done.clear()

    def halt(self, reason: str = "halt") -> None:
        """Stop now: drop the motion and zero the motors (no ramp)."""
        with self._lock:
            self._drop()
        self.safety.stop(reason)

    def estop(self) -> Future:
        """The e-stop: latched before this returns, and never waits; the future is the controller's e-stop."""
        delivery = self.safety.estop()
        with self._lock:
            self._drop()
        return delivery

    def _drop(self) -> None:
        if self._motion is not None:
            self._cut = True
            self.ended_at = self.clock()
        self._motion, self._ramping = None, False
        self._done.set()

    # -------------------------------------------------------------- the loop

    def tick(self) -> None:
        """One control period (public so tests can drive it with a fake clock)."""
        now = self.clock()
        with self._lock:
            motion, until, ramping = self._motion, self._until, self._ramping
        if motion is not None and not ramping and now < until:
            sent = self.safety.send_action(motion.cmd, self.frame_age())
            with self._lock:
                if sent == Command() and motion.cmd != Command():  # the safety layer refused (stale, e-stop)
                    self._drop()
                else:
                    if self.first_sent is None:
                        self.first_sent = sent
                    p = self.peak_sent
                    big = lambda a, b: a if abs(a) >= abs(b) else b  # noqa: E731
                    self.peak_sent = Command(big(p.vx, sent.vx), big(p.vy, sent.vy), big(p.wz, sent.wz))
        elif motion is not None:
            sent = self.safety.send_action(Command(), self.frame_age())  # ramp down through the rate limit
            with self._lock:
                self._ramping = True
                if sent == Command():
                    self.safety.stop("motion_done")
                    self._motion = None
                    self.ended_at = now
                    self._done.set()
        else:
            self.safety.tick()
            sent = self.safety.last_sent
        self.last_sent = sent
        self.ticks += 1
        if (
            self.watchdog is not None
            and self.watchdog_interval_s is not None
            and now - self._last_watchdog >= self.watchdog_interval_s
        ):
            self.watchdog()
            self._last_watchdog = now

    def _run(self) -> None:
        next_t = time.monotonic()
        while not self._stop.is_set():
            try:
                self.tick()
            except Exception:  # a driver fault: stop the motors and keep the loop (and watchdog) alive
                log.exception("control tick failed; stopping the robot")
                with self._lock:
                    self._drop()
                try:
                    self.safety.stop("controller_fault")
                except Exception:
                    log.exception("stop failed too")
            next_t += self.period
            delay = next_t - time.monotonic()
            if delay < -self.period:  # fell behind (a slow driver): do not try to catch up in a burst
                next_t = time.monotonic()
                delay = 0.0
            self._stop.wait(max(0.0, delay))
