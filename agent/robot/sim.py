"""A 2-D simulator robot: a room, coloured objects, a first-person camera and a top-down map.

The world is flat: walls are segments, obstacles and boxes are axis-aligned
rectangles, balls are circles; everything stands on the floor with a height. The
robot is a circle (radius 0.2 m) with a pose (x, y, theta), theta 0 = +x, CCW positive.

Motion: `set_velocity(Command)` sets the body velocity; `advance()` integrates it up
to `clock()` in substeps of at most 20 ms. Like the Go2, the robot stops by itself
`auto_stop_s` after the last command. A substep that would bring the robot into
contact is not taken: the velocity drops to zero and `collisions` counts it. Every
public getter advances first, so the world is always "now". Thread-safe (one RLock):
the control loop, the camera grabber and the local API read it at once.

Camera: vectorised ray casting, one ray per column, a z-buffer over primitives;
pinhole model with f = (w/2) / tan(hfov/2), the horizon at row h/2, the camera
0.3 m above the floor and level, so a thing of height H at depth z spans rows
    horizon - f * (H - 0.3) / z  ..  horizon + f * 0.3 / z.
Walls and obstacles are grey (shaded by distance and face), objects flat saturated
colours so a colour detector (agent.robot.perception.ColorDetector) can find them.

Scenes are JSON files (agent/robot/scene.py; the shipped ones in agent/robot/scenes/):
`make_world("red_box", start=2)` or `make_world("path/to/my_room.json", start=0)`.
This module registers the camera source "sim" (SimCamera) with agent.robot.camera.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, NamedTuple, Sequence, cast

import numpy as np

from .camera import CameraError, register_source
from .controllers.base import Command
from .perception import Sighting, focal_px
from .scene import DEFAULT_SCENE, Obstacle, Scene, SceneError, SimObject, load_scene

ROBOT_RADIUS_M = 0.2
CAMERA_HEIGHT_M = 0.3
WALL_HEIGHT_M = 2.5
SUBSTEP_S = 0.02  # integration step (s)
PATH_MAXLEN = 20000  # path points kept; the oldest are dropped
PATH_MIN_STEP_M = 0.02  # a path point at least every 2 cm ...
PATH_MIN_TURN_RAD = math.radians(2.0)  # ... or 2 degrees of turn (or a tag change)


class Pose(NamedTuple):
    x: float  # m
    y: float  # m
    theta: float  # rad, 0 = +x, CCW positive, wrapped to (-pi, pi]


def wrap(a: float) -> float:
    """An angle in radians wrapped to (-pi, pi]."""
    return math.pi - (math.pi - a) % (2 * math.pi)


def rect_segments(x0: float, y0: float, x1: float, y1: float) -> list[tuple[float, float, float, float]]:
    return [(x0, y0, x1, y0), (x1, y0, x1, y1), (x1, y1, x0, y1), (x0, y1, x0, y0)]


# ---------------------------------------------------------------- pure geometry (numpy in, numpy out)


def ray_segments(ox: float, oy: float, ang: np.ndarray, segs: np.ndarray) -> np.ndarray:
    """Distance along each ray to each segment, inf where it misses.

    ang [R] ray directions (rad), segs [S, 4] rows (x1, y1, x2, y2) -> t [R, S].
    Ray o + t d meets segment p + s e where t d - s e = p - o; with cross(a, b) = ax by - ay bx:
        t = cross(p - o, e) / cross(d, e),  s = cross(p - o, d) / cross(d, e),  valid for t > 0, 0 <= s <= 1.
    """
    dx, dy = np.cos(ang)[:, None], np.sin(ang)[:, None]  # [R, 1]
    px, py = segs[None, :, 0] - ox, segs[None, :, 1] - oy  # [1, S]
    ex, ey = segs[None, :, 2] - segs[None, :, 0], segs[None, :, 3] - segs[None, :, 1]
    den = dx * ey - dy * ex  # [R, S]
    with np.errstate(divide="ignore", invalid="ignore"):
        t = (px * ey - py * ex) / den
        s = (px * dy - py * dx) / den
    ok = (np.abs(den) > 1e-12) & (t > 1e-9) & (s >= 0.0) & (s <= 1.0)
    return np.where(ok, t, np.inf)


def ray_circles(ox: float, oy: float, ang: np.ndarray, circles: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Distance along each ray to each circle's near side (inf on a miss) and the ray's lateral offset.

    ang [R], circles [C, 3] rows (cx, cy, r) -> (t [R, C], lateral [R, C]).
    With oc = c - o: along = oc . d, lateral^2 = |oc|^2 - along^2, t = along - sqrt(r^2 - lateral^2).
    """
    dx, dy = np.cos(ang)[:, None], np.sin(ang)[:, None]
    cx, cy, r = circles[None, :, 0] - ox, circles[None, :, 1] - oy, circles[None, :, 2]
    along = cx * dx + cy * dy
    lat2 = np.maximum(cx * cx + cy * cy - along * along, 0.0)
    half = np.sqrt(np.maximum(r * r - lat2, 0.0))
    t = along - half
    return np.where((lat2 <= r * r) & (t > 1e-9), t, np.inf), np.sqrt(lat2)


