"""Unitree Go2 through unitree_sdk2py's SportClient (high-level sport mode over DDS).

    Move(vx, vy, vyaw)  send-and-forget; must be streamed at >= 10 Hz (the control loop
                        streams every tick; config refuses robot.control_hz < 10)
    StopMove()          the normal halt
    Damp()              the soft e-stop: joints go limp, the robot sinks (xr_teleoperate #331)
    RecoveryStand()     from lying (or after Damp) back onto its feet, joints locked
    BalanceStand()      standing and balancing: the stance in which Move is obeyed

Every call but Move waits for the robot's reply, up to `timeout_s` (the SDK's
SetTimeout, 10 s here as in Unitree's examples): the safety layer never makes
them on the control loop (agent/robot/safety.py).

`connect()` checks that the sport service is on (the motion switcher names a
mode; after low-level control it names none and Move does nothing), waits for
the robot's state on `rt/sportmodestate`, and stands the robot up when it lies
or is damped. `reset()` after an e-stop stands it up again: RecoveryStand, then
BalanceStand; each step is logged.

The robot's range finder (`rt/utlidar/range_info`: the nearest obstacle ahead,
left and right, in point.x, .y and .z as Unitree's own obstacle avoidance and
community drivers read it) is the safety layer's range source.

The SDK is imported only when this driver is chosen, so robots without it (and CI)
never need it; a missing SDK is a clear ControllerError with the install hint.
`ChannelFactoryInitialize` is a per-process singleton: `init_channel` calls it once,
for this driver and the Go2 camera (agent/robot/camera.py) alike.
The robot's own ~1 s auto-stop and our deadman (0.3 s) back each other up.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from typing import Any, Callable

from .base import Command, Controller, ControllerError

log = logging.getLogger(__name__)

INSTALL_HINT = (
    "unitree_sdk2py is not installed: install it from a pinned commit of "
    "https://github.com/unitreerobotics/unitree_sdk2_python (pip install -e .), with CycloneDDS 0.10.x "
    "built first on a Jetson (CYCLONEDDS_HOME); the PyPI 'unitree-sdk2py' is stale"
)
STATE_TOPIC = "rt/sportmodestate"
RANGE_TOPIC = "rt/utlidar/range_info"
# SportModeState_.mode values (Unitree's sport-mode documentation) that decide what connect/reset do.
MODE_NAMES = {
    0: "idle",
    1: "balance_stand",
    2: "pose",
    3: "locomotion",
    5: "lie_down",
    6: "joint_lock",
    7: "damping",
    8: "recovery_stand",
    10: "sit",
}
LYING = {5, 7}  # on the ground or limp: RecoveryStand, then BalanceStand
LOCKED = {6, 8}  # standing with locked joints: Move is ignored until BalanceStand
_channel_lock = threading.Lock()
_channel_ready = False


def init_channel(network_interface: str | None) -> None:
    """ChannelFactoryInitialize once per process (the DDS participant is a singleton)."""
    global _channel_ready
    try:
        from unitree_sdk2py.core.channel import ChannelFactoryInitialize
    except ImportError as e:
        raise ControllerError(f"{INSTALL_HINT} ({e})") from None
    with _channel_lock:
        if _channel_ready:
            return
        if network_interface:
            ChannelFactoryInitialize(0, network_interface)
        else:
            ChannelFactoryInitialize(0)
        _channel_ready = True


class Latest:
    """The newest sample of a DDS topic with its arrival time (written by the SDK's reader thread)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._value: Any = None  # an SDK message (unitree_sdk2py is untyped)
        self._t = -math.inf

    def put(self, value: Any) -> None:
        with self._lock:
            self._value, self._t = value, time.monotonic()

    def get(self, max_age_s: float) -> Any:
        """The newest sample if it is at most max_age_s old, else None."""
        with self._lock:
            value, t = self._value, self._t
        return value if time.monotonic() - t <= max_age_s else None


class Go2Ranges:
    """The Go2's range finder as the safety layer's range source: ahead, left and right."""

    def __init__(self, latest: Latest, max_age_s: float = 0.5):
        self.latest = latest
        self.max_age_s = max_age_s

    def clearance_m(self, heading_rad: float) -> float | None:
        msg = self.latest.get(self.max_age_s)
        if msg is None:
            return None
        a = math.degrees(heading_rad)
        if -45.0 <= a <= 45.0:
            return float(msg.point.x)
        if 45.0 < a <= 135.0:
            return float(msg.point.y)
        if -135.0 <= a < -45.0:
            return float(msg.point.z)
        return None  # behind: the range finder does not look there


class Go2Controller(Controller):
    name = "go2"

    def __init__(
        self,
        network_interface: str | None = None,
        timeout_s: float = 10.0,
        max_vx: float = 1.0,
        max_vy: float = 0.6,
        max_wz: float = 1.5,
        state_timeout_s: float = 2.0,
        stand_timeout_s: float = 8.0,
    ):
        self.network_interface = network_interface
        self.timeout_s = timeout_s
        self.state_timeout_s = state_timeout_s  # the first rt/sportmodestate sample must come within this
        self.stand_timeout_s = stand_timeout_s  # standing up must show in the state within this
        # well inside the documented sport-mode ranges (vx -2.5..3.8, vy -1..1, vyaw -4..4)
        self.max_vx, self.max_vy, self.max_wz = max_vx, max_vy, max_wz
        self.client = None
        self.state = Latest()  # SportModeState_
        self._range = Latest()  # PointStamped_
        self.ranges = Go2Ranges(self._range)
        self._subscribers: list = []
        self.errors = 0  # non-zero return codes from the SDK

    def connect(self) -> None:
        init_channel(self.network_interface)
        try:
            from unitree_sdk2py.comm.motion_switcher.motion_switcher_client import MotionSwitcherClient
            from unitree_sdk2py.core.channel import ChannelSubscriber
            from unitree_sdk2py.go2.sport.sport_client import SportClient
            from unitree_sdk2py.idl.geometry_msgs.msg.dds_ import PointStamped_
            from unitree_sdk2py.idl.unitree_go.msg.dds_ import SportModeState_
        except ImportError as e:
            raise ControllerError(f"{INSTALL_HINT} ({e})") from None
        where = self.network_interface or "the default interface"
        switcher = MotionSwitcherClient()
        switcher.SetTimeout(self.timeout_s)
        switcher.Init()
        code, mode = switcher.CheckMode()
        if code != 0:
            raise ControllerError(
                f"go2: the motion switcher did not answer on {where} (code {code}): "
                f"check robot.options.network_interface and the cable"
            )
        if not mode or not mode.get("name"):
            raise ControllerError(
                "go2: sport mode is off (the motion switcher has released it, as low-level "
                "control does), so Move would be ignored: select it in the Unitree app, or "
                "MotionSwitcherClient().SelectMode('normal'), then start again"
            )
        log.info("go2: sport mode %r on %s", mode["name"], where)
        for topic, typ, latest in (
            (STATE_TOPIC, SportModeState_, self.state),
            (RANGE_TOPIC, PointStamped_, self._range),
        ):
            sub = ChannelSubscriber(topic, typ)
            sub.Init(latest.put, 10)
            self._subscribers.append(sub)
        if self._wait_state(lambda s: True, self.state_timeout_s) is None:
            self._close_subscribers()
            raise ControllerError(
                f"go2: no {STATE_TOPIC} from the robot within {self.state_timeout_s:.0f} s on "
                f"{where}: check robot.options.network_interface"
            )
        client = SportClient()
        client.SetTimeout(self.timeout_s)
        client.Init()
        self.client = client
        state = self.state.get(self.state_timeout_s)
        if state.mode in LYING:
            log.info("go2: lying (mode %s): standing up", _mode_name(state.mode))
            self._stand_up()
        elif state.mode in LOCKED:
            log.info("go2: standing with locked joints (mode %s): BalanceStand", _mode_name(state.mode))
            self._call("BalanceStand")
            self._await_stance()
        else:
            log.info("go2: standing (mode %s)", _mode_name(state.mode))

    def _wait_state(self, pred: Callable[[Any], bool], timeout_s: float) -> Any:
        """The first fresh state for which pred holds, waiting at most timeout_s; None when none came."""
        deadline = time.monotonic() + timeout_s
        while True:
            state = self.state.get(0.5)
            if state is not None and pred(state):
                return state
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.02)

    def _call(self, name: str) -> None:
        """One sport call that waits for the robot's reply; a non-zero code is a ControllerError."""
        t0 = time.monotonic()
        code = getattr(self._need(), name)()
        if code not in (0, None):
            self.errors += 1
            raise ControllerError(f"go2: {name} returned {code}")
        log.info("go2: %s done in %.2fs", name, time.monotonic() - t0)

    def _stand_up(self) -> None:
        self._call("RecoveryStand")
        self._call("BalanceStand")
        self._await_stance()

    def _await_stance(self) -> None:
        state = self._wait_state(lambda s: s.mode not in LYING | LOCKED, self.stand_timeout_s)
        if state is None:
            last = self.state.get(1.0)
            raise ControllerError(
                f"go2: not balancing {self.stand_timeout_s:.0f} s after standing up (mode "
                f"{_mode_name(last.mode) if last is not None else 'unknown'})"
            )
        log.info("go2: balancing (mode %s): motion allowed", _mode_name(state.mode))

    def disconnect(self) -> None:
        self._close_subscribers()
        if self.client is not None:
            try:
                self.client.StopMove()
            finally:
                self.client = None

    def _close_subscribers(self) -> None:
        for sub in self._subscribers:
            sub.Close()
        self._subscribers = []

    @property
    def connected(self) -> bool:
        return self.client is not None

    def _need(self):
        if self.client is None:
            raise ControllerError("go2: not connected")
        return self.client

    def send_action(self, cmd: Command) -> Command:
        client = self._need()
        sent = cmd.clamped(self.max_vx, self.max_vy, self.max_wz)
        code = client.Move(sent.vx, sent.vy, sent.wz)
        if code not in (0, None):  # Move is send-and-forget; a code here is a local failure
            self.errors += 1
            log.warning("go2: Move returned %s", code)
        return sent

    def stop(self) -> None:
        code = self._need().StopMove()
        if code not in (0, None):
            self.errors += 1
            raise ControllerError(f"go2: StopMove returned {code}")

    def estop(self) -> None:
        client = self._need()
        code = client.Damp()
        if code not in (0, None):
            self.errors += 1
            log.error("go2: Damp returned %s; trying StopMove", code)
            client.StopMove()

    def reset(self) -> None:
        """After Damp the robot lies limp and ignores Move: stand it up before motion is allowed."""
        log.info("go2: reset after an e-stop: standing up")
        self._stand_up()


def _mode_name(mode: int) -> str:
    return f"{mode} {MODE_NAMES.get(mode, 'other')}"
