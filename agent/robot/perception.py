"""Perception: one camera frame in, a short list of text-ready sightings out.

A `Sighting` is what the prompt needs about one thing the robot sees: a name,
a bearing (degrees, positive = to the robot's left) and a distance (metres to
the thing's near surface). Two perceptions produce them:

    "sim"    SimPerception  the simulator's ground truth for the frame's pose (privileged)
    "color"  ColorDetector  HSV thresholds on the image itself (works on a real camera)

Both have `kind` and `describe(frame) -> list[Sighting]`, sorted by distance. A third
turns nothing into words: with a vision-language pair the frame itself goes in the prompt.

    "vlm"    VlmPerception  the frame as JPEG bytes (`encode`); it describes no sightings
Pinhole model shared with the simulator's renderer (agent/robot/sim.py):
column u (pixel centre u + 0.5) looks along bearing atan((w/2 - (u + 0.5)) / f),
f = (w/2) / tan(hfov/2); the horizon is row h/2 (the camera looks level).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Protocol, Sequence

import numpy as np

from .camera import Frame


@dataclass(frozen=True)
class Sighting:
    name: str  # "red box"; a detector without names says "red object"
    bearing_deg: float  # positive = to the robot's left, 0 = straight ahead
    distance_m: float  # robot centre to the thing's near surface, >= 0
    source: str  # "sim" | "color" | a detector's kind

    def to_json(self) -> dict:
        return {
            "name": self.name,
            "bearing_deg": round(self.bearing_deg, 1),
            "distance_m": round(self.distance_m, 2),
            "source": self.source,
        }


def focal_px(width: int, hfov_deg: float) -> float:
    """f = (w/2) / tan(hfov/2), in pixels (square pixels: the same f vertically)."""
    return (width / 2.0) / math.tan(math.radians(hfov_deg) / 2.0)


class SightingSource(Protocol):
    """What SimPerception reads: the simulator (agent/robot/sim.py SimWorld), the objects seen from a pose."""

    def sightings(
        self, pose: tuple[float, float, float] | None = None, hfov_deg: float = 90.0, max_range_m: float = 6.0
    ) -> list[Sighting]: ...


class SimPerception:
    """The simulator's ground truth of what the camera could see at the frame's moment.

    Privileged: it reads the world, not the pixels (field of view, range and line of
    sight are checked, so it reports only what the camera could see). A stand-in for a
    detector, for developing the agent loop before a detector is trusted. It uses the
    pose stored with the frame (`frame.meta["pose"]`), never the world's current pose,
    so what it reports belongs to the image the model was shown.
    """

    kind = "sim"

    def __init__(self, world: SightingSource, hfov_deg: float = 90.0, max_range_m: float = 6.0) -> None:
        self.world = world
        self.hfov_deg = hfov_deg
        self.max_range_m = max_range_m

    def describe(self, frame: Frame) -> list[Sighting]:
        pose = frame.meta.get("pose")
        if pose is None:
            raise ValueError("SimPerception needs frame.meta['pose'] (a frame from the simulator's camera)")
        return self.world.sightings(pose=tuple(pose), hfov_deg=self.hfov_deg, max_range_m=self.max_range_m)


# colour -> one (lower, upper) HSV range or a list of them; OpenCV hue runs 0..180, so red wraps
DEFAULT_COLORS: dict[str, list[tuple[tuple[int, int, int], tuple[int, int, int]]]] = {
    "red": [((0, 120, 70), (10, 255, 255)), ((170, 120, 70), (180, 255, 255))],
    "blue": [((100, 120, 70), (130, 255, 255))],
    "green": [((40, 80, 60), (85, 255, 255))],
    "yellow": [((20, 120, 90), (35, 255, 255))],
}


def _ranges(spec: Sequence[Any]) -> list[Any]:
    """Accept (lower, upper) or [(lower, upper), ...]."""
    if len(spec) == 2 and len(spec[0]) == 3 and np.isscalar(spec[0][0]):
        return [spec]
    return list(spec)


def blob_range(
    top: float, bottom: float, height: int, f: float, camera_height_m: float, object_height_m: float
) -> tuple[float, str]:
    """Depth along the optical axis of a blob whose rows span [top, bottom) (continuous rows).

    Ground plane (preferred): the blob's bottom edge is where the object meets the floor,
        z = f * camera_height / (bottom - horizon).
    When the bottom is cut off by the frame (very close) or is not below the horizon, the
    known object height gives it from the top edge, z = f * (H - camera_height) / (horizon - top),
    or from the pixel height, z = f * H / (bottom - top).
    """
    horizon = height / 2.0
    if bottom < height - 0.5 and bottom - horizon >= 1.0:
        return f * camera_height_m / (bottom - horizon), "ground"
    if object_height_m > camera_height_m and horizon - top >= 1.0:
        return f * (object_height_m - camera_height_m) / (horizon - top), "top"
    return f * object_height_m / max(bottom - top, 1.0), "height"


class ColorDetector:
    """A real detector for a robot's camera: the largest blob of each configured colour.

    HSV thresholds (defaults: red in two hue ranges, blue, green, yellow) give a mask per
    colour; the largest external contour of at least `min_area_px` pixels is the sighting,
    named `names[color]` or "<color> object". Bearing comes from the blob's centroid column
    through the pinhole model. Distance is the ground-plane estimate from the blob's bottom
    row (z = f * camera_height / (row_bottom - horizon), then range = z / cos(bearing)); when
    the bottom is cut off by the frame it falls back to the known object height (see
    `blob_range`). Assumes a level camera at `camera_height_m` on a flat floor.
    """

    kind = "color"

    def __init__(
        self,
        colors: dict | None = None,
        hfov_deg: float = 90.0,
        object_height_m: float = 0.4,
        camera_height_m: float = 0.3,
        min_area_px: int = 12,
        names: dict[str, str] | None = None,
    ):
        self.colors = {c: _ranges(spec) for c, spec in (colors or DEFAULT_COLORS).items()}
        self.hfov_deg = hfov_deg
        self.object_height_m = object_height_m
        self.camera_height_m = camera_height_m
        self.min_area_px = min_area_px
        self.names = dict(names or {})

    def describe(self, frame: Frame) -> list[Sighting]:
        import cv2

        image = frame.image  # [h, w, 3] uint8 BGR
        if image.ndim != 3 or image.shape[2] != 3 or image.dtype != np.uint8:
            raise ValueError(f"ColorDetector wants a [h, w, 3] uint8 BGR image, got {image.shape} {image.dtype}")
        h, w = image.shape[:2]
        f = focal_px(w, self.hfov_deg)
        hsv = cv2.cvtColor(image, cv2.COLOR_BGR2HSV)
        found = []
        for color, ranges in self.colors.items():
            mask = np.zeros((h, w), np.uint8)
            for lo, hi in ranges:
                mask |= np.asarray(cv2.inRange(hsv, np.array(lo, np.uint8), np.array(hi, np.uint8)), np.uint8)
            s = self._largest_blob(cv2, mask, w, h, f)
            if s is not None:
                bearing, dist = s
                found.append(Sighting(self.names.get(color, f"{color} object"), bearing, dist, self.kind))
        return sorted(found, key=lambda s: s.distance_m)

    def _largest_blob(self, cv2: ModuleType, mask: np.ndarray, w: int, h: int, f: float) -> tuple[float, float] | None:
        """(bearing_deg, distance_m) of the largest contour in `mask` [h, w], None if too small."""
        contours, _ = cv2.findContours(mask, cv2.RETR_EXTERNAL, cv2.CHAIN_APPROX_SIMPLE)
        if not contours:
            return None
        areas = [cv2.contourArea(c) for c in contours]
        c = contours[int(np.argmax(areas))]
        blob = np.zeros_like(mask)
        cv2.drawContours(blob, [c], -1, 255, thickness=-1)
        blob &= mask
        area = int(np.count_nonzero(blob))
        if area < self.min_area_px:
            return None
        rows, cols = np.nonzero(blob)
        u = cols.mean() + 0.5  # centroid column, continuous
        bearing = math.atan2(w / 2.0 - u, f)  # positive = left
        z, _ = blob_range(float(rows.min()), float(rows.max() + 1), h, f, self.camera_height_m, self.object_height_m)
        return math.degrees(bearing), max(0.0, z / math.cos(bearing))


@dataclass(frozen=True)
class CameraImage:
    """One frame as the models are shown it."""

    data: bytes  # JPEG, at most protocol.images.MAX_IMAGE_BYTES
    width: int  # pixels, after the resize
    height: int

    def describe(self, source: str = "camera") -> str:
        """The step record's observation: "camera image (384 x 288, 21456 bytes)"."""
        return f"{source} image ({self.width} x {self.height}, {len(self.data)} bytes)"


