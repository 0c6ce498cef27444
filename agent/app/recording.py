"""Runs recorded as MCAP and served live to Foxglove: each step's frame, perception, answer, action, command,
pose, path, safety stops and link mode as ROS 2 messages (CDR), which Foxglove, rosbags and `ros2 bag` read.

    step_messages(sample, prev_stops)   one step -> [(topic, message dict)]           (pure)
    Recorder(path, foxglove=...)        .record(sample) per step, .close(); an MCAP file (`--record`),
                                        a live Foxglove source (`--foxglove HOST:PORT`, live.py), or both

The channels (docs/guide/recording.md; deploy/foxglove/edgespec-layout.json lays them out):

    /camera/image/compressed  sensor_msgs/msg/CompressedImage  the JPEG the step looked at (none on a step
                                                               that had no fresh frame)
    /perception               std_msgs/msg/String  JSON: the perception kind, the sightings, the observation text
    /instruction              std_msgs/msg/String  the instruction
    /answer                   std_msgs/msg/String  JSON: the model's text and whether the target verified it
    /action                   std_msgs/msg/String  JSON: the parsed action, how it parsed, the offline envelope
    /cmd_vel                  geometry_msgs/msg/Twist  the first set-point sent (after the safety layer's clamps)
    /pose, /path              geometry_msgs/msg/PoseStamped, nav_msgs/msg/Path  in frame "map" (the simulator's;
                                                               none on a robot without a pose source)
    /tf                       tf2_msgs/msg/TFMessage  REP-105's map -> odom -> base_link, and base_link -> camera
    /odom                     nav_msgs/msg/Odometry  the robot's odometry (frame odom, child base_link): the
                                                     Go2's rt/sportmodestate, the simulator's pose and velocity
    /safety                   std_msgs/msg/String  JSON: the stops so far, this step's, its interventions
                                                   (INTERVENTIONS: the safety layer's own), the clearance
    /link                     std_msgs/msg/String  verified | offline | halted (no answer: no fresh frame)
    /step                     std_msgs/msg/String  JSON: the whole telemetry record

Every message of a step carries the step's start time (wall clock) as its log time, made strictly
increasing from step to step so a clock stepped back by NTP cannot reorder the file. The file is a flight
recorder: each step reaches the OS before the next (fsynced at least every second), so a run killed by
SIGKILL reads back every step but the one it was writing. It is bounded: a step that would take it past
`max_bytes` stops the recording with a warning and the file is closed readable. A write error (a full or
read-only disk) stops that sink with one warning and never stops the robot. The live view needs a credential
and lists the browser Origins it lets in (agent/app/live.py). The packages are an extra (`pip install
'edgespec[record]'`): RecordingError says so when missing.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from .telemetry import DiskTrouble

log = logging.getLogger(__name__)

MAX_PATH_POSES = 2000  # /path holds the last this many poses (the simulator keeps up to 20000)
FRAME = "map"  # the frame of /pose and /path
ODOM_FRAME, BASE_FRAME = "odom", "base_link"  # REP-105
CAMERA_FRAME = "camera"
CAMERA_HEIGHT_M = 0.3  # base_link -> camera: the simulator's camera height (a Go2's front camera is near it)

_TIME = "int32 sec\nuint32 nanosec\n"
_HEADER = "builtin_interfaces/Time stamp\nstring frame_id\n"
_VECTOR3 = "float64 x\nfloat64 y\nfloat64 z\n"
_QUATERNION = "float64 x\nfloat64 y\nfloat64 z\nfloat64 w\n"
_POSE = "geometry_msgs/Point position\ngeometry_msgs/Quaternion orientation\n"
_POSE_STAMPED = "std_msgs/Header header\ngeometry_msgs/Pose pose\n"


def _msgdef(text: str, *deps: tuple[str, str]) -> str:
    """A ROS 2 concatenated message definition, as rosbag2 writes it in an MCAP schema: the type's own
    text, then each type it uses after a line of 80 '=' and `MSG: pkg/Type`."""
    return text + "".join(f"{'=' * 80}\nMSG: {name}\n{body}" for name, body in deps)


_STAMPED = (("std_msgs/Header", _HEADER), ("builtin_interfaces/Time", _TIME))
_POSE_DEPS = (
    ("geometry_msgs/Pose", _POSE),
    ("geometry_msgs/Point", _VECTOR3),
    ("geometry_msgs/Quaternion", _QUATERNION),
)
_TRANSFORM_STAMPED = "std_msgs/Header header\nstring child_frame_id\ngeometry_msgs/Transform transform\n"
_TRANSFORM_DEPS = (
    ("geometry_msgs/Transform", "geometry_msgs/Vector3 translation\ngeometry_msgs/Quaternion rotation\n"),
    ("geometry_msgs/Vector3", _VECTOR3),
    ("geometry_msgs/Quaternion", _QUATERNION),
)
MSGDEFS = {
    "sensor_msgs/msg/CompressedImage": _msgdef("std_msgs/Header header\nstring format\nuint8[] data\n", *_STAMPED),
    "std_msgs/msg/String": "string data\n",
    "geometry_msgs/msg/Twist": _msgdef(
        "geometry_msgs/Vector3 linear\ngeometry_msgs/Vector3 angular\n", ("geometry_msgs/Vector3", _VECTOR3)
    ),
    "geometry_msgs/msg/PoseStamped": _msgdef(_POSE_STAMPED, *_STAMPED, *_POSE_DEPS),
    "nav_msgs/msg/Path": _msgdef(
        "std_msgs/Header header\ngeometry_msgs/PoseStamped[] poses\n",
        *_STAMPED,
        ("geometry_msgs/PoseStamped", _POSE_STAMPED),
        *_POSE_DEPS,
    ),
    "tf2_msgs/msg/TFMessage": _msgdef(
        "geometry_msgs/TransformStamped[] transforms\n",
        ("geometry_msgs/TransformStamped", _TRANSFORM_STAMPED),
        *_STAMPED,
        *_TRANSFORM_DEPS,
    ),
    "nav_msgs/msg/Odometry": _msgdef(
        "std_msgs/Header header\nstring child_frame_id\ngeometry_msgs/PoseWithCovariance pose\n"
        "geometry_msgs/TwistWithCovariance twist\n",
        *_STAMPED,
        ("geometry_msgs/PoseWithCovariance", "geometry_msgs/Pose pose\nfloat64[36] covariance\n"),
        *_POSE_DEPS,
        ("geometry_msgs/TwistWithCovariance", "geometry_msgs/Twist twist\nfloat64[36] covariance\n"),
        ("geometry_msgs/Twist", "geometry_msgs/Vector3 linear\ngeometry_msgs/Vector3 angular\n"),
        ("geometry_msgs/Vector3", _VECTOR3),
    ),
}
CHANNELS = {  # topic -> its ROS 2 type, in the order a step writes them
    "/camera/image/compressed": "sensor_msgs/msg/CompressedImage",
    "/perception": "std_msgs/msg/String",
    "/instruction": "std_msgs/msg/String",
    "/answer": "std_msgs/msg/String",
    "/action": "std_msgs/msg/String",
    "/cmd_vel": "geometry_msgs/msg/Twist",
    "/pose": "geometry_msgs/msg/PoseStamped",
    "/path": "nav_msgs/msg/Path",
    "/tf": "tf2_msgs/msg/TFMessage",
    "/odom": "nav_msgs/msg/Odometry",
    "/safety": "std_msgs/msg/String",
    "/link": "std_msgs/msg/String",
    "/step": "std_msgs/msg/String",
}
# the safety layer's own stops (agent/robot/safety.py, control.py), as against a plan's ends (motion_done, ...)
INTERVENTIONS = frozenset(
    ("obstacle", "deadman", "stale_frame", "estop", "estop_latched", "non_finite_command", "controller_fault")
)
# a message every step, whatever the robot: the camera's is missing on a step without a frame, the pose's and
# the path's without a pose source, the frames' and the odometry's without a pose or odometry source
EVERY_STEP = tuple(t for t in CHANNELS if t not in ("/camera/image/compressed", "/pose", "/path", "/tf", "/odom"))


class RecordingError(ValueError):
    """Recording cannot start: its packages are not installed, the file cannot be written, or the Foxglove
    server cannot listen there."""


@dataclass(frozen=True)
class StepSample:
    """One step as recorded: what the daemon knows once the step is done."""

    step: dict  # agent.app.navigator.Step.to_json(): instruction, text, mode, action, command, ...
    jpeg: bytes | None = None  # the frame the step looked at, JPEG; None when it had none (a refused step)
    frame_t: float | None = None  # that frame's capture time, wall clock (s)
    sightings: list[dict] = field(default_factory=list)  # what perception found in it
    pose: tuple[float, float, float] | None = None  # (x, y, theta) in FRAME after the step; None: no pose source
    path: list[tuple[float, float, float, float]] = field(default_factory=list)  # (t, x, y, theta) so far
    stops: dict = field(default_factory=dict)  # the safety layer's stops so far, reason -> count
    clearance_m: float | None = None  # the safety layer's last range reading in the direction of travel
    # the robot's odometry after the step: (x, y, theta) in ODOM_FRAME and (vx, vy, wz) in the body frame;
    # None: the controller has none (then /tf uses `pose` as odometry too, map -> odom the identity)
    odom: tuple[float, float, float, float, float, float] | None = None


def _stamp(t: float) -> dict:
    ns = int(round(t * 1e9))
    return {"sec": ns // 1_000_000_000, "nanosec": ns % 1_000_000_000}


def _pose(x: float, y: float, theta: float) -> dict:
    """A planar pose: the yaw theta as the quaternion (0, 0, sin(theta/2), cos(theta/2))."""
    return {
        "position": {"x": float(x), "y": float(y), "z": 0.0},
        "orientation": {"x": 0.0, "y": 0.0, "z": math.sin(theta / 2), "w": math.cos(theta / 2)},
    }


def _text(obj: Any) -> dict:
    return {"data": obj if isinstance(obj, str) else json.dumps(obj, separators=(",", ":"), default=str)}


def step_messages(sample: StepSample, prev_stops: dict | None = None) -> list[tuple[str, dict]]:
    """The step's messages, (topic, message as a dict of the topic's ROS 2 type), in CHANNELS' order.
    prev_stops: the safety layer's stops after the step before (this step's interventions are the difference)."""
    s, t = sample.step, float(sample.step["t"])
    out: list[tuple[str, dict]] = []
    if sample.jpeg is not None:
        header = {"stamp": _stamp(sample.frame_t or t), "frame_id": CAMERA_FRAME}
        out.append(("/camera/image/compressed", {"header": header, "format": "jpeg", "data": sample.jpeg}))
    perception = {"kind": s["perception"], "sightings": sample.sightings, "observation": s["observation"]}
    verified = s["mode"] == "verified" and s["unverified_tokens"] == 0 and bool(s["text"])
    answer = {"text": s["text"], "verified": verified, "mode": s["mode"], "verified_tokens": s["verified_tokens"]}
    answer["unverified_tokens"] = s["unverified_tokens"]
    action = {k: s[k] for k in ("action", "action_text", "parse", "parse_note", "envelope", "completed", "reason")}
    cmd = s["command"]
    twist = {"linear": {"x": cmd["vx"], "y": cmd["vy"], "z": 0.0}, "angular": {"x": 0.0, "y": 0.0, "z": cmd["wz"]}}
    out += [
        ("/perception", _text(perception)),
        ("/instruction", _text(s["instruction"])),
        ("/answer", _text(answer)),
        ("/action", _text(action)),
        ("/cmd_vel", twist),
    ]
    if sample.pose is not None:
        head = {"stamp": _stamp(t), "frame_id": FRAME}
        out.append(("/pose", {"header": head, "pose": _pose(*sample.pose)}))
        poses = [
            {"header": {"stamp": _stamp(pt), "frame_id": FRAME}, "pose": _pose(x, y, th)}
            for pt, x, y, th in sample.path[-MAX_PATH_POSES:]
        ]
        out.append(("/path", {"header": head, "poses": poses}))
    out += frame_messages(sample.pose, sample.odom, t)
    prev = prev_stops or {}
    new = {k: n - prev.get(k, 0) for k, n in sample.stops.items() if n > prev.get(k, 0)}
    interventions = {k: n for k, n in new.items() if k in INTERVENTIONS}
    safety: dict[str, Any] = {"stops": sample.stops, "this_step": new, "interventions": interventions}
    safety["clearance_m"] = sample.clearance_m
    out += [
        ("/safety", _text(safety)),
        ("/link", _text(s["mode"])),
        ("/step", _text(s)),
    ]
    return out


def _transform(t: float, parent: str, child: str, x: float, y: float, z: float, theta: float) -> dict:
    q = _pose(x, y, theta)["orientation"]
    return {
        "header": {"stamp": _stamp(t), "frame_id": parent},
        "child_frame_id": child,
        "transform": {"translation": {"x": float(x), "y": float(y), "z": float(z)}, "rotation": q},
    }


def frame_messages(
    pose: tuple[float, float, float] | None, odom: tuple[float, ...] | None, t: float
) -> list[tuple[str, dict]]:
    """/tf and /odom (REP-105) from the pose in the map and the odometry; none when there is neither.

    odom -> base_link is the odometry (the pose where there is none). map -> odom is what the map pose corrects
    of it: T(map, odom) = T(map, base) * T(odom, base)^-1, planar (rotate by dth = th_map - th_odom, then
    translate so the odometry's position lands on the map's); the identity without a map pose.
    """
    if odom is None and pose is None:
        return []
    ox, oy, oth, vx, vy, wz = odom if odom is not None else (*pose, 0.0, 0.0, 0.0)  # type: ignore[misc]
    mx, my, mth = pose if pose is not None else (ox, oy, oth)
    dth = mth - oth
    c, s = math.cos(dth), math.sin(dth)
    tx, ty = mx - (c * ox - s * oy), my - (s * ox + c * oy)
    tf = {
        "transforms": [
            _transform(t, FRAME, ODOM_FRAME, tx, ty, 0.0, dth),
            _transform(t, ODOM_FRAME, BASE_FRAME, ox, oy, 0.0, oth),
            _transform(t, BASE_FRAME, CAMERA_FRAME, 0.0, 0.0, CAMERA_HEIGHT_M, 0.0),
        ]
    }
    zero36 = [0.0] * 36  # no covariance estimate
    twist = {"linear": {"x": float(vx), "y": float(vy), "z": 0.0}, "angular": {"x": 0.0, "y": 0.0, "z": float(wz)}}
    odometry = {
        "header": {"stamp": _stamp(t), "frame_id": ODOM_FRAME},
        "child_frame_id": BASE_FRAME,
        "pose": {"pose": _pose(ox, oy, oth), "covariance": zero36},
        "twist": {"twist": twist, "covariance": zero36},
    }
    return [("/tf", tf), ("/odom", odometry)]


def _encoders() -> dict[str, Callable[[dict], bytes]]:
    """ROS 2 type -> its CDR encoder (mcap-ros2-support's, from the definitions above)."""
    try:
        from mcap_ros2._dynamic import serialize_dynamic
    except ImportError:
        raise RecordingError(
            "recording needs the packages mcap and mcap-ros2-support: pip install 'edgespec[record]'"
        ) from None
    return {name: serialize_dynamic(name, text)[name] for name, text in MSGDEFS.items()}


class McapSink:
    """An MCAP file of the channels (profile ros2, zstd), on the disk every step and closed readable at
    `max_bytes`.

    Crash-safe: every message is its own chunk (chunk_size=1: mcap's Writer writes a chunk as soon as it is
    over that size), so nothing waits in the writer's memory; each step is flushed to the OS (a SIGKILL loses
    nothing written) and fsynced at most every FSYNC_S (a power loss loses at most that). A file cut before
    its summary reads back with the mcap readers' own recovery (its chunks, in order, up to the cut)."""

    FSYNC_S = 1.0
    INDEX_BYTES = 160  # what one chunk adds to the summary at close (its chunk index), with room to spare

    def __init__(self, path: str, max_bytes: int) -> None:
        from mcap.writer import CompressionType, Writer

        self.path, self.max_bytes = path, max_bytes
        self._fh = open(path, "wb")
        self._writer = Writer(self._fh, chunk_size=1, compression=CompressionType.ZSTD)
        self._writer.start(profile="ros2", library="edgespec")
        self._channels: dict[str, int] = {}
        for topic, name in CHANNELS.items():
            schema = self._writer.register_schema(name, "ros2msg", MSGDEFS[name].encode())
            self._channels[topic] = self._writer.register_channel(topic, "cdr", schema)
        self._summary = 8192 + sum(len(d) for d in MSGDEFS.values())  # schemas, channels, statistics, footer
        self._synced = time.monotonic()
        self.full = False
        self.steps = 0

    def write(self, messages: list[tuple[str, bytes]], t_ns: int, seq: int) -> None:
        """One step's messages, all or none, then to the OS. A step that would take the file (with the summary
        its close writes) past max_bytes ends the recording: the file is closed readable at once."""
        if self.full:
            return
        step = sum(len(data) + self.INDEX_BYTES for _, data in messages)
        if self._fh.tell() + step + self._summary > self.max_bytes:
            self.full = True
            self.close()
            log.warning(
                "recording %s reached record.max_bytes (%d bytes) after %d steps: recording stopped, the file is "
                "closed readable",
                self.path,
                self.max_bytes,
                self.steps,
            )
            return
        for topic, data in messages:
            self._writer.add_message(self._channels[topic], log_time=t_ns, data=data, publish_time=t_ns, sequence=seq)
        self._summary += self.INDEX_BYTES * len(messages)
        self._fh.flush()
        now = time.monotonic()
        if now - self._synced >= self.FSYNC_S:
            os.fsync(self._fh.fileno())
            self._synced = now
        self.steps += 1

    def close(self) -> None:
        if self._fh.closed:
            return
        try:
            self._writer.finish()
            self._fh.flush()
            os.fsync(self._fh.fileno())
        finally:
            self._fh.close()

    def abandon(self) -> None:
        """After a write error (a full or read-only disk): let go of the file without writing more."""
        with contextlib.suppress(OSError):
            self._fh.close()  # its flush fails again, and it closes the descriptor all the same


class FoxgloveSink:
    """The channels served live to Foxglove (agent/app/live.py), to whom presents the credential."""

    def __init__(self, host: str, port: int, credential: str, origins: frozenset[str]) -> None:
        from .live import LiveServer

        channels = {topic: (name, MSGDEFS[name]) for topic, name in CHANNELS.items()}
        try:
            self.server = LiveServer(host, port, channels, credential=credential, origins=origins)
        except (OSError, ValueError) as e:  # an address in use, no credential
            raise RecordingError(
                f"cannot serve Foxglove on {host}:{port}: {getattr(e, 'strerror', None) or e}"
            ) from None

    @property
    def port(self) -> int:
        return self.server.port

    def write(self, messages: list[tuple[str, bytes]], t_ns: int, seq: int) -> None:
        self.server.publish(messages, t_ns)

    def close(self) -> None:
        self.server.close()

    abandon = close


class Recorder:
    """Steps to an MCAP file (`path`), a live Foxglove server (`foxglove` = (host, port)), or both.
    RecordingError when a package is missing, the file cannot be written or the server cannot start."""

    def __init__(
        self,
        path: str = "",
        *,
        max_bytes: int = 2 * 1024**3,
        foxglove: tuple[str, int] | None = None,
        foxglove_credential: str = "",
        foxglove_origins: frozenset[str] = frozenset(),
        disk: DiskTrouble | None = None,
    ) -> None:
        self._encode = _encoders()
        self._disk = disk or DiskTrouble()  # shared with the telemetry: one warning for a full disk
        self._lock = threading.Lock()
        self.sinks: list[Any] = []
        if path:
            try:
                self.sinks.append(McapSink(path, max_bytes))
            except OSError as e:
                raise RecordingError(f"cannot write the recording {path}: {e.strerror or e}") from None
        if foxglove is not None:
            try:
                self.sinks.append(FoxgloveSink(*foxglove, foxglove_credential, foxglove_origins))
            except RecordingError:
                self.close()
                raise
        self.steps = 0
        self.counts: dict[str, int] = dict.fromkeys(CHANNELS, 0)  # messages per topic (a full file drops the later)
        self._last_ns = 0
        self._stops: dict = {}
        self._failed = False

    def record(self, sample: StepSample) -> None:
        """Write one step to every sink; a failing sink is logged once and dropped, never raised."""
        with self._lock:
            t_ns = max(int(round(float(sample.step["t"]) * 1e9)), self._last_ns + 1)  # strictly increasing
            self._last_ns = t_ns
            try:
                messages = [(t, self._encode[CHANNELS[t]](msg)) for t, msg in step_messages(sample, self._stops)]
            except Exception:  # a value its type cannot hold: this step goes unrecorded
                log.exception("recording step %s failed", sample.step.get("step"))
                return
            self._stops = dict(sample.stops)
            for sink in list(self.sinks):
                try:
                    sink.write(messages, t_ns, self.steps)
                except OSError as e:  # a full or read-only disk: recording stops, the robot goes on
                    self._disk.stopped("recording", getattr(sink, "path", type(sink).__name__), e)
                    self.sinks.remove(sink)
                    sink.abandon()
                except Exception:  # a bug: that sink stops (closed readable), the robot goes on
                    log.exception("recording to %s failed; going on without it", type(sink).__name__)
                    self.sinks.remove(sink)
                    _close(sink, self._disk)
            for topic, _ in messages:
                self.counts[topic] += 1
            self.steps += 1

    @property
    def foxglove_port(self) -> int | None:
        """The port the Foxglove server listens on (the one chosen for port 0); None without one."""
        return next((sink.port for sink in self.sinks if isinstance(sink, FoxgloveSink)), None)

    def close(self) -> None:
        with self._lock:
            sinks, self.sinks = self.sinks, []
        for sink in sinks:
            _close(sink, self._disk)


def _close(sink: Any, disk: DiskTrouble | None = None) -> None:
    try:
        sink.close()
    except OSError as e:  # the disk filled at the very end: what was flushed before stays readable
        (disk or DiskTrouble()).stopped("recording", getattr(sink, "path", "?"), e)
        sink.abandon()
    except Exception:
        log.exception("closing %s failed", type(sink).__name__)


def sample_of(
    rec: Any, frame: Any, sightings: list, world: Any, safety: Any, jpeg_quality: int = 80, odom: Any = None
) -> StepSample:
    """A StepSample of a navigator Step, the frame it looked at (agent.robot.camera.Frame or None), its
    sightings (agent.robot.perception.Sighting), the simulator (or None), the safety layer and the
    controller's odometry (Controller.odometry(), or None)."""
    jpeg, frame_t = None, None
    if frame is not None:
        import cv2

        ok, buf = cv2.imencode(".jpg", frame.image, [cv2.IMWRITE_JPEG_QUALITY, jpeg_quality])
        jpeg = buf.tobytes() if ok else None
        frame_t = time.time() - (time.monotonic() - frame.t)  # its monotonic capture time on the wall clock
    pose = path = None
    if world is not None:
        pose = tuple(float(v) for v in world.pose)
        t0 = time.time() - world.clock()  # the simulator's clock on the wall clock
        path = [(t0 + p[0], p[1], p[2], p[3]) for p in world.path[-MAX_PATH_POSES:]]
    seen = [
        {"name": s.name, "bearing_deg": round(s.bearing_deg, 1), "distance_m": round(s.distance_m, 2)}
        for s in sightings
    ]
    stops, clearance = dict(safety.stops), getattr(safety, "clearance_m", None)
    odometry = None if odom is None else tuple(float(v) for v in odom)
    return StepSample(rec.to_json(), jpeg, frame_t, seen, pose, path or [], stops, clearance, odometry)  # type: ignore[arg-type]