def point_clearance(px: float, py: float, segs: np.ndarray, rects: np.ndarray, circles: np.ndarray) -> float:
    """Distance from a point to the nearest geometry (0 inside a rectangle, negative inside a circle).

    segs [S, 4] thin walls, rects [N, 4] rows (x0, y0, x1, y1), circles [C, 3].
    Segment: project onto it, s = clip((p - a) . e / |e|^2, 0, 1), distance |a + s e - p|.
    Rectangle: d = hypot(max(x0 - px, 0, px - x1), max(y0 - py, 0, py - y1)).
    """
    best = math.inf
    if len(segs):
        ax, ay = segs[:, 0], segs[:, 1]
        ex, ey = segs[:, 2] - ax, segs[:, 3] - ay
        s = np.clip(((px - ax) * ex + (py - ay) * ey) / np.maximum(ex * ex + ey * ey, 1e-12), 0.0, 1.0)
        best = min(best, float(np.min(np.hypot(ax + s * ex - px, ay + s * ey - py))))
    if len(rects):
        dx = np.maximum(np.maximum(rects[:, 0] - px, px - rects[:, 2]), 0.0)
        dy = np.maximum(np.maximum(rects[:, 1] - py, py - rects[:, 3]), 0.0)
        best = min(best, float(np.min(np.hypot(dx, dy))))
    if len(circles):
        best = min(best, float(np.min(np.hypot(circles[:, 0] - px, circles[:, 1] - py) - circles[:, 2])))
    return best


@dataclass(frozen=True)
class Geometry:
    """Everything the renderer and the collision check need, as arrays (built once per world)."""

    segs: np.ndarray  # [S, 4] every vertical face: walls, obstacle and box sides
    seg_owner: np.ndarray  # [S] int: object index, -1 wall, -2 obstacle
    seg_height: np.ndarray  # [S] m
    seg_color: np.ndarray  # [S, 3] float BGR base colour
    seg_face: np.ndarray  # [S] brightness factor by orientation (corners stay visible)
    circles: np.ndarray  # [C, 3] balls (cx, cy, r)
    circ_owner: np.ndarray  # [C] object index
    circ_height: np.ndarray  # [C] m
    circ_color: np.ndarray  # [C, 3]
    thin: np.ndarray  # [Sw, 4] walls for collisions (room boundary + interior walls)
    rects: np.ndarray  # [N, 4] obstacles and boxes for collisions
    bounds: tuple[float, float, float, float]  # x0, y0, x1, y1 of everything


WALL_GREY, OBSTACLE_GREY = 190.0, 140.0


