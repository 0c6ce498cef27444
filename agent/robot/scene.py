"""Scenes for the simulator: a room, its objects and obstacles, and the robot's start poses, read from JSON.

A scene file (metres, radians; x right, y up, origin at the room's lower-left corner):

    {"size_m": [6.0, 5.0],
     "objects":   [{"name": "red box", "kind": "box", "x": 5.3, "y": 4.3,
                    "size_m": 0.4, "height_m": 0.4, "color_bgr": [0, 0, 220]}, ...],
     "obstacles": [{"x0": 2.6, "y0": 4.4, "x1": 3.4, "y1": 5.0, "height_m": 0.8, "name": "shelf"}, ...],
     "starts":    [[1.0, 1.0, 0.0], ...],
     "walls":     [[x0, y0, x1, y1], ...],          optional: thin interior walls
     "target": "red box",                           optional: what an episode looks for
     "instruction": "go to the red box",            optional (default "go to the <target>")
     "description": "..."}                          optional, free text

Every field is checked on load and an error names the file and the field
(`objects[2].x`): unknown keys, wrong types, a kind other than box/ball, an
object or obstacle outside the room, a start the robot (a circle of
`robot_radius_m`) would not fit at, a target that is not an object.

A scene name ("red_box") resolves to the file shipped in agent/robot/scenes/;
anything with a slash or ending in .json is a path.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn, Sequence

SCENE_DIR = Path(__file__).with_name("scenes")  # the built-in scenes, shipped as package data
DEFAULT_SCENE = "red_box"


class SceneError(ValueError):
    """A scene file that cannot be used; the message names the file and the field."""


@dataclass(frozen=True)
class SimObject:
    name: str  # "red box"
    kind: str  # "box" (axis-aligned square) | "ball" (circle)
    x: float  # centre, m
    y: float
    size_m: float = 0.4  # side of a box, diameter of a ball
    height_m: float = 0.4
    color_bgr: tuple[int, int, int] = (0, 0, 220)

    def __post_init__(self):
        if self.kind not in ("box", "ball"):
            raise ValueError(f"SimObject kind must be 'box' or 'ball', got {self.kind!r}")
        if not (self.size_m > 0 and self.height_m > 0):
            raise ValueError(f"SimObject {self.name!r}: size and height must be positive")


@dataclass(frozen=True)
class Obstacle:
    """An axis-aligned grey block, corners (x0, y0) .. (x1, y1)."""

    x0: float
    y0: float
    x1: float
    y1: float
    height_m: float = 0.8
    name: str = "obstacle"


@dataclass(frozen=True)
class Scene:
    name: str  # the file's stem ("red_box")
    size_m: tuple[float, float]  # room width (x) and depth (y)
    objects: tuple[SimObject, ...]
    obstacles: tuple[Obstacle, ...]
    starts: tuple[tuple[float, float, float], ...]  # (x, y, theta) poses; at least one
    walls: tuple[tuple[float, float, float, float], ...] = ()
    target: str = ""  # an object's name, "" when the scene names none
    instruction: str = ""  # "" = "go to the <target>"
    description: str = ""
    path: str = ""  # the file it came from

    def world_kwargs(self) -> dict:
        """The SimWorld constructor's geometry arguments."""
        return dict(size_m=self.size_m, objects=self.objects, obstacles=self.obstacles, walls=self.walls)

    def task(self) -> str:
        """The instruction an episode in this scene is given."""
        return self.instruction or (f"go to the {self.target}" if self.target else "")

    def to_json(self) -> dict:
        d = {
            "size_m": list(self.size_m),
            "objects": [
                {
                    "name": o.name,
                    "kind": o.kind,
                    "x": o.x,
                    "y": o.y,
                    "size_m": o.size_m,
                    "height_m": o.height_m,
                    "color_bgr": list(o.color_bgr),
                }
                for o in self.objects
            ],
            "obstacles": [
                {"x0": o.x0, "y0": o.y0, "x1": o.x1, "y1": o.y1, "height_m": o.height_m, "name": o.name}
                for o in self.obstacles
            ],
            "starts": [list(s) for s in self.starts],
        }
        for key in ("walls", "target", "instruction", "description"):
            value = getattr(self, key)
            if value:
                d[key] = [list(w) for w in value] if key == "walls" else value
        return d


def builtin_scenes() -> list[str]:
    """The names of the shipped scenes."""
    return sorted(p.stem for p in SCENE_DIR.glob("*.json"))


def scene_path(scene: str | Path) -> Path:
    """A scene name -> its shipped file; a path (has a slash or ends in .json) -> itself."""
    s = str(scene)
    if isinstance(scene, Path) or "/" in s or s.endswith(".json"):
        return Path(scene)
    path = SCENE_DIR / f"{s}.json"
    if not path.exists():
        raise SceneError(f"unknown scene {s!r}: give a .json path or one of {builtin_scenes()}")
    return path


