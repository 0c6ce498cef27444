"""A simulated Go2 that speaks Unitree's own API over DDS: the robot's side of unitree_sdk2py.

    python -m agent.robot.go2_sim --scene red_box --interface lo

One process, one DDS participant (domain 0 unless --domain says otherwise, on the named interface
only), serving what the `go2` controller and the `go2` camera ask of a real Go2, with the SDK's own
RPC server classes (unitree_sdk2py.rpc.server.Server) and publishers:

    service "sport"            Move, StopMove, Damp, BalanceStand, RecoveryStand, StandUp, StandDown
    service "motion_switcher"  CheckMode ({"name": "normal"}, or "" when --no-sport: sport mode released)
    service "videohub"         GetImageSample: a JPEG of the front camera, rendered by the simulator
    rt/sportmodestate          mode, position, velocity, yaw (imu_state.rpy[2]), yaw_speed, at 50 Hz
    rt/utlidar/range_info      the range finder: the free distance ahead (point.x), left (.y), right (.z)

The robot is agent.robot.sim's SimWorld in a shipped scene (or a scene file). It obeys Move as the
Go2 does: clamped to the sport mode's ranges (vx -2.5..3.8 m/s, vy -1..1 m/s, vyaw -4..4 rad/s),
stopped by itself ~1 s after the last Move (the world's auto_stop_s), ignored unless it stands
(balance stand or locomotion); Damp makes it limp (mode 7: it sinks and ignores Move) until
RecoveryStand (mode 8, joints locked) and BalanceStand (mode 1).

Position and yaw are in the scene's frame (the real robot's odometry starts where it was switched
on; here that is the scene's origin), which is what `/odom` in a recording shows.

Faults on demand, one command per line on stdin (the tests' way to make the robot misbehave):

    hang        the services stop answering (every request waits, as a stuck robot's do)
    answer      they answer again (what waited is answered now)
    delay S     each answer comes S seconds late
    mode N      the robot's mode becomes N (5: lying down; 7: damped)
    sport NAME  the motion switcher's mode name ("" : released, as after low-level control)
    start N     the robot back at the scene's start N, standing, collisions counted from 0
    pose X Y TH the robot put at (X, Y) m facing TH rad, standing (as start does)
    report      one line "report {json}": pose, mode, collisions, the distance to each object
    quit        leave (as does SIGTERM or the end of stdin): the robot is gone from the network

Each command is answered "ok <command>" on stdout, after "ready" once everything serves.

One fix to the SDK in passing: its Server keeps the ids of binary APIs in a dict (`{}`) and calls
`.add` on it, so registering one (videohub's GetImageSample) raises; `_Service` gives it a set.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import signal
import sys
import threading
import time
from typing import Any, Callable

from agent.robot.controllers.base import Command
from agent.robot.sim import SimWorld, make_world

log = logging.getLogger("go2_sim")

# the sport API's ids (unitree_sdk2py/go2/sport/sport_api.py) and the others the drivers use
DAMP, BALANCE_STAND, STOP_MOVE, STAND_UP, STAND_DOWN, RECOVERY_STAND, MOVE = 1001, 1002, 1003, 1004, 1005, 1006, 1008
CHECK_MODE = 1001  # motion_switcher
GET_IMAGE_SAMPLE = 1001  # videohub
# SportModeState_.mode
BALANCE, LOCOMOTION, LIE_DOWN, JOINT_LOCK, DAMPING, RECOVERY = 1, 3, 5, 6, 7, 8
STANDING = {BALANCE, LOCOMOTION}  # the modes in which Move is obeyed
STATE_HZ = 50.0
RANGE_HZ = 20.0
RANGE_MAX_M = 5.0  # the range finder's reach: farther reads as this


class Faults:
    """What the tests ask of the robot: answers held (hang) or late (delay)."""

    def __init__(self) -> None:
        self.answering = threading.Event()
        self.answering.set()
        self.delay_s = 0.0

    def gate(self) -> None:
        """Called before every answer: waits while hung, then the delay."""
        self.answering.wait()
        if self.delay_s > 0:
            time.sleep(self.delay_s)


class SimGo2:
    """The robot: the world, its mode and the sport API's effect on them."""

    def __init__(self, world: SimWorld, sport: str = "normal", mode: int = BALANCE):
        self.world = world
        self.sport = sport
        self.mode = mode
        self.lock = threading.Lock()
        self.calls: dict[str, int] = {}

    def _count(self, name: str) -> None:
        self.calls[name] = self.calls.get(name, 0) + 1

    def move(self, vx: float, vy: float, wz: float) -> int:
        with self.lock:
            self._count("Move")
            if self.mode not in STANDING:
                return 0  # the real robot ignores Move unless it stands; Move has no reply to carry a code
            cmd = Command(max(-2.5, min(3.8, vx)), max(-1.0, min(1.0, vy)), max(-4.0, min(4.0, wz)))
            self.world.set_velocity(cmd)
            self.mode = LOCOMOTION if cmd != Command() else BALANCE
            return 0

    def call(self, name: str) -> int:
        with self.lock:
            self._count(name)
            if name == "StopMove":
                self.world.set_velocity(Command())
                if self.mode == LOCOMOTION:
                    self.mode = BALANCE
            elif name == "Damp":
                self.world.set_velocity(Command())
                self.world.damped = True
                self.mode = DAMPING
            elif name in ("RecoveryStand", "StandUp"):
                self.world.damped = False
                self.mode = RECOVERY if name == "RecoveryStand" else JOINT_LOCK
            elif name == "BalanceStand":
                if self.mode in (LIE_DOWN, DAMPING):
                    return 4202  # not on its feet: the sport service refuses (SPORT_ERR_SERVER_NOT_INIT's code)
                self.mode = BALANCE
            elif name == "StandDown":
                self.world.set_velocity(Command())
                self.mode = LIE_DOWN
            return 0