def build_geometry(walls: list, obstacles: list[Obstacle], objects: list[SimObject]) -> Geometry:
    segs: list[tuple[float, ...]] = []  # one entry per segment in the four lists: x0, y0, x1, y1
    owner: list[int] = []  # -1 wall, -2 obstacle, else the object's index
    height: list[float] = []
    color: list[tuple[float, ...]] = []

    def add(seg: tuple[float, ...], who: int, h_m: float, bgr: tuple[float, ...]) -> None:
        segs.append(seg)
        owner.append(who)
        height.append(h_m)
        color.append(bgr)

    for w in walls:
        add(tuple(w), -1, WALL_HEIGHT_M, (WALL_GREY,) * 3)
    for o in obstacles:
        for s in rect_segments(o.x0, o.y0, o.x1, o.y1):
            add(s, -2, o.height_m, (OBSTACLE_GREY,) * 3)
    circles: list[tuple[float, float, float]] = []
    c_owner: list[int] = []
    c_height: list[float] = []
    c_color: list[tuple[int, int, int]] = []
    for i, ob in enumerate(objects):
        if ob.kind == "box":
            h = ob.size_m / 2
            for s in rect_segments(ob.x - h, ob.y - h, ob.x + h, ob.y + h):
                add(s, i, ob.height_m, ob.color_bgr)
        else:
            circles.append((ob.x, ob.y, ob.size_m / 2))
            c_owner.append(i)
            c_height.append(ob.height_m)
            c_color.append(ob.color_bgr)
    segs_a = np.array(segs, float).reshape(-1, 4)
    along_x = np.abs(segs_a[:, 2] - segs_a[:, 0]) >= np.abs(segs_a[:, 3] - segs_a[:, 1])
    rects = [(o.x0, o.y0, o.x1, o.y1) for o in obstacles] + [
        (ob.x - ob.size_m / 2, ob.y - ob.size_m / 2, ob.x + ob.size_m / 2, ob.y + ob.size_m / 2)
        for ob in objects
        if ob.kind == "box"
    ]
    xs = np.concatenate([segs_a[:, [0, 2]].ravel(), [c[0] for c in circles]])
    ys = np.concatenate([segs_a[:, [1, 3]].ravel(), [c[1] for c in circles]])
    return Geometry(
        segs=segs_a,
        seg_owner=np.array(owner, int),
        seg_height=np.array(height, float),
        seg_color=np.array(color, float).reshape(-1, 3),
        seg_face=np.where(along_x, 1.0, 0.8),
        circles=np.array(circles, float).reshape(-1, 3),
        circ_owner=np.array(c_owner, int),
        circ_height=np.array(c_height, float),
        circ_color=np.array(c_color, float).reshape(-1, 3),
        thin=np.array([tuple(w) for w in walls], float).reshape(-1, 4),
        rects=np.array(rects, float).reshape(-1, 4),
        bounds=(float(xs.min()), float(ys.min()), float(xs.max()), float(ys.max())),
    )


# ---------------------------------------------------------------- camera (pure)


def _background(h: int, w: int) -> np.ndarray:
    """Ceiling and floor: neutral grey gradients (channels equal, so zero saturation). [h, w, 3] uint8."""
    rows = (np.arange(h) + 0.5) / h  # [h] 0 top .. 1 bottom
    grey = np.where(rows < 0.5, 205 - 40 * rows, 60 + 100 * (rows - 0.5))
    return np.repeat(np.repeat(grey.astype(np.uint8)[:, None, None], w, axis=1), 3, axis=2)


_BG_CACHE: dict[tuple[int, int], np.ndarray] = {}


