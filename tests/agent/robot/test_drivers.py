"""The go2 and ros2 drivers: imported only when chosen, a clear error without their SDK, and the calls
they make, checked against stand-in SDK modules that record calls, for what the real SDK over DDS cannot
show on demand: an SDK that is not installed, how often the DDS factory is initialised in one process.
Everything else of the go2 driver runs through the real SDK over DDS against the simulated Go2
(tests/agent/robot/test_go2_dds.py)."""

import sys
import time
import types

import pytest

from agent.robot.controllers import Command, ControllerError, make_controller
from tests.agent.unitree_standin import StandIn


def test_unknown_controller():
    with pytest.raises(ValueError, match="choose one of"):
        make_controller("roomba")


@pytest.mark.parametrize("kind,msg", [("go2", "unitree_sdk2py is not installed"), ("ros2", "rclpy")])
def test_missing_sdk_is_a_clear_error(kind, msg, monkeypatch):
    for mod in (
        "unitree_sdk2py",
        "unitree_sdk2py.core.channel",
        "unitree_sdk2py.go2.sport.sport_client",
        "rclpy",
        "geometry_msgs",
        "geometry_msgs.msg",
    ):
        monkeypatch.setitem(sys.modules, mod, None)  # None in sys.modules makes the import fail
    c = make_controller(kind)
    with pytest.raises(ControllerError, match=msg):
        c.connect()


@pytest.fixture
def unitree(monkeypatch):
    sdk = StandIn().install(monkeypatch)
    yield sdk
    sdk.close()


def test_go2_move_stop_damp(unitree):
    c = make_controller("go2", network_interface="eth0")
    with c:
        sent = c.send_action(Command(5.0, 0.1, -3.0))  # to the move thread: Move goes out from there
        deadline = time.monotonic() + 2.0
        while ("Move", 1.0, 0.1, -1.5) not in unitree.calls and time.monotonic() < deadline:
            time.sleep(0.01)
        c.stop()
        c.estop()
    calls = unitree.calls
    assert ("ChannelFactoryInitialize", 0, "eth0") in calls and ("Init", "SportClient") in calls
    assert sent == Command(1.0, 0.1, -1.5) and ("Move", 1.0, 0.1, -1.5) in calls
    names = unitree.names()
    assert names.index("StopMove") < names.index("Damp") and names[-1] == "StopMove"  # disconnect stops
    # the DDS factory is initialised once per process
    unitree.mode = 1
    with make_controller("go2"):
        pass
    assert sum(1 for c in unitree.calls if c[0] == "ChannelFactoryInitialize") == 1


def test_ros2_publishes_twists(monkeypatch):
    published = []

    class Vec:
        x = y = z = 0.0

    class Twist:
        def __init__(self):
            self.linear, self.angular = Vec(), Vec()

    class Node:
        def create_publisher(self, typ, topic, depth):
            assert typ is Twist and topic == "/cmd_vel"
            return types.SimpleNamespace(publish=lambda m: published.append((m.linear.x, m.linear.y, m.angular.z)))

        def destroy_node(self):
            published.append("destroyed")

    rclpy = types.ModuleType("rclpy")
    rclpy.ok, rclpy.init, rclpy.shutdown = (lambda: False), (lambda: None), (lambda: None)
    rclpy.create_node = lambda name: Node()
    msg = types.ModuleType("geometry_msgs.msg")
    msg.Twist = Twist
    monkeypatch.setitem(sys.modules, "rclpy", rclpy)
    monkeypatch.setitem(sys.modules, "geometry_msgs", types.ModuleType("geometry_msgs"))
    monkeypatch.setitem(sys.modules, "geometry_msgs.msg", msg)
    with make_controller("ros2") as c:
        assert c.send_action(Command(0.3, 0, 9.0)) == Command(0.3, 0, 1.5)
    assert published == [(0.3, 0.0, 1.5), (0.0, 0.0, 0.0), "destroyed"]
