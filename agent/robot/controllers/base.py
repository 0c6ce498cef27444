"""The controller interface every robot driver implements, and the registry of drivers.

A controller turns a velocity command into motion. Its lifecycle is
`connect()` / `disconnect()` (or a `with` block); `send_action(cmd)` returns
the command actually sent after the driver's own clamping (hardware limits);
`stop()` is a normal halt and `estop()` the soft emergency stop (the Go2's
`Damp`, a serial controller's e-stop frame). Controllers never see a model:
`agent.robot.safety.SafetyLayer` sits in front of every one of them.

Waiting: `send_action` must never wait for a reply (it runs on the control loop,
under the safety layer's lock); `stop`, `estop` and `reset` may (the Go2's
StopMove and Damp wait up to the SDK's timeout), and the safety layer runs them
on threads of their own. A controller with a range sensor sets `ranges` (a
`RangeSource`) for the safety layer's obstacle stop.

Fakes (`sim`, a serial controller on `loop://`) are registered beside the
real drivers, never instead of them.
"""

from __future__ import annotations

import importlib
import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class Command:
    """A body-frame velocity set-point."""

    vx: float = 0.0  # m/s, forward positive
    vy: float = 0.0  # m/s, left positive
    wz: float = 0.0  # rad/s, counter-clockwise (left turn) positive

    def to_json(self) -> dict:
        return {"vx": round(self.vx, 4), "vy": round(self.vy, 4), "wz": round(self.wz, 4)}

    def clamped(self, max_vx: float, max_vy: float, max_wz: float) -> "Command":
        """Each axis clipped to +-its limit; a non-finite axis makes the whole command zero (a fault)."""
        if not all(math.isfinite(v) for v in (self.vx, self.vy, self.wz)):
            return Command()
        lim = lambda v, m: max(-m, min(m, v))  # noqa: E731
        return Command(lim(self.vx, max_vx), lim(self.vy, max_vy), lim(self.wz, max_wz))


class ControllerError(RuntimeError):
    """The driver cannot be used (missing SDK, no device, not connected)."""


class RangeSource(Protocol):
    """A robot's range sensor, as the safety layer's obstacle stop reads it (agent/robot/safety.py)."""

    def clearance_m(self, heading_rad: float) -> float | None:
        """Free distance (m) from the robot's body along a body-frame heading (0 ahead, +pi/2 left);
        None when no fresh reading covers that heading."""


class Controller(ABC):
    name = "controller"
    ranges: RangeSource | None = None  # a RangeSource when the robot can measure its clearance

    def __enter__(self):
        self.connect()
        return self

    def __exit__(self, *exc):
        self.disconnect()

    @abstractmethod
    def connect(self) -> None: ...

    @abstractmethod
    def disconnect(self) -> None:
        """Stop motion and release the device; safe to call twice."""

    @property
    @abstractmethod
    def connected(self) -> bool: ...

    @abstractmethod
    def send_action(self, cmd: Command) -> Command:
        """Send one velocity set-point; returns what was actually sent after the driver's clamping."""

    @abstractmethod
    def stop(self) -> None:
        """Zero velocity (a normal halt)."""

    def estop(self) -> None:
        """The soft emergency stop; drivers with a stronger one (Go2 Damp) override this."""
        self.stop()

    def odometry(self) -> tuple[float, float, float, float, float, float] | None:
        """The robot's own odometry, REP-105's odom -> base_link: (x, y, theta) in m and rad in the odom frame,
        (vx, vy, wz) in the body frame; None when the robot reports none (default)."""
        return None

    def reset(self) -> None:
        """Make the robot ready to move after an e-stop, once a person has checked it: clear the driver's
        own latch, stand a legged robot up (default: nothing to do)."""
        return None


# name -> "module:Class"; imported only when chosen, so a missing SDK (unitree_sdk2py, rclpy) only
# matters to the robot that asks for it.
CONTROLLERS = {
    "sim": "agent.robot.controllers.sim:SimController",
    "serial": "agent.robot.controllers.serial:SerialController",
    "go2": "agent.robot.controllers.go2:Go2Controller",
    "ros2": "agent.robot.controllers.ros2:Ros2Controller",
}


def make_controller(kind: str, **options) -> Controller:
    if kind not in CONTROLLERS:
        raise ValueError(f"unknown controller {kind!r}; choose one of {sorted(CONTROLLERS)}")
    module, cls = CONTROLLERS[kind].split(":")
    return getattr(importlib.import_module(module), cls)(**options)