def render_view(
    geo: Geometry,
    pose: tuple[float, float, float],
    width: int = 160,
    height: int = 120,
    hfov_deg: float = 90.0,
    camera_height_m: float = CAMERA_HEIGHT_M,
) -> np.ndarray:
    """A first-person view [height, width, 3] uint8 BGR, one ray per column and a z-buffer.

    Column u looks along a_u = atan((w/2 - (u + 0.5)) / f) off the heading; a hit at ray
    distance t has depth z = t cos(a_u) (a flat image plane). A face spanning heights
    [lo, hi] covers rows [horizon - f (hi - cam_h) / z, horizon - f (lo - cam_h) / z).
    """
    x, y, theta = pose
    f = focal_px(width, hfov_deg)
    a = np.arctan2(width / 2.0 - (np.arange(width) + 0.5), f)  # [W], positive = left
    ang = theta + a
    cos_a = np.cos(a)
    key = (height, width)
    if key not in _BG_CACHE:
        _BG_CACHE[key] = _background(height, width)
    img = _BG_CACHE[key].copy()  # [H, W, 3]
    zbuf = np.full((height, width), np.inf)
    v = np.arange(height)[:, None] + 0.5  # [H, 1] row centres
    horizon = height / 2.0
    faces = []  # (z [W], lo [W], hi [W], colour [W, 3])
    if len(geo.segs):
        t = ray_segments(x, y, ang, geo.segs)  # [W, S]
        for s in np.flatnonzero(np.isfinite(t).any(axis=0)):
            z = t[:, s] * cos_a
            col = geo.seg_color[s] * geo.seg_face[s]
            if geo.seg_owner[s] < 0:  # grey, darker with distance
                col = col / (1.0 + 0.12 * np.nan_to_num(z, posinf=0.0))[:, None]
            faces.append((z, np.zeros(width), np.full(width, geo.seg_height[s]), np.broadcast_to(col, (width, 3))))
    if len(geo.circles):
        t, lat = ray_circles(x, y, ang, geo.circles)  # [W, C]
        for c in np.flatnonzero(np.isfinite(t).any(axis=0)):
            r, hh = geo.circles[c, 2], geo.circ_height[c] / 2  # a ball: centre at hh, vertical radius hh
            half = hh * np.sqrt(np.clip(1.0 - (lat[:, c] / r) ** 2, 0.0, 1.0))
            faces.append((t[:, c] * cos_a, hh - half, hh + half, np.broadcast_to(geo.circ_color[c], (width, 3))))
    for z, lo, hi, col in faces:
        zc = np.maximum(z, 1e-3)
        top = horizon - f * (hi - camera_height_m) / zc  # [W]
        bot = horizon - f * (lo - camera_height_m) / zc
        mask = (v >= top) & (v < bot) & (z < zbuf)  # [H, W]
        np.copyto(zbuf, np.broadcast_to(z, zbuf.shape), where=mask)
        np.copyto(img, np.broadcast_to(np.clip(col, 0, 255).astype(np.uint8), img.shape), where=mask[:, :, None])
    return img


# ---------------------------------------------------------------- the world


