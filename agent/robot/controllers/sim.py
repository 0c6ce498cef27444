"""The simulator's controller: velocity commands into agent.robot.sim.SimWorld.

It behaves like a small legged robot's driver: hardware limits clamp every command,
`stop()` zeroes the velocity, `estop()` damps the robot (the Go2's `Damp`: it holds
still and ignores commands until `connect()` again or `world.damped = False`), and
the world itself stops the robot `auto_stop_s` after the last command.
"""

from __future__ import annotations

from ..sim import SimWorld, make_world
from .base import Command, Controller, ControllerError


class SimController(Controller):
    name = "sim"

    def __init__(
        self,
        world: SimWorld | None = None,
        scene: str = "red_box",
        start: int | tuple | None = 0,
        max_vx: float = 1.0,
        max_vy: float = 0.5,
        max_wz: float = 1.5,
    ):
        self.world = world if world is not None else make_world(scene, start=start)
        self.ranges = self.world  # the simulated range sensor: a ray cast in the direction of travel
        self.max_vx, self.max_vy, self.max_wz = max_vx, max_vy, max_wz
        self._connected = False

    def connect(self) -> None:
        self.world.damped = False
        self._connected = True

    def disconnect(self) -> None:
        if self._connected:
            self.world.set_velocity(Command())
        self._connected = False

    @property
    def connected(self) -> bool:
        return self._connected

    def clamp(self, cmd: Command) -> Command:
        """The hardware limits per axis; a non-finite axis makes the whole command zero."""
        return cmd.clamped(self.max_vx, self.max_vy, self.max_wz)

    def send_action(self, cmd: Command) -> Command:
        """Returns the command the robot now holds: the clamped one, or zero while damped."""
        if not self._connected:
            raise ControllerError("sim controller is not connected (call connect() or use a with block)")
        sent = self.clamp(cmd)
        self.world.set_velocity(sent)
        return Command() if self.world.damped else sent

    def stop(self) -> None:
        self.world.set_velocity(Command())

    def estop(self) -> None:
        self.world.set_velocity(Command())
        self.world.damped = True

    def reset(self) -> None:
        self.world.damped = False

    def odometry(self) -> tuple[float, float, float, float, float, float]:
        """The simulator's pose and body velocity: odometry without drift (odom is the scene's frame)."""
        x, y, th = self.world.pose
        v = self.world.velocity
        return (x, y, th, v.vx, v.vy, v.wz)
