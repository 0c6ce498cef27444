"""What the daemon (agent/app/daemon.py) sees with and records to, made from the config: the camera (started,
then watched for going quiet: `CameraWatch`), the perception that reads its frames, and the recording
(record.path, record.foxglove)."""

from __future__ import annotations

import logging
import time
from typing import Any, Callable

from agent.robot.camera import FrameGrabber, open_source

from .config import Config, RecordSection
from .navigator import Perception
from .recording import Recorder
from .telemetry import DiskTrouble

log = logging.getLogger(__name__)


def open_camera(cfg: Config, world: Any) -> FrameGrabber:
    """camera.source's frames on a grabber thread of their own, started (`world`: the simulator's, else None)."""
    camera = cfg.camera
    source = open_source(
        camera.source,
        camera.width,
        camera.height,
        camera.fps,
        world=world,
        network_interface=cfg.robot.options.get("network_interface"),
        domain_id=cfg.robot.options.get("domain_id", 0),
    )
    grabber = FrameGrabber(source, name=camera.source if len(camera.source) < 40 else "camera")
    grabber.start()
    return grabber


def make_perception(cfg: Config, world: Any) -> Perception:
    """perception.kind's: "sim" (the simulator's ground truth), "vlm" (the image itself) or the color detector."""
    from agent.robot import perception

    kind = cfg.perception.kind
    if kind == "sim":
        if world is None:
            raise ValueError("perception 'sim' needs the sim controller")
        return perception.SimPerception(world)
    if kind == "vlm":
        return perception.VlmPerception(cfg.perception.image_max_side, cfg.perception.jpeg_quality)
    return perception.ColorDetector(object_height_m=cfg.perception.target_height_m)


def open_recorder(rc: RecordSection, disk: DiskTrouble) -> Recorder | None:
    """The recording record.path and record.foxglove ask for, or None when they ask for none."""
    if not (rc.path or rc.foxglove):
        return None
    foxglove = rc.foxglove_address() if rc.foxglove else None
    recorder = Recorder(
        rc.path,
        max_bytes=rc.max_bytes,
        foxglove=foxglove,
        foxglove_credential=rc.foxglove_credential() if foxglove else "",
        foxglove_origins=frozenset(rc.foxglove_origins),
        disk=disk,
    )
    live = ""
    if foxglove:
        origins = ", ".join(rc.foxglove_origins) or "none"
        live = (
            f", Foxglove on ws://{foxglove[0]}:{recorder.foxglove_port}/?token=... (the credential of "
            f"record.foxglove_token_file; browser origins: {origins})"
        )
    log.info("recording to %s%s", rc.path or "no file", live)
    return recorder


class CameraWatch:
    """The camera's state: "starting" (no frame yet, within camera.max_age_ms of its start), "ok", or "stale"
    (nothing new for camera.max_age_ms). A change is logged, emitted as a "camera" event and then `on_change`d
    (the daemon's STATUS= line)."""

    def __init__(self, cfg: Config, emit: Callable[[dict], None], on_change: Callable[[], object]):
        self.cfg = cfg
        self.emit = emit
        self.on_change = on_change
        self.state = "starting"
        self.since = time.monotonic()  # when the grabber started

    def started(self) -> None:
        self.since = time.monotonic()

    def check(self, grabber: FrameGrabber | None) -> str:
        """Report a camera that went quiet (or came back) on STATUS=, the log and the events; returns its state."""
        age = grabber.latest_age_s() if grabber else None
        state = "stale" if age is None or age * 1e3 > self.cfg.camera.max_age_ms else "ok"
        if (
            state == "stale"
            and self.state == "starting"
            and age is None
            and time.monotonic() - self.since < self.cfg.camera.max_age_ms / 1e3
        ):
            return self.state  # a camera gets max_age_ms for its first frame
        if state != self.state:
            self.state = state
            detail = "no frame yet" if age is None else f"newest frame {age * 1e3:.0f} ms old"
            error = grabber.error if grabber else None
            if state == "stale":
                log.warning(
                    "camera %s is stale: %s%s (limit %.0f ms); the robot does not move",
                    self.cfg.camera.source,
                    detail,
                    f", {error}" if error else "",
                    self.cfg.camera.max_age_ms,
                )
            else:
                log.info("camera %s delivers again", self.cfg.camera.source)
            self.emit({"event": "camera", "state": state, "detail": detail, "error": error})
            self.on_change()
        return state