class SimWorld:
    """A room, its objects and one robot; see the module docstring."""

    def __init__(
        self,
        size_m: tuple[float, float] = (6.0, 5.0),
        objects: tuple = (),
        obstacles: tuple = (),
        walls: tuple = (),
        pose: tuple[float, float, float] = (1.0, 1.0, 0.0),
        clock: Callable[[], float] = time.monotonic,
        auto_stop_s: float = 1.0,
        robot_radius_m: float = ROBOT_RADIUS_M,
        scene: str = "custom",
        spec: Scene | None = None,
        start_index: int | None = None,
    ):
        w, d = size_m
        self.size_m = (float(w), float(d))
        self.objects: tuple[SimObject, ...] = tuple(objects)
        self.obstacles: tuple[Obstacle, ...] = tuple(o if isinstance(o, Obstacle) else Obstacle(*o) for o in obstacles)
        self.walls = tuple(rect_segments(0.0, 0.0, w, d)) + tuple(tuple(map(float, s)) for s in walls)
        self.geometry = build_geometry(list(self.walls), list(self.obstacles), list(self.objects))
        self.clock = clock
        self.auto_stop_s = auto_stop_s
        self.radius = robot_radius_m
        self.scene = scene  # the scene's name
        self.spec = spec  # the Scene it was made from (make_world), None for a hand-made world
        self.start_index = start_index  # which of the scene's starts, None for a pose given directly
        self._lock = threading.RLock()
        self._pose = Pose(float(pose[0]), float(pose[1]), wrap(float(pose[2])))
        self.start = self._pose
        self._vel = Command()
        self._t = clock()  # the time the pose belongs to
        self._cmd_t = self._t  # when the last command came
        self._damped = False
        self._tag = ""
        self.collisions = 0
        self._path: deque = deque(maxlen=PATH_MAXLEN)  # (t, x, y, theta, tag); the oldest drop off
        self.decisions: deque = deque(maxlen=1000)  # (x, y, while_moving): where the robot looked and decided
        self._path.append((self._t, *self._pose, self._tag))

    # ---- state
    @property
    def pose(self) -> Pose:
        with self._lock:
            self.advance()
            return self._pose

    @property
    def velocity(self) -> Command:
        with self._lock:
            self.advance()
            return self._vel

    @property
    def path(self) -> list[tuple[float, float, float, float, str]]:
        """A copy of the recorded path, (t, x, y, theta, tag), at most PATH_MAXLEN points, ending at the pose now."""
        with self._lock:
            self.advance()
            path = list(self._path)
            if tuple(path[-1][1:4]) != tuple(self._pose):
                path.append((self._t, *self._pose, self._tag))
            return path

    @property
    def tag(self) -> str:
        return self._tag

    @tag.setter
    def tag(self, value: str) -> None:
        with self._lock:
            self.advance()  # the motion so far keeps the old tag, up to this pose
            if tuple(self._path[-1][1:4]) != tuple(self._pose):
                self._path.append((self._t, *self._pose, self._tag))
            self._tag = str(value)

    @property
    def damped(self) -> bool:
        return self._damped

    @damped.setter
    def damped(self, value: bool) -> None:
        """The Go2's Damp analogue: while True the robot holds still and ignores commands."""
        with self._lock:
            self.advance()
            self._damped = bool(value)
            if self._damped:
                self._vel = Command()

    def set_pose(self, x: float, y: float, theta: float) -> None:
        with self._lock:
            self.advance()
            self._pose = Pose(float(x), float(y), wrap(float(theta)))
            self._vel = Command()
            self._path.append((self._t, *self._pose, self._tag))

    def restart(self, pose: tuple[float, float, float], start_index: int | None = None) -> None:
        """Begin a new episode in the same room: the robot stopped at `pose`, which becomes the start; the
        path and the collision count start afresh (the tag and the damped state stay)."""
        with self._lock:
            self.advance()
            self._pose = Pose(float(pose[0]), float(pose[1]), wrap(float(pose[2])))
            self.start = self._pose
            self.start_index = start_index
            self._vel = Command()
            self.collisions = 0
            self.decisions.clear()
            self._path.clear()
            self._path.append((self._t, *self._pose, self._tag))

    def mark_decision(self, x: float, y: float, while_moving: bool) -> None:
        """Where a step's look was taken (the map marks it: a dot standing, a ring while the robot moved)."""
        self.decisions.append((float(x), float(y), bool(while_moving)))

    # ---- motion
    def set_velocity(self, cmd: Command) -> None:
        """Hold this body velocity from now (zero while damped; a non-finite axis means zero)."""
        with self._lock:
            self.advance()
            finite = all(math.isfinite(c) for c in (cmd.vx, cmd.vy, cmd.wz))
            self._vel = Command() if self._damped or not finite else cmd
            self._cmd_t = self._t

    def advance(self) -> None:
        """Integrate the body velocity from the last update to clock(), moving only until the auto-stop."""
        with self._lock:
            now = self.clock()
            if now <= self._t:
                return
            move_end = min(now, self._cmd_t + self.auto_stop_s)
            t = self._t
            while t < move_end - 1e-12 and self._vel != Command():
                dt = min(SUBSTEP_S, move_end - t)
                t += dt
                self._substep(dt, t)
            if now >= self._cmd_t + self.auto_stop_s:
                self._vel = Command()
            self._t = now

    def _substep(self, dt: float, t: float) -> None:
        """One Euler step with the midpoint heading:
        x += (vx cos th_m - vy sin th_m) dt,  y += (vx sin th_m + vy cos th_m) dt,  th += wz dt."""
        x, y, th = self._pose
        v = self._vel
        th_m = th + 0.5 * v.wz * dt
        nx = x + (v.vx * math.cos(th_m) - v.vy * math.sin(th_m)) * dt
        ny = y + (v.vx * math.sin(th_m) + v.vy * math.cos(th_m)) * dt
        if (nx, ny) != (x, y):
            g = self.geometry
            new = point_clearance(nx, ny, g.thin, g.rects, g.circles) - self.radius
            if new < 0 and new < point_clearance(x, y, g.thin, g.rects, g.circles) - self.radius:
                self._vel = Command()  # contact: the move is not taken (backing out of contact is)
                self.collisions += 1
                return
        self._pose = Pose(nx, ny, wrap(th + v.wz * dt))
        self._record(t)

    def _record(self, t: float) -> None:
        _, px, py, pth, ptag = self._path[-1]
        x, y, th = self._pose
        if (
            ptag != self._tag
            or math.hypot(x - px, y - py) >= PATH_MIN_STEP_M
            or abs(wrap(th - pth)) >= PATH_MIN_TURN_RAD
        ):
            self._path.append((t, x, y, th, self._tag))

    # ---- queries
    def _object(self, name: str) -> SimObject:
        for o in self.objects:
            if o.name == name:
                return o
        raise KeyError(f"no object {name!r} in the scene; have {[o.name for o in self.objects]}")

    def distance_to(self, name: str) -> float:
        """Robot centre to the object's near surface: centre distance minus half its size, >= 0."""
        o = self._object(name)
        x, y, _ = self.pose
        return max(0.0, math.hypot(o.x - x, o.y - y) - o.size_m / 2)

    def reached(self, name: str, reach_m: float = 0.6) -> bool:
        return self.distance_to(name) <= reach_m

    def clearance_m(self, heading_rad: float) -> float:
        """The range sensor (the safety layer's range source): free distance from the robot's edge along a
        body-frame heading, over the robot's width (three parallel rays: centre and both sides)."""
        x, y, th = self.pose
        a = th + heading_rad
        g = self.geometry
        ang = np.array([a])
        best = math.inf
        for side in (-self.radius, 0.0, self.radius):  # the rays start abreast the centre, across the body
            ox, oy = x - side * math.sin(a), y + side * math.cos(a)
            hits = ray_segments(ox, oy, ang, g.segs)[0]  # [S]
            if len(g.circles):
                hits = np.concatenate([hits, ray_circles(ox, oy, ang, g.circles)[0][0]])  # [S + C]
            best = min(best, float(hits.min()) if hits.size else math.inf)
        return max(0.0, best - self.radius)

    def sightings(
        self, pose: tuple[float, float, float] | None = None, hfov_deg: float = 90.0, max_range_m: float = 6.0
    ) -> list[Sighting]:
        """The objects the camera at `pose` (default: now) could see, nearest first.

        Seen: the centre within +-hfov/2 and max_range_m, and the ray to the centre meets
        the object's own surface before anything else (walls, obstacles, other objects).
        """
        x, y, th = self.pose if pose is None else pose
        g = self.geometry
        found = []
        for i, o in enumerate(self.objects):
            dc = math.hypot(o.x - x, o.y - y)
            bearing = wrap(math.atan2(o.y - y, o.x - x) - th)
            if dc > max_range_m or abs(math.degrees(bearing)) > hfov_deg / 2:
                continue
            ang = np.array([math.atan2(o.y - y, o.x - x)])
            ts = ray_segments(x, y, ang, g.segs)[0]  # [S]
            tc = ray_circles(x, y, ang, g.circles)[0][0] if len(g.circles) else np.zeros(0)  # [C]
            own = np.concatenate([ts[g.seg_owner == i], tc[g.circ_owner == i]])
            other = np.concatenate([ts[g.seg_owner != i], tc[g.circ_owner != i]])
            t_own = float(own.min()) if own.size else dc
            if other.size and float(other.min()) < t_own:
                continue
            found.append(Sighting(o.name, math.degrees(bearing), max(0.0, dc - o.size_m / 2), "sim"))
        return sorted(found, key=lambda s: s.distance_m)

    # ---- pictures
    def render_camera(
        self,
        width: int = 160,
        height: int = 120,
        hfov_deg: float = 90.0,
        pose: tuple[float, float, float] | None = None,
    ) -> np.ndarray:
        """The robot's camera view, [height, width, 3] uint8 BGR (see render_view)."""
        return render_view(self.geometry, self.pose if pose is None else pose, width, height, hfov_deg)

    def render_map(
        self,
        scale_px_per_m: float = 80,
        tag_colors: dict[str, tuple] | None = None,
        hfov_deg: float = 90.0,
        fov_range_m: float = 6.0,
    ) -> np.ndarray:
        """A top-down picture (BGR uint8): walls, obstacles, labelled objects, the path coloured by
        tag, the start, the robot with its heading and a faint field-of-view wedge."""
        with self._lock:
            pose, path = self.pose, self.path
        return draw_map(self, pose, path, scale_px_per_m, tag_colors, hfov_deg, fov_range_m)