def load_scene(scene: str | Path, robot_radius_m: float = 0.2) -> Scene:
    """Read and check a scene file (a name of a shipped scene or a path); SceneError says what is wrong."""
    path = scene_path(scene)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise SceneError(f"scene file {path} not found") from None
    except (OSError, UnicodeDecodeError) as e:
        raise SceneError(f"scene file {path}: {e}") from None
    except json.JSONDecodeError as e:
        raise SceneError(f"scene file {path}: not JSON: {e}") from None
    return parse_scene(data, name=path.stem, source=str(path), robot_radius_m=robot_radius_m)


# ---------------------------------------------------------------- checking

_TOP = {"size_m", "objects", "obstacles", "starts", "walls", "target", "instruction", "description"}
_OBJECT = {"name", "kind", "x", "y", "size_m", "height_m", "color_bgr"}
_OBSTACLE = {"x0", "y0", "x1", "y1", "height_m", "name"}


class _Checker:
    """Checks one scene file's values; every failure is a SceneError that names the file and the field."""

    def __init__(self, source: str) -> None:
        self.source = source
        self.room = (math.inf, math.inf)  # width, depth (m), once size_m is read

    def fail(self, field: str, why: str) -> NoReturn:
        raise SceneError(f"scene {self.source}: {field}: {why}")

    def table(self, value: object, field: str, known: set[str], required: set[str]) -> dict[str, Any]:
        if not isinstance(value, dict):
            self.fail(field, f"must be an object, got {type(value).__name__}")
        unknown = sorted(set(value) - known)
        if unknown:
            self.fail(field, f"unknown key(s) {unknown}; known: {sorted(known)}")
        missing = sorted(required - set(value))
        if missing:
            self.fail(field, f"missing key(s) {missing}")
        return value

    def number(self, value: object, field: str, positive: bool = False) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            self.fail(field, f"must be a finite number, got {value!r}")
        if positive and value <= 0:
            self.fail(field, f"must be positive, got {value!r}")
        return float(value)

    def text(self, value: object, field: str) -> str:
        if not isinstance(value, str) or not value.strip():
            self.fail(field, f"must be a non-empty string, got {value!r}")
        return value

    def numbers(self, value: object, field: str, n: int) -> tuple[float, ...]:
        if not isinstance(value, list) or len(value) != n:
            self.fail(field, f"must be a list of {n} numbers, got {value!r}")
        return tuple(self.number(v, f"{field}[{i}]") for i, v in enumerate(value))

    def items(self, value: object, field: str) -> list[Any]:
        if not isinstance(value, list):
            self.fail(field, f"must be a list, got {type(value).__name__}")
        return value

    def inside(self, x0: float, y0: float, x1: float, y1: float, field: str) -> None:
        w, d = self.room
        if x0 < 0 or y0 < 0 or x1 > w or y1 > d:
            self.fail(field, f"extends outside the {w:g} x {d:g} m room: x {x0:g}..{x1:g}, y {y0:g}..{y1:g}")


def _object(c: _Checker, o: object, f: str) -> SimObject:
    """objects[i]: a box or a ball inside the room."""
    o = c.table(o, f, _OBJECT, {"name", "kind", "x", "y"})
    kind = o["kind"]
    if kind not in ("box", "ball"):
        c.fail(f"{f}.kind", f"must be 'box' or 'ball', got {kind!r}")
    color = c.numbers(o.get("color_bgr", [0, 0, 220]), f"{f}.color_bgr", 3)
    if any(v != int(v) or not 0 <= v <= 255 for v in color):
        c.fail(f"{f}.color_bgr", f"must be three integers 0..255, got {o['color_bgr']!r}")
    b, g, r = (int(v) for v in color)
    ob = SimObject(
        c.text(o["name"], f"{f}.name"),
        kind,
        c.number(o["x"], f"{f}.x"),
        c.number(o["y"], f"{f}.y"),
        c.number(o.get("size_m", 0.4), f"{f}.size_m", positive=True),
        c.number(o.get("height_m", 0.4), f"{f}.height_m", positive=True),
        (b, g, r),
    )
    h = ob.size_m / 2
    c.inside(ob.x - h, ob.y - h, ob.x + h, ob.y + h, f)
    return ob