def _service(name: str, handlers: dict[int, Callable[[str], tuple[int, str]]], binary: dict | None = None):
    """One of the SDK's own RPC servers with the given JSON (and binary) handlers, started."""
    from unitree_sdk2py.rpc.server import Server

    class _Service(Server):
        def __init__(self) -> None:
            super().__init__(name)
            self._Server__apiBinarySet: set[int] = set()  # the SDK's bug: a dict, whose .add raises

        def Init(self) -> None:
            self._SetApiVersion("1.0.0.1")
            for api_id, fn in handlers.items():
                self._RegistHandler(api_id, fn, False)
            for api_id, fn in (binary or {}).items():
                self._RegistBinaryHandler(api_id, fn, False)

    server = _Service()
    server.Init()
    server.Start(False)
    return server


def serve(robot: SimGo2, faults: Faults, camera_size: tuple[int, int] = (320, 240)) -> list:
    """Start the three services; returns them (they live as long as the process)."""
    import cv2

    def sport_call(call: str) -> Callable[[str], tuple[int, str]]:
        def handle(parameter: str) -> tuple[int, str]:
            faults.gate()
            return robot.call(call), ""

        return handle

    def move(parameter: str) -> tuple[int, str]:
        faults.gate()  # a hung robot handles nothing, its Move neither
        p = json.loads(parameter or "{}")
        return robot.move(float(p.get("x", 0.0)), float(p.get("y", 0.0)), float(p.get("z", 0.0))), ""

    def check_mode(parameter: str) -> tuple[int, str]:
        faults.gate()
        return 0, json.dumps({"name": robot.sport, "form": "0"})

    def image_sample(parameter: list) -> tuple[int, list]:
        faults.gate()
        image = robot.world.render_camera(*camera_size)
        ok, jpeg = cv2.imencode(".jpg", image, [cv2.IMWRITE_JPEG_QUALITY, 80])
        return (0, list(jpeg.tobytes())) if ok else (3202, [])

    sport = {
        DAMP: sport_call("Damp"),
        BALANCE_STAND: sport_call("BalanceStand"),
        STOP_MOVE: sport_call("StopMove"),
        STAND_UP: sport_call("StandUp"),
        STAND_DOWN: sport_call("StandDown"),
        RECOVERY_STAND: sport_call("RecoveryStand"),
        MOVE: move,
    }
    return [
        _service("sport", sport),
        _service("motion_switcher", {CHECK_MODE: check_mode}),
        _service("videohub", {}, {GET_IMAGE_SAMPLE: image_sample}),
    ]


class Publisher:
    """rt/sportmodestate at STATE_HZ and rt/utlidar/range_info at RANGE_HZ, from the world's state."""

    def __init__(self, robot: SimGo2):
        from unitree_sdk2py.core.channel import ChannelPublisher
        from unitree_sdk2py.idl.geometry_msgs.msg.dds_ import PointStamped_
        from unitree_sdk2py.idl.unitree_go.msg.dds_ import SportModeState_

        self.robot = robot
        self.state = ChannelPublisher("rt/sportmodestate", SportModeState_)
        self.state.Init()
        self.range = ChannelPublisher("rt/utlidar/range_info", PointStamped_)
        self.range.Init()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="go2-sim-publish", daemon=True)

    def start(self) -> "Publisher":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(1.0)

    def state_msg(self) -> Any:
        from unitree_sdk2py.idl.default import unitree_go_msg_dds__SportModeState_

        world = self.robot.world
        x, y, th = world.pose
        v = world.velocity  # body frame
        msg = unitree_go_msg_dds__SportModeState_()
        now = time.time()
        msg.stamp.sec, msg.stamp.nanosec = int(now), int((now % 1) * 1e9)
        msg.mode = self.robot.mode
        msg.position = [x, y, 0.0]
        msg.body_height = 0.0 if self.robot.mode in (LIE_DOWN, DAMPING) else 0.32
        # velocity in the odometry frame, as the robot reports it
        msg.velocity = [v.vx * math.cos(th) - v.vy * math.sin(th), v.vx * math.sin(th) + v.vy * math.cos(th), 0.0]
        msg.yaw_speed = v.wz
        msg.imu_state.rpy = [0.0, 0.0, th]
        msg.imu_state.quaternion = [math.cos(th / 2), 0.0, 0.0, math.sin(th / 2)]  # w, x, y, z
        return msg

    def range_msg(self) -> Any:
        from unitree_sdk2py.idl.default import geometry_msgs_msg_dds__PointStamped_

        world = self.robot.world
        msg = geometry_msgs_msg_dds__PointStamped_()
        msg.point.x, msg.point.y, msg.point.z = (
            min(RANGE_MAX_M, world.clearance_m(h)) for h in (0.0, math.pi / 2, -math.pi / 2)
        )
        return msg

    def _run(self) -> None:
        period, every = 1.0 / STATE_HZ, max(1, round(STATE_HZ / RANGE_HZ))
        n, next_t = 0, time.monotonic()
        while not self._stop.is_set():
            self.state.Write(self.state_msg())
            if n % every == 0:
                self.range.Write(self.range_msg())
            n += 1
            next_t += period
            self._stop.wait(max(0.0, next_t - time.monotonic()))