# ---------------------------------------------------------------- top-down map

DEFAULT_TAG_COLORS = {"verified": (0, 170, 0), "offline": (0, 140, 255)}
OTHER_TAG_COLOR = (150, 150, 150)


def draw_map(
    world: SimWorld, pose: Pose, path: list, scale: float, tag_colors: dict | None, hfov_deg: float, fov_range_m: float
) -> np.ndarray:
    import cv2

    margin = 20
    x0, y0, x1, y1 = world.geometry.bounds
    wpx, hpx = int(round((x1 - x0) * scale)) + 2 * margin, int(round((y1 - y0) * scale)) + 2 * margin
    img: np.ndarray = np.full((hpx, wpx, 3), 245, np.uint8)  # [h, w, 3] uint8, BGR

    def px(x: float, y: float) -> tuple[int, int]:  # world (y up) -> image (row down)
        return int(round((x - x0) * scale)) + margin, int(round((y1 - y) * scale)) + margin

    # field of view: the visibility polygon from the camera, faint
    g = world.geometry
    ang = pose.theta + np.radians(np.linspace(-hfov_deg / 2, hfov_deg / 2, 61))
    t = np.full(ang.shape, fov_range_m)
    if len(g.segs):
        t = np.minimum(t, ray_segments(pose.x, pose.y, ang, g.segs).min(axis=1))
    if len(g.circles):
        t = np.minimum(t, ray_circles(pose.x, pose.y, ang, g.circles)[0].min(axis=1))
    rim = [px(pose.x + d * math.cos(a), pose.y + d * math.sin(a)) for a, d in zip(ang, t, strict=True)]
    poly = [px(pose.x, pose.y), *rim]
    overlay = img.copy()
    cv2.fillPoly(overlay, [np.array(poly, np.int32)], (150, 230, 255))
    img = cv2.addWeighted(overlay, 0.35, img, 0.65, 0)

    for o in world.obstacles:
        cv2.rectangle(img, px(o.x0, o.y1), px(o.x1, o.y0), (150, 150, 150), -1)
        cv2.rectangle(img, px(o.x0, o.y1), px(o.x1, o.y0), (80, 80, 80), 1)
    for s in world.walls:
        cv2.line(img, px(s[0], s[1]), px(s[2], s[3]), (60, 60, 60), 3)
    for ob in world.objects:
        h = ob.size_m / 2
        if ob.kind == "box":
            cv2.rectangle(img, px(ob.x - h, ob.y + h), px(ob.x + h, ob.y - h), ob.color_bgr, -1)
        else:
            cv2.circle(img, px(ob.x, ob.y), max(2, int(round(h * scale))), ob.color_bgr, -1, cv2.LINE_AA)
        lx, ly = px(ob.x - h, ob.y - h)
        cv2.putText(
            img, ob.name, (lx, min(ly + 12, hpx - 3)), cv2.FONT_HERSHEY_SIMPLEX, 0.35, (30, 30, 30), 1, cv2.LINE_AA
        )

    colors = {**DEFAULT_TAG_COLORS, **(tag_colors or {})}
    for tag, pts in _runs(path):
        cv2.polylines(
            img,
            [np.array([px(x, y) for x, y in pts], np.int32)],
            False,
            colors.get(tag, OTHER_TAG_COLOR),
            2,
            cv2.LINE_AA,
        )
    # turns in place draw no line: ring the places where a tagged run stayed put (offline turns, say)
    for tag, pts in _runs(path):
        if tag != "verified" and tag in colors and max(math.dist(pts[0], p) for p in pts) < 0.05:
            cv2.circle(img, px(*pts[0]), 7, colors[tag], 2, cv2.LINE_AA)
    legend = [(t, c) for t, c in colors.items() if any(tag == t for *_, tag in path)]
    for i, (tag, color) in enumerate(legend):
        cv2.line(img, (margin + 6, margin + 12 + 14 * i), (margin + 26, margin + 12 + 14 * i), color, 2)
        cv2.putText(
            img, tag, (margin + 30, margin + 16 + 14 * i), cv2.FONT_HERSHEY_SIMPLEX, 0.38, (30, 30, 30), 1, cv2.LINE_AA
        )

    for x, y, moving in list(getattr(world, "decisions", ())):  # where decisions were taken
        cv2.circle(img, px(x, y), 3, (90, 40, 160), 1 if moving else -1, cv2.LINE_AA)
    sx, sy = px(world.start.x, world.start.y)
    cv2.drawMarker(img, (sx, sy), (0, 0, 0), cv2.MARKER_TILTED_CROSS, 12, 2)
    cv2.putText(img, "start", (sx + 6, sy - 6), cv2.FONT_HERSHEY_SIMPLEX, 0.35, (0, 0, 0), 1, cv2.LINE_AA)
    c = px(pose.x, pose.y)
    cv2.circle(img, c, max(3, int(round(world.radius * scale))), (120, 60, 20), -1, cv2.LINE_AA)
    tip = px(pose.x + 0.45 * math.cos(pose.theta), pose.y + 0.45 * math.sin(pose.theta))
    cv2.arrowedLine(img, c, tip, (0, 0, 0), 2, cv2.LINE_AA, tipLength=0.3)
    return img


