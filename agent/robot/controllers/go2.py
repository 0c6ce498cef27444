"""Unitree Go2 through unitree_sdk2py's SportClient (high-level sport mode over DDS).

    Move(vx, vy, vyaw)  send-and-forget; must be streamed at >= 10 Hz (the control loop
                        streams every tick; config refuses robot.control_hz < 10)
    StopMove()          the normal halt
    Damp()              the soft e-stop: joints go limp, the robot sinks (xr_teleoperate #331)
    RecoveryStand()     from lying (or after Damp) back onto its feet, joints locked
    BalanceStand()      standing and balancing: the stance in which Move is obeyed

Every call but Move waits for the robot's reply, up to `timeout_s` (the SDK's
SetTimeout, 10 s here as in Unitree's examples): the safety layer never makes
them on the control loop (agent/robot/safety.py). Move waits too, in the real SDK:
its DDS write waits (up to the same timeout) while no reader of the robot's request
topic is matched, that is while the robot is off the network. So `send_action` never
calls Move: it leaves the set-point in a latest-only slot that a thread of its own
(`go2-move`) streams; the control loop and the safety lock never wait for the robot.
A set-point waiting behind a stuck Move is replaced by the newer one (never queued),
and while the robot is unreachable `move_stalled_s` says for how long.

`connect()` checks that the sport service is on (the motion switcher names a
mode; after low-level control it names none and Move does nothing), waits for
the robot's state on `rt/sportmodestate`, and stands the robot up when it lies
or is damped. `reset()` after an e-stop stands it up again: RecoveryStand, then
BalanceStand; each step is logged.

The robot's range finder (`rt/utlidar/range_info`: the nearest obstacle ahead,
left and right, in point.x, .y and .z as Unitree's own obstacle avoidance and
community drivers read it) is the safety layer's range source.

Shutdown is bounded: `disconnect()` gives its last StopMove and the move thread
`close_timeout_s` (1 s) and goes on, so a robot that is gone cannot hold the unit
past systemd's TimeoutStopSec. A wrong `network_interface` (or DDS that cannot start)
is a one-line ControllerError, not the SDK's bare Exception.

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
    "unitree_sdk2py is not installed: `make setup-robot` installs it with CycloneDDS (pip: the project's "
    "`go2` extra, unitree-sdk2py-dimos and cyclonedds; `make setup-robot CYCLONEDDS_HOME=...` for Unitree's "
    "pinned cyclonedds 0.10.2 built against the C library)"
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


def init_channel(network_interface: str | None, domain_id: int = 0) -> None:
    """ChannelFactoryInitialize once per process (the DDS participant is a singleton).

    The Go2 speaks on DDS domain 0; another domain only keeps tests that share a machine apart.
    A failure is one ControllerError line: the SDK raises a bare Exception ("channel factory init
    error.") for a wrong interface, and cyclonedds its own errors when DDS cannot start."""
    global _channel_ready
    try:
        from unitree_sdk2py.core.channel import ChannelFactoryInitialize
    except ImportError as e:
        raise ControllerError(f"{INSTALL_HINT} ({e})") from None
    with _channel_lock:
        if _channel_ready:
            return
        where = f"network interface {network_interface!r}" if network_interface else "the default interface"
        try:
            if network_interface:
                ChannelFactoryInitialize(domain_id, network_interface)
            else:
                ChannelFactoryInitialize(domain_id)
        except Exception as e:  # the SDK's bare Exception, cyclonedds' DDSException
            raise ControllerError(
                f"go2: DDS did not start on {where} (domain {domain_id}): {e} - check "
                f"robot.options.network_interface (`ip link` lists the interfaces; the Go2's is the one "
                f"on 192.168.123.x)"
            ) from None
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


class MoveStream:
    """The thread that sends Move: the newest set-point only, never from the caller's thread.

    `put` never waits. The thread sends each new set-point once (the control loop re-puts it every
    tick, so the robot gets Move at the loop's rate); a set-point that comes while a Move is stuck
    (no robot on the network) replaces the waiting one, so the first Move after the robot returns is
    the newest (a zero after a stop or an e-stop).
    """

    def __init__(self, move: Callable[[float, float, float], Any]):
        self._move = move
        self._cond = threading.Condition()
        self._next: Command | None = None  # the set-point not sent yet (None: nothing new)
        self._since: float | None = None  # when the Move in progress began
        self._closed = False
        self.errors = 0  # non-zero codes (RPC_ERR_CLIENT_SEND: no robot matched within the timeout)
        self._thread = threading.Thread(target=self._run, name="go2-move", daemon=True)
        self._thread.start()

    def put(self, cmd: Command) -> None:
        with self._cond:
            self._next = cmd
            self._cond.notify()

    def stalled_s(self) -> float:
        """How long the Move in progress has waited (0 when none waits): the robot's unreachability."""
        with self._cond:
            since = self._since
        return 0.0 if since is None else time.monotonic() - since

    def close(self, timeout_s: float) -> bool:
        """Send what is waiting (at most timeout_s), then stop; False when a Move was still stuck."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def _run(self) -> None:
        while True:
            with self._cond:
                while self._next is None and not self._closed:
                    self._cond.wait()
                cmd, self._next = self._next, None
                if cmd is None:  # closed with nothing left to send
                    return
                self._since = time.monotonic()
            try:
                code = self._move(cmd.vx, cmd.vy, cmd.wz)
            except Exception as e:  # the SDK's own failure: counted and said, the thread goes on
                code = f"{type(e).__name__}: {e}"
            with self._cond:
                self._since = None
            if code not in (0, None):
                self.errors += 1
                if self.errors == 1 or self.errors % 100 == 0:
                    log.warning("go2: Move failed (%s; %d so far): is the robot on the network?", code, self.errors)


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
        close_timeout_s: float = 1.0,
        domain_id: int = 0,
    ):
        if isinstance(domain_id, bool) or not isinstance(domain_id, int) or not 0 <= domain_id <= 232:
            raise ValueError(f"go2: domain_id must be a DDS domain 0..232 (the robot's is 0), got {domain_id!r}")
        self.network_interface = network_interface
        self.domain_id = domain_id
        self.close_timeout_s = close_timeout_s  # disconnect's last StopMove and Move wait at most this
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
        self._mover: MoveStream | None = None
        self.errors = 0  # non-zero return codes from the SDK

    def connect(self) -> None:
        init_channel(self.network_interface, self.domain_id)
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
        self._mover = MoveStream(client.Move)
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
        """A last zero Move and StopMove, each given close_timeout_s at most (a robot that is gone
        would hold them 10 s each), then the subscribers close."""
        client, mover = self.client, self._mover
        self.client, self._mover = None, None
        if mover is not None:
            mover.put(Command())
            if not mover.close(self.close_timeout_s):
                log.warning("go2: the last Move did not go out in %.1fs (robot unreachable)", self.close_timeout_s)
        if client is not None:
            done = threading.Event()

            def last_stop() -> None:
                try:
                    client.StopMove()
                finally:
                    done.set()

            threading.Thread(target=last_stop, name="go2-last-stop", daemon=True).start()
            if not done.wait(self.close_timeout_s):
                log.warning("go2: StopMove unanswered after %.1fs at disconnect; going on", self.close_timeout_s)
        self._close_subscribers()

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
        """Hand the set-point to the move thread; never waits (the real Move does, for a robot that is gone)."""
        self._need()
        assert self._mover is not None  # made with the client
        sent = cmd.clamped(self.max_vx, self.max_vy, self.max_wz)
        self._mover.put(sent)
        return sent

    def odometry(self) -> tuple[float, float, float, float, float, float] | None:
        """The robot's rt/sportmodestate: position and yaw (imu_state.rpy[2]) in its odometry frame, which starts
        where it was switched on, and its velocity turned into the body frame; None without a fresh state."""
        state = self.state.get(0.5)
        if state is None:
            return None
        x, y = float(state.position[0]), float(state.position[1])
        th = float(state.imu_state.rpy[2])
        vx, vy = float(state.velocity[0]), float(state.velocity[1])  # in the odometry frame
        c, s = math.cos(th), math.sin(th)
        return (x, y, th, c * vx + s * vy, -s * vx + c * vy, float(state.yaw_speed))

    def move_stalled_s(self) -> float:
        """How long the Move in progress has waited for the robot (0: none waits)."""
        mover = self._mover
        return 0.0 if mover is None else mover.stalled_s()

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
