"""The go2 and ros2 drivers: imported only when chosen, a clear error without their SDK, and the calls
they make (checked against stand-in SDK modules that record calls; the robots are absent here)."""

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


@pytest.mark.parametrize("mode", [5, 7])  # lying down, damped
def test_go2_connect_stands_a_lying_robot_up(unitree, mode):
    unitree.mode = mode
    with make_controller("go2") as c:
        names = unitree.names()
        assert names.index("CheckMode") < names.index("RecoveryStand") < names.index("BalanceStand")
        assert unitree.mode == 1 and c.connected


def test_go2_connect_leaves_a_balancing_robot_alone(unitree):
    with make_controller("go2"):
        assert "RecoveryStand" not in unitree.names() and "BalanceStand" not in unitree.names()


def test_go2_connect_refuses_when_sport_mode_is_off(unitree):
    unitree.sport = ""  # released, as after low-level control: Move is ignored
    with pytest.raises(ControllerError, match="sport mode is off"):
        make_controller("go2").connect()
    assert "Move" not in unitree.names()


def test_go2_reset_after_estop_stands_up_before_motion(unitree):
    from agent.robot.safety import SafetyLayer, SafetyLimits

    with make_controller("go2") as c:
        s = SafetyLayer(c, SafetyLimits(max_frame_age_s=None, max_dvx=100.0))
        assert s.send_action(Command(0.3, 0, 0)).vx == 0.3
        s.estop().result(1)
        assert unitree.mode == 7 and s.send_action(Command(0.3, 0, 0)) == Command()
        n = len(unitree.calls)
        s.reset().result(5)
        after = [name for name in unitree.names()[n:] if name != "Move"]
        assert after[:2] == ["RecoveryStand", "BalanceStand"] and unitree.mode == 1 and not s.estopped
        assert s.send_action(Command(0.3, 0, 0)).vx == 0.3
        s.close()


def test_go2_reset_that_fails_keeps_the_latch(unitree):
    from agent.robot.safety import SafetyLayer, SafetyLimits

    with make_controller("go2", timeout_s=0.05) as c:
        s = SafetyLayer(c, SafetyLimits(max_frame_age_s=None))
        s.estop().result(1)
        unitree.reply.clear()  # the robot stops answering: RecoveryStand times out
        with pytest.raises(ControllerError, match="RecoveryStand returned 3104"):
            s.reset().result(5)
        assert s.estopped and s.send_action(Command(0.3, 0, 0)) == Command()
        unitree.reply.set()
        s.close()


def test_go2_range_finder_is_the_safety_layers_range_source(unitree):
    import math

    unitree.range_m = (0.4, 2.0, 0.1)
    with make_controller("go2") as c:
        assert c.ranges.clearance_m(0.0) == 0.4 and c.ranges.clearance_m(math.pi / 2) == 2.0
        assert c.ranges.clearance_m(-math.pi / 2) == 0.1 and c.ranges.clearance_m(math.pi) is None


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