def _runs(path: list) -> list[tuple[str, list[tuple[float, float]]]]:
    """Split the path into runs of one tag; each run starts where the previous ended (no gaps)."""
    runs: list[tuple[str, list]] = []
    for _, x, y, _, tag in path:
        if runs and runs[-1][0] == tag:
            runs[-1][1].append((x, y))
        else:
            start = [runs[-1][1][-1]] if runs else []
            runs.append((tag, start + [(x, y)]))
    return [(tag, pts) for tag, pts in runs if len(pts) >= 2]


# ---------------------------------------------------------------- scenes (agent/robot/scene.py reads the files)


def make_world(
    scene: str | Path | Scene = DEFAULT_SCENE,
    start: int | tuple | list | None = None,
    clock: Callable[[], float] = time.monotonic,
    auto_stop_s: float = 1.0,
) -> SimWorld:
    """A world from a scene: a shipped scene's name ("red_box"), a scene file's path, or a loaded Scene.

    `start` is an index into the scene's starts, a pose (x, y, theta), or None (the first start).
    """
    sc = scene if isinstance(scene, Scene) else load_scene(scene, ROBOT_RADIUS_M)
    index = 0 if start is None else start if isinstance(start, int) and not isinstance(start, bool) else None
    if index is None:  # a pose given directly
        pose = tuple(float(v) for v in cast(Sequence[float], start))
        if len(pose) != 3:
            raise SceneError(f"a start pose is (x, y, theta), got {start!r}")
    elif -len(sc.starts) <= index < len(sc.starts):
        index %= len(sc.starts)
        pose = sc.starts[index]
    else:
        raise SceneError(
            f"scene {sc.path or sc.name}: start {index} out of range; it has "
            f"{len(sc.starts)} start(s), 0..{len(sc.starts) - 1}"
        )
    return SimWorld(
        **sc.world_kwargs(), pose=pose, clock=clock, auto_stop_s=auto_stop_s, scene=sc.name, spec=sc, start_index=index
    )


