"""One safety layer for every controller: clamps, rate limits, a deadman, stale-frame stops, e-stop.

Every velocity command passes `SafetyLayer.send_action` before it reaches a
controller. The layer

- replaces a non-finite command (NaN, inf) by zero;
- clamps each axis to its limit (vx, vy in m/s, wz in rad/s);
- limits how fast each axis may change (m/s^2, rad/s^2) from the last command sent;
- sends zero while the camera frame is stale or missing (`frame_age_s` None or over the limit);
- sends zero while the e-stop is latched (`estop()` until `reset()`); the e-stop itself
  goes straight to the controller's `estop()`, with no model and no queue in the way;
- stops the robot when fresh commands stop: `tick()`, called by the control loop every
  period, stops it once `deadman_s` (default 0.3 s) has passed since the last command.

Time comes from `clock` (a fake one in tests). Thread-safe: the control loop
and the local API's e-stop may call it at once.
"""
from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass
from typing import Callable

from .controllers.base import Command, Controller


@dataclass(frozen=True)
class SafetyLimits:
    max_vx: float = 0.5                 # m/s forward and back (the Go2 allows 3.8; agents use far less)
    max_vy: float = 0.3                 # m/s sideways
    max_wz: float = 0.8                 # rad/s yaw
    max_dvx: float = 1.5                # m/s^2: the most vx may change per second
    max_dvy: float = 1.0                # m/s^2
    max_dwz: float = 3.0                # rad/s^2
    deadman_s: float = 0.3              # stop when no fresh command came for this long
    max_frame_age_s: float = 1.0        # stop when the newest camera frame is older (None: no camera check)

    def __post_init__(self):
        for name in ("max_vx", "max_vy", "max_wz", "max_dvx", "max_dvy", "max_dwz", "deadman_s"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
                raise ValueError(f"safety limit {name} must be a positive number, got {v!r}")
        if self.max_frame_age_s is not None and not self.max_frame_age_s > 0:
            raise ValueError(f"max_frame_age_s must be positive or None, got {self.max_frame_age_s!r}")


def clamp(cmd: Command, limits: SafetyLimits) -> Command:
    """Per-axis clamp; a non-finite axis makes the whole command zero (a NaN is a fault, not a speed)."""
    return cmd.clamped(limits.max_vx, limits.max_vy, limits.max_wz)


def rate_limit(cmd: Command, last: Command, dt: float, limits: SafetyLimits) -> Command:
    """Move each axis from `last` toward `cmd` by at most its limit times dt."""
    def step(v, v0, a):
        d = a * max(dt, 0.0)
        return max(v0 - d, min(v0 + d, v))
    return Command(step(cmd.vx, last.vx, limits.max_dvx), step(cmd.vy, last.vy, limits.max_dvy),
                   step(cmd.wz, last.wz, limits.max_dwz))


class SafetyLayer:
    def __init__(self, controller: Controller, limits: SafetyLimits = SafetyLimits(),
                 clock: Callable[[], float] = time.monotonic):
        self.controller = controller
        self.limits = limits
        self.clock = clock
        self._lock = threading.RLock()
        self._last = Command()              # the last command the controller got
        self._last_t: float | None = None   # when a fresh command last came (None: none since the last stop)
        self._estopped = False
        self.stops: dict[str, int] = {}     # reason -> count: deadman, stale_frame, estop, ...
        self.last_stop_reason: str | None = None

    @property
    def estopped(self) -> bool:
        return self._estopped

    @property
    def last_sent(self) -> Command:
        return self._last

    def send_action(self, cmd: Command, frame_age_s: float | None = 0.0) -> Command:
        """Clamp, rate-limit and check staleness; returns the command the controller actually got."""
        with self._lock:
            now = self.clock()
            limits = self.limits
            if self._estopped:
                return self._halt("estop_latched", now)
            if limits.max_frame_age_s is not None and (frame_age_s is None or frame_age_s > limits.max_frame_age_s):
                return self._halt("stale_frame", now)
            if not all(math.isfinite(v) for v in (cmd.vx, cmd.vy, cmd.wz)):
                return self._halt("non_finite_command", now)
            safe = clamp(cmd, limits)
            # the time since the last set-point (at most 0.1 s); from a stop, one nominal 20 Hz tick
            dt = 0.05 if self._last_t is None else min(0.1, now - self._last_t)
            safe = rate_limit(safe, self._last, dt, limits)
            sent = self.controller.send_action(safe)
            self._last, self._last_t = sent, now
            return sent

    def stop(self, reason: str = "stop") -> Command:
        """A normal halt (zero velocity, the controller's own stop)."""
        with self._lock:
            return self._halt(reason, self.clock())

    def estop(self) -> None:
        """Latch the e-stop and call the controller's e-stop at once; motion stays off until reset()."""
        with self._lock:
            self._estopped = True
            self._count("estop")
            self.controller.estop()
            self._last, self._last_t = Command(), None

    def reset(self) -> None:
        """Release the e-stop (ours and the driver's own latch); motion needs a fresh command."""
        with self._lock:
            self.controller.reset()
            self._estopped = False

    def tick(self) -> bool:
        """The deadman; call every control period. Returns True when it stopped the robot just now."""
        with self._lock:
            if self._last_t is None:
                return False
            if self.clock() - self._last_t > self.limits.deadman_s:
                self._halt("deadman", self.clock())
                return True
            return False

    def _halt(self, reason: str, now: float) -> Command:
        moving = self._last != Command() or self._last_t is not None
        self.controller.stop()
        if moving or reason in ("estop_latched",):
            self._count(reason)
        self._last, self._last_t = Command(), None
        return Command()

    def _count(self, reason: str) -> None:
        self.stops[reason] = self.stops.get(reason, 0) + 1
        self.last_stop_reason = reason

