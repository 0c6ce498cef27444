"""ROS 2: a geometry_msgs/Twist publisher on /cmd_vel (optional; rclpy comes from ROS, not PyPI).

With twist_mux in front of the robot, give this topic a lower priority than the
joystick so a human always wins. Note that go2_ros2_sdk drops all-zero twists,
so a zero Twist does not actively stop a Go2 there: use the go2 driver for that.
"""

from __future__ import annotations

import logging
from typing import Any

from .base import Command, Controller, ControllerError

log = logging.getLogger(__name__)


class Ros2Controller(Controller):
    name = "ros2"

    def __init__(
        self,
        topic: str = "/cmd_vel",
        node_name: str = "edge_agent",
        qos_depth: int = 1,
        max_vx: float = 1.0,
        max_vy: float = 0.6,
        max_wz: float = 1.5,
    ):
        self.topic, self.node_name, self.qos_depth = topic, node_name, qos_depth
        self.max_vx, self.max_vy, self.max_wz = max_vx, max_vy, max_wz
        self.node: Any = None  # rclpy's node, publisher and Twist once connected (rclpy is untyped, and optional)
        self.pub: Any = None
        self._twist: Any = None
        self._owns_context = False

    def connect(self) -> None:
        try:
            import rclpy
            from geometry_msgs.msg import Twist
        except ImportError as e:
            raise ControllerError(
                f"rclpy is not available ({e}): source your ROS 2 setup (e.g. "
                "/opt/ros/humble/setup.bash) in the service's environment"
            ) from None
        if not rclpy.ok():
            rclpy.init()
            self._owns_context = True
        self._rclpy, self._twist = rclpy, Twist
        self.node = rclpy.create_node(self.node_name)
        self.pub = self.node.create_publisher(Twist, self.topic, self.qos_depth)

    def disconnect(self) -> None:
        if self.node is None:
            return
        try:
            self.stop()
        finally:
            self.node.destroy_node()
            self.node = self.pub = None
            if self._owns_context:
                self._rclpy.shutdown()
                self._owns_context = False

    @property
    def connected(self) -> bool:
        return self.pub is not None

    def send_action(self, cmd: Command) -> Command:
        if self.pub is None:
            raise ControllerError("ros2: not connected")
        sent = cmd.clamped(self.max_vx, self.max_vy, self.max_wz)
        msg = self._twist()
        msg.linear.x, msg.linear.y, msg.angular.z = float(sent.vx), float(sent.vy), float(sent.wz)
        self.pub.publish(msg)
        return sent

    def stop(self) -> None:
        self.send_action(Command())