def fit_within(width: int, height: int, max_side: int) -> tuple[int, int]:
    """(w, h) scaled so the longer side is at most max_side, aspect kept (never enlarged, never below 1)."""
    scale = min(1.0, max_side / max(width, height))
    return max(1, round(width * scale)), max(1, round(height * scale))


class VlmPerception:
    """The frame itself, for a vision-language draft and target: `encode(frame)` makes the JPEG the prompt
    carries (longest side at most `max_side`, aspect kept; OpenCV's INTER_AREA, which averages rather
    than skips pixels when shrinking). The models read the picture, so `describe` reports no sightings:
    nothing is put into words, and the offline envelope has no target in view to keep turns toward.

    Both models resize again in their own projector's preprocessing (the test VLM to a longest edge of
    128), so sending more than that keeps only costs uplink bytes and the robot's encode time.
    """

    kind = "vlm"

    def __init__(self, max_side: int = 384, jpeg_quality: int = 85):
        from protocol.images import MAX_IMAGE_SIDE

        if not 16 <= max_side <= MAX_IMAGE_SIDE:  # what the wire takes: 4096 x 4096 is also MAX_IMAGE_PIXELS
            raise ValueError(f"max_side must be 16..{MAX_IMAGE_SIDE} pixels, got {max_side!r}")
        if not 1 <= jpeg_quality <= 100:
            raise ValueError(f"jpeg_quality must be 1..100, got {jpeg_quality!r}")
        self.max_side, self.jpeg_quality = max_side, jpeg_quality

    def describe(self, frame: Frame) -> list[Sighting]:
        return []

    def encode(self, frame: Frame) -> CameraImage:
        import cv2

        from protocol.images import MAX_IMAGE_BYTES, check_header

        image = frame.image  # [h, w, 3] uint8 BGR
        if image.ndim != 3 or image.shape[2] != 3 or image.dtype != np.uint8:
            raise ValueError(f"VlmPerception wants a [h, w, 3] uint8 BGR image, got {image.shape} {image.dtype}")
        h, w = image.shape[:2]
        size = fit_within(w, h, self.max_side)
        if size != (w, h):
            image = cv2.resize(image, size, interpolation=cv2.INTER_AREA)
        ok, buf = cv2.imencode(".jpg", image, [cv2.IMWRITE_JPEG_QUALITY, self.jpeg_quality])
        if not ok:
            raise ValueError("OpenCV could not encode the frame as JPEG")
        data = buf.tobytes()
        if len(data) > MAX_IMAGE_BYTES:
            raise ValueError(
                f"the frame's JPEG is {len(data)} bytes, over the wire's {MAX_IMAGE_BYTES}: lower "
                "perception.image_max_side or perception.jpeg_quality"
            )
        check_header(data)  # what the wire will check: within its pixel bounds (max_side keeps it there)
        return CameraImage(data, size[0], size[1])


PERCEPTIONS = {"sim": SimPerception, "color": ColorDetector, "vlm": VlmPerception}
