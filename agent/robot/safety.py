"""One safety layer for every controller: clamps, rate limits, a deadman, stale-frame stops, an obstacle
stop, e-stop.

Every velocity command passes `SafetyLayer.send_action` before it reaches a
controller. The layer

- replaces a non-finite command (NaN, inf) by zero;
- clamps each axis to its limit (vx, vy in m/s, wz in rad/s);
- limits how fast each axis may change (m/s^2, rad/s^2) from the last command sent;
- sends zero while the camera frame is stale or missing (`frame_age_s` None or over the limit);
- allows no translation toward an obstacle nearer than `min_clearance_m` in the direction of travel
  (a `RangeSource`: the simulator's ray cast, the Go2's range finder); turning in place stays allowed,
  so the robot can turn away. Forward motion with no reading for its direction is refused too. On by
  default (AUTO_CLEARANCE_M) wherever the controller has a range source; a controller without one
  says at start that the rule is off;
- sends zero while the e-stop is latched (`estop()` until `reset()`);
- stops the robot when fresh commands stop: `tick()`, called by the control loop every
  period, stops it once `deadman_s` (default 0.3 s) has passed since the last command.

Which driver calls run where. `send_action` is the driver's set-point and never waits for a
reply (the Go2's Move is send-and-forget), so it runs inline, under the lock, and a halt sends a
zero set-point the same way. The driver's `stop()`, `estop()` and `reset()` may wait for a reply
(StopMove, Damp and the stand-up wait up to the SDK's 10 s timeout); they run on the layer's
call lanes (agent/robot/lanes.py), never on the caller's thread. `estop()` sets the latch before
anything else, without the lock, and hands the driver's e-stop to a lane of its own: no stuck
driver call can delay either.

Time comes from `clock` (a fake one in tests). Thread-safe: the control loop
and the local API's e-stop may call it at once.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, replace
from typing import Callable

from .controllers.base import Command, Controller, ControllerError, RangeSource
from .lanes import CallLane

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SafetyLimits:
    max_vx: float = 0.5  # m/s forward and back (the Go2 allows 3.8; agents use far less)
    max_vy: float = 0.3  # m/s sideways
    max_wz: float = 0.8  # rad/s yaw
    max_dvx: float = 1.5  # m/s^2: the most vx may change per second
    max_dvy: float = 1.0  # m/s^2
    max_dwz: float = 3.0  # rad/s^2
    deadman_s: float = 0.3  # stop when no fresh command came for this long
    max_frame_age_s: float | None = 1.0  # stop when the newest camera frame is older (None: no camera check)
    # no translation toward an obstacle nearer than this (m); 0: no obstacle rule; None (the default): on at
    # AUTO_CLEARANCE_M wherever the controller has a range source, off (and said so at start) where it has none
    min_clearance_m: float | None = None

    def __post_init__(self):
        for name in ("max_vx", "max_vy", "max_wz", "max_dvx", "max_dvy", "max_dwz", "deadman_s"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
                raise ValueError(f"safety limit {name} must be a positive number, got {v!r}")
        if self.max_frame_age_s is not None and not self.max_frame_age_s > 0:
            raise ValueError(f"max_frame_age_s must be positive or None, got {self.max_frame_age_s!r}")
        if self.min_clearance_m is not None and not (
            isinstance(self.min_clearance_m, (int, float)) and 0 <= self.min_clearance_m <= 10
        ):
            raise ValueError(f"min_clearance_m must be 0..10 m (0: off), got {self.min_clearance_m!r}")


def clamp(cmd: Command, limits: SafetyLimits) -> Command:
    """Per-axis clamp; a non-finite axis makes the whole command zero (a NaN is a fault, not a speed)."""
    return cmd.clamped(limits.max_vx, limits.max_vy, limits.max_wz)


def rate_limit(cmd: Command, last: Command, dt: float, limits: SafetyLimits) -> Command:
    """Move each axis from `last` toward `cmd` by at most its limit times dt."""

    def step(v: float, v0: float, a: float) -> float:
        d = a * max(dt, 0.0)
        return max(v0 - d, min(v0 + d, v))

    return Command(
        step(cmd.vx, last.vx, limits.max_dvx),
        step(cmd.vy, last.vy, limits.max_dvy),
        step(cmd.wz, last.wz, limits.max_dwz),
    )


AUTO_CLEARANCE_M = 0.2  # the obstacle stop's default: the simulator's ray cast measures from the
# robot's edge, and at 0.2 m a 0.5 m/s robot braking at 1.5 m/s^2 (0.08 m)
# stays off the wall with a control tick to spare


def resolve_clearance(limits: SafetyLimits, ranges: RangeSource | None, controller_name: str) -> SafetyLimits:
    """min_clearance_m None -> AUTO_CLEARANCE_M with a range source, 0 without; says which at start."""
    if limits.min_clearance_m is not None:
        return limits
    if ranges is None:
        log.warning(
            "the %s controller has no range source: the obstacle stop is off (safety.min_clearance_m "
            "needs a robot that measures its clearance)",
            controller_name,
        )
        return replace(limits, min_clearance_m=0.0)
    log.info(
        "obstacle stop on: no translation toward anything nearer than %.2f m (the %s controller's range "
        "source; safety.min_clearance_m sets it, 0 turns it off)",
        AUTO_CLEARANCE_M,
        controller_name,
    )
    return replace(limits, min_clearance_m=AUTO_CLEARANCE_M)


class SafetyLayer:
    def __init__(
        self,
        controller: Controller,
        limits: SafetyLimits = SafetyLimits(),
        clock: Callable[[], float] = time.monotonic,
        ranges: RangeSource | None = None,
    ):
        limits = resolve_clearance(limits, ranges, controller.name)
        if (limits.min_clearance_m or 0.0) > 0 and ranges is None:  # resolved: None is gone
            raise ValueError(
                f"safety.min_clearance_m = {limits.min_clearance_m} needs a range source, and the "
                f"{controller.name} controller has none: set it to 0 or use a robot with one"
            )
        self.controller = controller
        self.limits = limits
        self.clock = clock
        self.ranges = ranges
        self._lock = threading.RLock()
        self._last = Command()  # the last command the controller got
        self._last_t: float | None = None  # when a fresh command last came (None: none since the last stop)
        self._estopped = False
        self._estops = 0  # e-stops so far: a reset finishing after a newer e-stop keeps the latch
        self._blocked = False  # the obstacle rule is holding the robot back now
        self.clearance_m: float | None = None  # the last range reading in the direction of travel
        self._stats = threading.Lock()  # the counters only: estop() never waits for the main lock
        self.stops: dict[str, int] = {}  # reason -> count: deadman, stale_frame, estop, obstacle, ...
        self.last_stop_reason: str | None = None
        self._estop_lane = CallLane("estop")
        self._driver_lane = CallLane("driver")

    @property
    def estopped(self) -> bool:
        return self._estopped

    @property
    def last_sent(self) -> Command:
        return self._last

    def send_action(self, cmd: Command, frame_age_s: float | None = 0.0) -> Command:
        """Clamp, rate-limit and check staleness and clearance; returns the command the controller actually got."""
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
            if (limits.min_clearance_m or 0.0) > 0 and self._path_blocked(safe):
                safe = Command(0.0, 0.0, safe.wz)  # at once, not through the rate limit: the obstacle is near now
                if safe == Command():
                    return self._halt(None, now)  # counted by _path_blocked, once per blocked spell
            sent = self.controller.send_action(safe)
            self._last, self._last_t = sent, now
            return sent

    def _path_blocked(self, cmd: Command) -> bool:
        """The obstacle rule for this command's direction of travel; counts each blocked spell once."""
        if cmd.vx == 0 and cmd.vy == 0:
            self._blocked = False
            return False
        assert self.ranges is not None  # the constructor refuses an obstacle rule without a range source
        clearance = self.ranges.clearance_m(math.atan2(cmd.vy, cmd.vx))
        self.clearance_m = clearance
        # no reading: forward motion is refused (blind), backing away from a wall is not
        blocked = (cmd.vx > 0) if clearance is None else clearance < (self.limits.min_clearance_m or 0.0)
        if blocked and not self._blocked:
            log.warning(
                "obstacle stop: %s in the direction of travel (min %.2f m)",
                "no range reading" if clearance is None else f"{clearance:.2f} m",
                self.limits.min_clearance_m,
            )
            self._count("obstacle")
        self._blocked = blocked
        return blocked

    def stop(self, reason: str = "stop") -> Command:
        """A normal halt: a zero set-point now, the controller's own stop on the driver lane."""
        with self._lock:
            return self._halt(reason, self.clock())

    def estop(self) -> Future:
        """Latch the e-stop and hand the controller's e-stop to its own lane; never waits.

        The latch is set first and without the lock, so a thread stuck in a driver call under the
        lock cannot delay it. Returns the future of the controller's e-stop (done when it returned).
        """
        self._estopped = True
        with self._stats:
            self._estops += 1
        self._count("estop")
        return self._estop_lane.submit("estop", self.controller.estop)

    def reset(self) -> Future:
        """Release the e-stop once the driver is ready again (its own latch cleared; a legged robot standing).

        The driver's reset runs on the driver lane; the latch is released only when it succeeded and no
        newer e-stop came meanwhile. Motion needs a fresh command. Returns the future of the whole reset.
        """
        with self._stats:
            estops = self._estops

        def run() -> None:
            self.controller.reset()
            with self._lock, self._stats:
                if self._estops != estops:
                    raise ControllerError("e-stopped again during the reset: the e-stop stays latched")
                self._estopped = False
                self._last, self._last_t = Command(), None
            log.info("e-stop released")

        return self._driver_lane.submit("reset", run)

    def tick(self) -> bool:
        """The deadman; call every control period. Returns True when it stopped the robot just now."""
        with self._lock:
            if self._last_t is None:
                return False
            if self._estopped:
                self._halt("estop_latched", self.clock())
                return True
            if self.clock() - self._last_t > self.limits.deadman_s:
                self._halt("deadman", self.clock())
                return True
            return False

    def driver_calls(self) -> dict:
        """The driver calls in progress per lane ({"estop": None | {"call", "for_s"}, "driver": ...})."""
        return {"estop": self._estop_lane.busy(), "driver": self._driver_lane.busy()}

    def drain(self, timeout_s: float) -> bool:
        """Wait (bounded) until every requested driver call has returned; True when they all did."""
        deadline = time.monotonic() + timeout_s
        return all(lane.drain(max(0.0, deadline - time.monotonic())) for lane in (self._estop_lane, self._driver_lane))

    def close(self, timeout_s: float = 2.0) -> None:
        """Let the pending driver calls (the last stop) go out for at most timeout_s, then stop the lanes."""
        self.drain(timeout_s)
        self._estop_lane.close(0.0)
        self._driver_lane.close(0.0)

    def _halt(self, reason: str | None, now: float) -> Command:
        """Zero set-point now; the driver's stop once per stop (not while e-stopped: the e-stop lane has it)."""
        moving = self._last != Command() or self._last_t is not None
        if self.controller.connected:
            self.controller.send_action(Command())
        if moving and not self._estopped:
            self._driver_lane.submit("stop", self.controller.stop)
        if reason is not None and (moving or reason == "estop_latched"):
            self._count(reason)
        self._last, self._last_t = Command(), None
        return Command()

    def _count(self, reason: str) -> None:
        with self._stats:
            self.stops[reason] = self.stops.get(reason, 0) + 1
            self.last_stop_reason = reason
