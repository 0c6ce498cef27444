"""Camera frames for the navigation loop: sources (V4L2, GStreamer, video files, the simulator)
and a grabber thread that keeps only the newest frame.

A camera's own buffer hands out old frames (opencv/opencv#13145): the grabber
reads continuously in a named daemon thread and keeps only the latest frame
with its capture time, and `read_latest(max_age_ms)` refuses a frame older than
the limit (StaleFrame) instead of letting the robot act on the past.

Sources, chosen by the config's `camera.source` string:
    "go2"                       the Go2's front camera through unitree_sdk2py's VideoClient: each
                                GetImageSample is one JPEG, decoded here (the Go2 has no /dev/video*)
    "sim"                       the simulator's renderer (registered by agent/robot/sim.py; needs its world)
    "/dev/video0" or "0"        a V4L2 device (MJPG, buffer of one frame)
    "... ! appsink"             a GStreamer pipeline (needs an OpenCV built with GStreamer: JetPack's,
                                not the pip wheel); a Jetson CSI camera, for example:
        nvarguscamerasrc sensor-id=0 ! video/x-raw(memory:NVMM),width=1280,height=720,format=NV12,
        framerate=30/1 ! nvvidconv flip-method=0 ! video/x-raw,format=BGRx ! videoconvert !
        video/x-raw,format=BGR ! appsink drop=1 max-buffers=1
                                a USB camera: v4l2src device=/dev/video0 ! image/jpeg ! jpegdec !
                                videoconvert ! video/x-raw,format=BGR ! appsink drop=1 max-buffers=1;
                                RTSP: rtspsrc location=rtsp://HOST/stream latency=0 ! decodebin !
                                videoconvert ! video/x-raw,format=BGR ! appsink drop=1 max-buffers=1
    "rtsp://...", "http://..."  a network stream through OpenCV's FFmpeg backend (not looped, not paced)
    anything else               a video file (looped), for replaying a recorded run

Named sources come from a registry (`register_source(name, factory)`): the real ones are
registered here, a fake beside its own code, so this module imports no simulator.

A source may put the capture time (time.monotonic()) in its metadata as "t";
the grabber stamps the frame with it, else with the time the read returned.

Encoded images the robot decodes (the Go2's JPEG samples here, the local API's images in agent/app/daemon.py)
have their width and height read from the header and bounded (protocol/images.py) before OpenCV decodes
them; OpenCV's own limits (OPENCV_LIMITS) are set to the same bounds when this module is imported, before
the robot's first `import cv2` (OpenCV reads them once, when it loads), as a second line.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from dataclasses import dataclass, field
from types import ModuleType
from typing import TYPE_CHECKING, Any, Callable, Protocol

import numpy as np

from protocol.images import MAX_IMAGE_PIXELS, MAX_IMAGE_SIDE, ImageError, check_header

if TYPE_CHECKING:
    import cv2

log = logging.getLogger(__name__)

# What OpenCV's imdecode/imread decode at most (OpenCV's defaults: 2^30 pixels, 2^20 a side). Set unless the
# operator set them; they take effect only if cv2 is first imported after this module.
OPENCV_LIMITS = {
    "OPENCV_IO_MAX_IMAGE_PIXELS": MAX_IMAGE_PIXELS,
    "OPENCV_IO_MAX_IMAGE_WIDTH": MAX_IMAGE_SIDE,
    "OPENCV_IO_MAX_IMAGE_HEIGHT": MAX_IMAGE_SIDE,
}
for _name, _value in OPENCV_LIMITS.items():
    os.environ.setdefault(_name, str(_value))


class StaleFrame(RuntimeError):
    """No frame, or the newest one is older than the caller accepts."""


class CameraError(RuntimeError):
    """The camera cannot be opened or stopped delivering frames."""


@dataclass(frozen=True)
class Frame:
    image: np.ndarray  # [h, w, 3] uint8, BGR
    t: float  # time.monotonic() at capture
    seq: int  # grabber's count, from 1
    meta: dict = field(default_factory=dict)  # the simulator's pose at render time, say

    def age_s(self, now: float | None = None) -> float:
        return (time.monotonic() if now is None else now) - self.t


class FrameSource(Protocol):
    def open(self) -> None: ...
    def read(self) -> tuple[np.ndarray, dict] | None:
        """Block for the next image (with its metadata); None on a failed read."""

    def close(self) -> None: ...


class OpenCVSource:
    """A V4L2 device, a GStreamer pipeline string or a video file through cv2.VideoCapture."""

    def __init__(self, source: str, width: int = 640, height: int = 480, fps: int = 15, loop: bool = True):
        self.source, self.width, self.height, self.fps, self.loop = source, width, height, fps, loop
        self.cap: cv2.VideoCapture | None = None
        self.kind = (
            "gstreamer"
            if "!" in source
            else "v4l2"
            if source.startswith("/dev/video") or source.isdigit()
            else "stream"
            if re.match(r"(rtsp|rtmp|https?|udp|tcp)://", source)
            else "file"
        )

    def open(self) -> None:
        import cv2

        if self.kind == "gstreamer":
            if not has_gstreamer(cv2):
                raise CameraError(
                    "this OpenCV has no GStreamer (pip wheels never do): use JetPack's OpenCV, "
                    "e.g. a venv made with --system-site-packages"
                )
            cap = cv2.VideoCapture(self.source, cv2.CAP_GSTREAMER)
        elif self.kind == "v4l2":
            dev = int(self.source) if self.source.isdigit() else self.source
            cap = cv2.VideoCapture(dev, cv2.CAP_V4L2)
            cap.set(cv2.CAP_PROP_FOURCC, cv2.VideoWriter.fourcc(*"MJPG"))
            cap.set(cv2.CAP_PROP_FRAME_WIDTH, self.width)
            cap.set(cv2.CAP_PROP_FRAME_HEIGHT, self.height)
            cap.set(cv2.CAP_PROP_FPS, self.fps)
            cap.set(cv2.CAP_PROP_BUFFERSIZE, 1)
        elif self.kind == "stream":
            cap = cv2.VideoCapture(self.source, cv2.CAP_FFMPEG)
            cap.set(cv2.CAP_PROP_BUFFERSIZE, 1)
        else:
            cap = cv2.VideoCapture(self.source)
        if not cap.isOpened():
            raise CameraError(f"cannot open camera source {self.source!r} ({self.kind})")
        self.cap = cap

    def read(self) -> tuple[np.ndarray, dict] | None:
        if self.cap is None:
            raise CameraError(f"camera source {self.source!r} is not open")
        ok, img = self.cap.read()
        if not ok and self.kind == "file" and self.loop:
            import cv2

            self.cap.set(cv2.CAP_PROP_POS_FRAMES, 0)
            ok, img = self.cap.read()
        if self.kind == "file":  # a file reads as fast as it decodes; pace it like a camera
            time.sleep(1.0 / self.fps)
        return (img, {}) if ok else None

    def close(self) -> None:
        if self.cap is not None:
            self.cap.release()
            self.cap = None


def has_gstreamer(cv2: ModuleType) -> bool:
    """Whether this OpenCV was built with GStreamer (JetPack's is; pip's wheels never are)."""
    return re.search(r"GStreamer:\s*YES", cv2.getBuildInformation()) is not None


class Go2CameraSource:
    """The Go2's front camera: JPEG samples from unitree_sdk2py's VideoClient, decoded to BGR frames.

    GetImageSample waits for the robot's reply (up to timeout_s); it runs in the grabber's thread only.
    A frame is stamped with the time its request was sent: the robot answers with its newest image, so
    the image is at least that fresh give or take one camera period.
    """

    def __init__(self, network_interface: str | None = None, fps: int = 15, timeout_s: float = 1.0, domain_id: int = 0):
        self.network_interface, self.fps, self.timeout_s = network_interface, fps, timeout_s
        self.domain_id = domain_id  # the DDS domain (the Go2's is 0); the driver's, when both run
        self.client: Any = None  # unitree_sdk2py's VideoClient once open (the SDK is untyped)

    def open(self) -> None:
        from .controllers.base import ControllerError
        from .controllers.go2 import INSTALL_HINT, init_channel

        try:
            init_channel(self.network_interface, self.domain_id)
            from unitree_sdk2py.go2.video.video_client import VideoClient
        except (ImportError, ControllerError) as e:
            raise CameraError(f"camera 'go2': {INSTALL_HINT if isinstance(e, ImportError) else e}") from None
        client = VideoClient()
        client.SetTimeout(self.timeout_s)
        client.Init()
        self.client = client

    def read(self) -> tuple[np.ndarray, dict] | None:
        import cv2

        t0 = time.monotonic()
        code, data = self.client.GetImageSample()
        image = None
        if code == 0 and data:
            data = bytes(data)
            try:
                check_header(data)  # its size from the header, bounded, before OpenCV allocates for it
            except ImageError as e:
                log.warning("camera go2: a sample refused: %s", e)
                return None
            try:
                image = cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_COLOR)
            except cv2.error as e:  # OpenCV's own limits (OPENCV_LIMITS) raise rather than return None
                log.warning("camera go2: a sample OpenCV refused: %s", e)
        if image is None:  # a timeout or a bad sample: the grabber counts the failure
            return None
        time.sleep(max(0.0, 1.0 / self.fps - (time.monotonic() - t0)))  # no faster than asked
        return image, {"source": "go2", "t": t0, "jpeg_bytes": len(data)}

    def close(self) -> None:
        self.client = None


MAX_BACKOFF_S = 2.0  # a camera that fails max_failures times in a row is retried at most this far apart


class FrameGrabber:
    """Reads a source in a background thread and keeps only the newest frame.

    It never gives up: after `max_failures` failed reads in a row it says so (log, `error`, `retrying`)
    and keeps trying with a backoff (0.1 s doubling to MAX_BACKOFF_S); a robot whose camera returns sees
    again without a restart, and while it is blind the safety layer's stale-frame rule holds it still.
    """

    def __init__(
        self,
        source: FrameSource,
        name: str = "camera",
        max_failures: int = 50,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.source = source
        self.name = name
        self.max_failures = max_failures
        self.clock = clock
        self._lock = threading.Lock()
        self._latest: Frame | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.frames = 0
        self.failures = 0
        self.error: str | None = None
        self.retrying = False  # max_failures in a row: still trying, with backoff, and said so

    def start(self) -> "FrameGrabber":
        self.source.open()
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name=f"grabber-{self.name}", daemon=True)
        self._thread.start()
        return self

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()

    def _run(self) -> None:
        consecutive = 0
        backoff = 0.0  # past max_failures in a row: the pause between tries, doubling up to MAX_BACKOFF_S
        while not self._stop.is_set():
            try:
                got = self.source.read()
            except Exception as e:  # a driver error must not kill the thread silently
                got, self.error = None, f"{type(e).__name__}: {e}"
            if got is None:
                self.failures += 1
                consecutive += 1
                if consecutive == self.max_failures:
                    self.error = self.error or f"{consecutive} failed reads in a row"
                    log.error(
                        "camera %s: %s; retrying with backoff up to %.0f s (the robot stops on stale frames "
                        "until a frame comes)",
                        self.name,
                        self.error,
                        MAX_BACKOFF_S,
                    )
                if consecutive >= self.max_failures:
                    backoff = min(MAX_BACKOFF_S, max(0.1, 2 * backoff))
                    self.retrying = True
                self._stop.wait(backoff or 0.02)
                continue
            if self.retrying:
                log.warning("camera %s: frames again after %d failed reads", self.name, consecutive)
            consecutive, backoff, self.retrying, self.error = 0, 0.0, False, None
            image, meta = got
            with self._lock:
                self.frames += 1
                self._latest = Frame(image, meta.get("t", self.clock()), self.frames, meta)

    def read_latest(self, max_age_ms: float) -> Frame:
        """The newest frame if it is at most max_age_ms old; raises StaleFrame otherwise."""
        with self._lock:
            frame = self._latest
        if frame is None:
            raise StaleFrame(f"camera {self.name}: no frame yet" + (f" ({self.error})" if self.error else ""))
        age_ms = (self.clock() - frame.t) * 1e3
        if age_ms > max_age_ms:
            raise StaleFrame(f"camera {self.name}: newest frame is {age_ms:.0f} ms old (limit {max_age_ms:.0f} ms)")
        return frame

    def latest_age_s(self) -> float | None:
        """Age of the newest frame (None before the first); the safety layer's staleness input."""
        with self._lock:
            frame = self._latest
        return None if frame is None else self.clock() - frame.t

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stop(self, timeout_s: float = 2.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                log.warning("camera %s: grabber did not stop in %.1fs", self.name, timeout_s)
            self._thread = None
        self.source.close()


# ---------------------------------------------------------------- the sources by name

# A factory takes the config's source string and keyword options (width, height, fps, world,
# network_interface; it ignores the ones it does not need) and returns an unopened FrameSource.
# The real sources are registered here; a fake registers itself beside them from its own module
# (agent/robot/sim.py registers "sim"), so this module imports none of them.
SourceFactory = Callable[..., FrameSource]
_SOURCES: dict[str, SourceFactory] = {}
_OWNERS = {"sim": "agent.robot.sim (the sim controller's world)"}  # who registers a source not built in


def register_source(name: str, factory: SourceFactory) -> None:
    """Make `open_source(name, ...)` call `factory(name, **options)`; a later registration replaces it."""
    if not name or not callable(factory):
        raise ValueError("register_source needs a name and a callable factory")
    _SOURCES[name] = factory


def registered_sources() -> list[str]:
    return sorted(_SOURCES)


def _go2_source(
    source: str, *, fps: int = 15, network_interface: str | None = None, domain_id: int = 0, **_
) -> FrameSource:
    return Go2CameraSource(network_interface, fps=fps, domain_id=domain_id)


register_source("go2", _go2_source)


def open_source(
    source: str,
    width: int = 640,
    height: int = 480,
    fps: int = 15,
    world: object = None,
    network_interface: str | None = None,
    domain_id: int = 0,
) -> FrameSource:
    """The frame source a config string names: a registered name ("go2"; "sim" once agent.robot.sim is
    imported, and it needs the simulator's world) or else an OpenCV source (device, pipeline, stream, file)."""
    factory = _SOURCES.get(source)
    if factory is not None:
        return factory(
            source,
            width=width,
            height=height,
            fps=fps,
            world=world,
            network_interface=network_interface,
            domain_id=domain_id,
        )
    if source in _OWNERS:
        raise CameraError(
            f"camera source {source!r} is registered by {_OWNERS[source]}, which is not loaded: "
            f"use robot.controller = {source!r}"
        )
    return OpenCVSource(source, width, height, fps)