def _obstacle(c: _Checker, o: object, f: str) -> Obstacle:
    """obstacles[i]: an axis-aligned block inside the room."""
    o = c.table(o, f, _OBSTACLE, {"x0", "y0", "x1", "y1"})
    x0, y0, x1, y1 = (c.number(o[k], f"{f}.{k}") for k in ("x0", "y0", "x1", "y1"))
    if x1 <= x0 or y1 <= y0:
        c.fail(f, f"needs x0 < x1 and y0 < y1, got ({x0:g}, {y0:g}) .. ({x1:g}, {y1:g})")
    c.inside(x0, y0, x1, y1, f)
    height = c.number(o.get("height_m", 0.8), f"{f}.height_m", positive=True)
    return Obstacle(x0, y0, x1, y1, height, c.text(o.get("name", "obstacle"), f"{f}.name"))


def _wall(c: _Checker, s: object, f: str) -> tuple[float, float, float, float]:
    """walls[i]: a segment [x0, y0, x1, y1] inside the room."""
    x0, y0, x1, y1 = c.numbers(s, f, 4)
    c.inside(min(x0, x1), min(y0, y1), max(x0, x1), max(y0, y1), f)
    return x0, y0, x1, y1


def _start(c: _Checker, s: object, f: str) -> tuple[float, float, float]:
    """starts[i]: a pose [x, y, theta]."""
    x, y, theta = c.numbers(s, f, 3)
    return x, y, theta


def parse_scene(data: object, name: str = "custom", source: str = "<scene>", robot_radius_m: float = 0.2) -> Scene:
    """A Scene from a parsed scene file (see the module docstring); SceneError on anything wrong."""
    c = _Checker(source)
    top = c.table(data, "scene", _TOP, {"size_m", "objects", "starts"})
    w, d = c.numbers(top["size_m"], "size_m", 2)
    if w <= 0 or d <= 0:
        c.fail("size_m", f"must be positive, got {[w, d]}")
    c.room = (w, d)
    objects = [_object(c, o, f"objects[{i}]") for i, o in enumerate(c.items(top["objects"], "objects"))]
    names = [o.name for o in objects]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        c.fail("objects", f"names must be unique (episodes find their target by name), repeated: {dup}")
    obstacles = [
        _obstacle(c, o, f"obstacles[{i}]") for i, o in enumerate(c.items(top.get("obstacles", []), "obstacles"))
    ]
    walls = [_wall(c, s, f"walls[{i}]") for i, s in enumerate(c.items(top.get("walls", []), "walls"))]

    starts = [_start(c, s, f"starts[{i}]") for i, s in enumerate(c.items(top["starts"], "starts"))]
    if not starts:
        c.fail("starts", "needs at least one [x, y, theta]")
    for i, (x, y, _) in enumerate(starts):
        blocker = _blocker(x, y, robot_radius_m, w, d, objects, obstacles, walls)
        if blocker:
            c.fail(f"starts[{i}]", f"the robot (radius {robot_radius_m:g} m) at ({x:g}, {y:g}) overlaps {blocker}")

    target = top.get("target", "")
    if target and target not in names:
        c.fail("target", f"{target!r} is not one of the objects {names}")
    instruction = c.text(top["instruction"], "instruction") if "instruction" in top else ""
    description = top.get("description", "")
    if not isinstance(description, str):
        c.fail("description", "must be a string")
    return Scene(
        name,
        (w, d),
        tuple(objects),
        tuple(obstacles),
        tuple(starts),
        tuple(walls),
        target,
        instruction,
        description,
        source,
    )


def _blocker(
    x: float,
    y: float,
    r: float,
    w: float,
    d: float,
    objects: Sequence[SimObject],
    obstacles: Sequence[Obstacle],
    walls: Sequence[tuple[float, float, float, float]],
) -> str:
    """What a circle of radius r at (x, y) overlaps, "" if nothing."""
    if x - r < 0 or y - r < 0 or x + r > w or y + r > d:
        return "the room's walls"
    for block in obstacles:
        if math.hypot(max(block.x0 - x, 0.0, x - block.x1), max(block.y0 - y, 0.0, y - block.y1)) < r:
            return f"obstacle {block.name!r}"
    for o in objects:
        h = o.size_m / 2
        gap = (
            math.hypot(max(abs(x - o.x) - h, 0.0), max(abs(y - o.y) - h, 0.0))
            if o.kind == "box"
            else math.hypot(x - o.x, y - o.y) - h
        )
        if gap < r:
            return f"object {o.name!r}"
    for x0, y0, x1, y1 in walls:
        ex, ey = x1 - x0, y1 - y0
        s = min(1.0, max(0.0, ((x - x0) * ex + (y - y0) * ey) / max(ex * ex + ey * ey, 1e-12)))
        if math.hypot(x0 + s * ex - x, y0 + s * ey - y) < r:
            return f"wall ({x0:g}, {y0:g})-({x1:g}, {y1:g})"
    return ""