def report(robot: SimGo2) -> dict:
    """What a test asks of the episode: where the robot is, in what mode, how often it hit something."""
    world = robot.world
    x, y, th = world.pose
    return {
        "pose": [round(x, 3), round(y, 3), round(th, 3)],
        "mode": robot.mode,
        "collisions": world.collisions,
        "distance_m": {o.name: round(world.distance_to(o.name), 3) for o in world.objects},
        "calls": dict(robot.calls),
    }


def command(line: str, robot: SimGo2, faults: Faults) -> bool:
    """One stdin command; False for quit."""
    word, _, arg = line.strip().partition(" ")
    if word == "quit":
        return False
    if word == "hang":
        faults.answering.clear()
    elif word == "answer":
        faults.answering.set()
    elif word == "delay":
        faults.delay_s = max(0.0, float(arg))
    elif word == "mode":
        with robot.lock:
            robot.mode = int(arg)
            robot.world.damped = robot.mode in (LIE_DOWN, DAMPING)
    elif word == "sport":
        robot.sport = arg.strip().strip('"')
    elif word in ("start", "pose"):
        with robot.lock:
            world = robot.world
            if word == "start":
                assert world.spec is not None  # made from a scene
                world.restart(world.spec.starts[int(arg)], int(arg))
            else:
                x, y, th = (float(v) for v in arg.split())
                world.restart((x, y, th))
            world.damped, robot.mode = False, BALANCE
    elif word == "report":
        print("report " + json.dumps(report(robot)), flush=True)
    elif word:
        print(f"error unknown command {word!r}", flush=True)
        return True
    print(f"ok {line.strip()}", flush=True)
    return True


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scene", default="red_box", help="a shipped scene's name or a scene file")
    ap.add_argument("--start", type=int, default=0, help="which of the scene's starts")
    ap.add_argument("--interface", default="lo", help="the network interface DDS is bound to (lo: this machine)")
    ap.add_argument("--domain", type=int, default=0, help="the DDS domain (the Go2's is 0)")
    ap.add_argument("--mode", type=int, default=BALANCE, help="the mode it starts in (1 standing, 5 lying)")
    ap.add_argument("--no-sport", action="store_true", help="the motion switcher names no mode (sport mode off)")
    ap.add_argument("--camera-size", default="320x240", help="the front camera's JPEG size, WxH")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s go2-sim %(levelname)s %(message)s")
    from unitree_sdk2py.core.channel import ChannelFactoryInitialize

    ChannelFactoryInitialize(args.domain, args.interface)
    world = make_world(args.scene, start=args.start)
    robot = SimGo2(world, sport="" if args.no_sport else "normal", mode=args.mode)
    world.damped = robot.mode in (LIE_DOWN, DAMPING)
    faults = Faults()
    w, h = (int(v) for v in args.camera_size.lower().split("x"))
    services = serve(robot, faults, (w, h))
    publisher = Publisher(robot).start()
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    log.info("serving scene %s on %s, DDS domain %d", world.scene, args.interface, args.domain)
    print("ready", flush=True)

    def read_stdin() -> None:
        for line in sys.stdin:
            if not command(line, robot, faults):
                break
        done.set()

    threading.Thread(target=read_stdin, name="go2-sim-stdin", daemon=True).start()
    try:
        done.wait()
    except KeyboardInterrupt:
        pass
    publisher.stop()
    log.info("leaving: calls %s, collisions %d", robot.calls, world.collisions)
    leave_network()
    del services
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # the SDK's server threads never end: leave without them (the robot is switched off)


def leave_network() -> None:
    """Delete the DDS participant and domain, with every reader and writer in them: the peers see the robot
    go at once (the SDK's writers find no reader, as when a robot is switched off; a pulled cable shows the
    same once the participant's lease runs out, ~10 s)."""
    from unitree_sdk2py.core.channel import ChannelFactory

    for name in ("_ChannelFactory__participant", "_ChannelFactory__domain"):
        entity = getattr(ChannelFactory, name, None)
        if entity is not None:
            entity._delete(entity._ref)


if __name__ == "__main__":
    sys.exit(main())