def __getattr__(name: str):
    """START_POSES, the old table of the built-in scenes' starts, now read from their files."""
    if name == "START_POSES":
        from .scene import builtin_scenes

        return {n: list(load_scene(n).starts) for n in builtin_scenes()}
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# ---------------------------------------------------------------- camera source


class SimCamera:
    """The FrameSource (agent.robot.camera) of the simulator: renders the world at `fps` (real time)."""

    def __init__(self, world: SimWorld, fps: float = 10, width: int = 160, height: int = 120, hfov_deg: float = 90.0):
        self.world, self.fps, self.width, self.height, self.hfov_deg = world, fps, width, height, hfov_deg
        self._closed = threading.Event()
        self._next = 0.0

    def open(self) -> None:
        self._closed.clear()
        self._next = time.monotonic()

    def read(self) -> tuple[np.ndarray, dict] | None:
        """Wait for the next frame time (stop-aware), render; None once closed."""
        if self._closed.wait(max(0.0, self._next - time.monotonic())):
            return None
        self._next = max(self._next + 1.0 / self.fps, time.monotonic())
        pose = self.world.pose  # the image and its pose belong to the same moment
        image = render_view(self.world.geometry, pose, self.width, self.height, self.hfov_deg)
        return image, {"pose": tuple(pose), "source": "sim"}

    def close(self) -> None:
        self._closed.set()


def _sim_source(source: str, *, world: SimWorld | None = None, fps: int = 15, **_: object) -> SimCamera:
    if world is None:
        raise CameraError("camera source 'sim' needs the sim controller's world (robot.controller = 'sim')")
    return SimCamera(world, fps=fps)


register_source("sim", _sim_source)
