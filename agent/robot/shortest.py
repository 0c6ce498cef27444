"""The shortest path a robot could take to reach a target: the yardstick of SPL (success weighted by path length).

On an occupancy grid (5 cm cells by default) whose free cells are those where the robot's
centre keeps its radius from every wall, obstacle and object (the obstacles inflated by
the radius), Dijkstra with 8-connectivity finds the shortest cell path from the start to any
cell within reach of the target; a diagonal step may not cut a blocked corner. An 8-connected
path is up to 8 % longer than the straight line (1 + sqrt(2) over hypot(1, 1) for a 22.5 degree
line), so the path is then pulled taut: from each corner, the farthest later cell in clear line
of sight. What remains is the length a robot driving straight segments would need.

    SPL = success * shortest / max(path, shortest)          (Anderson et al., 2018)

Pure functions, numpy in and numpy out; `shortest_to_object` applies them to a SimWorld.
"""

from __future__ import annotations

import heapq
import math
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from .sim import SimWorld

DIAG = math.sqrt(2.0)
NEIGHBOURS = [
    (-1, 0, 1.0),
    (1, 0, 1.0),
    (0, -1, 1.0),
    (0, 1, 1.0),
    (-1, -1, DIAG),
    (-1, 1, DIAG),
    (1, -1, DIAG),
    (1, 1, DIAG),
]


def clearance_grid(
    xs: np.ndarray, ys: np.ndarray, segs: np.ndarray, rects: np.ndarray, circles: np.ndarray
) -> np.ndarray:
    """Distance from each grid point to the nearest geometry (0 inside a rectangle, negative inside a circle).

    xs [W] and ys [H] cell centres; segs [S, 4] thin walls, rects [R, 4] (x0, y0, x1, y1), circles [C, 3]
    (cx, cy, r) -> [H, W]. The same distances as sim.point_clearance, for every point at once.
    """
    px, py = np.meshgrid(xs, ys)  # [H, W]
    best = np.full(px.shape, np.inf)
    for ax, ay, bx, by in segs:
        ex, ey = bx - ax, by - ay
        s = np.clip(((px - ax) * ex + (py - ay) * ey) / max(ex * ex + ey * ey, 1e-12), 0.0, 1.0)
        best = np.minimum(best, np.hypot(ax + s * ex - px, ay + s * ey - py))
    for x0, y0, x1, y1 in rects:
        best = np.minimum(
            best, np.hypot(np.maximum(np.maximum(x0 - px, px - x1), 0.0), np.maximum(np.maximum(y0 - py, py - y1), 0.0))
        )
    for cx, cy, r in circles:
        best = np.minimum(best, np.hypot(px - cx, py - cy) - r)
    return best


def grid_path(free: np.ndarray, start: tuple[int, int], goal: np.ndarray) -> list[tuple[int, int]] | None:
    """The shortest 8-connected path of cells from `start` (row, col) to any cell where `goal` is True.

    free [H, W] bool, goal [H, W] bool. Straight steps cost 1, diagonal ones sqrt(2); a diagonal
    step needs both cells beside it free (no squeezing past a corner). The start counts as free.
    Returns the cells from start to goal inclusive, or None when no goal cell can be reached.
    """
    h, w = free.shape
    if free.shape != goal.shape:
        raise ValueError(f"free {free.shape} and goal {goal.shape} must have the same shape")
    if not (0 <= start[0] < h and 0 <= start[1] < w):
        raise ValueError(f"start {start} is outside the {h} x {w} grid")
    dist = np.full((h, w), np.inf)
    parent: dict[tuple[int, int], tuple[int, int]] = {}
    dist[start] = 0.0
    heap = [(0.0, start)]
    while heap:
        d, (i, j) = heapq.heappop(heap)
        if d > dist[i, j]:
            continue
        if goal[i, j]:
            path = [(i, j)]
            while path[-1] != start:
                path.append(parent[path[-1]])
            return path[::-1]
        for di, dj, cost in NEIGHBOURS:
            ni, nj = i + di, j + dj
            if not (0 <= ni < h and 0 <= nj < w) or not free[ni, nj]:
                continue
            if di and dj and not (free[i, nj] and free[ni, j]):
                continue
            nd = d + cost
            if nd < dist[ni, nj]:
                dist[ni, nj] = nd
                parent[(ni, nj)] = (i, j)
                heapq.heappush(heap, (nd, (ni, nj)))
    return None


def _visible(free: np.ndarray, a: tuple[int, int], b: tuple[int, int]) -> bool:
    """Every cell the segment between the centres of a and b crosses is free (sampled every quarter cell)."""
    n = int(math.ceil(4 * math.hypot(b[0] - a[0], b[1] - a[1]))) + 1
    rows = np.rint(np.linspace(a[0], b[0], n)).astype(int)
    cols = np.rint(np.linspace(a[1], b[1], n)).astype(int)
    return bool(free[rows, cols].all())


def taut_length(free: np.ndarray, path: list[tuple[int, int]]) -> float:
    """The length (in cells) of `path` pulled taut: from each corner, straight to the farthest visible cell."""
    total, i = 0.0, 0
    while i < len(path) - 1:
        j = i + 1
        while j + 1 < len(path) and _visible(free, path[i], path[j + 1]):
            j += 1
        total += math.hypot(path[j][0] - path[i][0], path[j][1] - path[i][1])
        i = j
    return total


def shortest_length(free: np.ndarray, start: tuple[int, int], goal: np.ndarray, cell_m: float) -> float:
    """Metres from `start` to the nearest goal cell through free cells (taut), inf when unreachable."""
    path = grid_path(free, start, goal)
    if path is None:
        return math.inf
    free = free.copy()
    free[start] = True
    return taut_length(free, path) * cell_m


def shortest_to_object(
    world: SimWorld, name: str, start: tuple[float, float] | None = None, reach_m: float = 0.6, cell_m: float = 0.05
) -> float:
    """Metres the robot's centre must travel from `start` (default: the world's start pose) until the object
    `name` is within reach (SimWorld.reached: centre to the object's near side <= reach_m); inf if it cannot."""
    x, y = (world.start.x, world.start.y) if start is None else start
    found = [o for o in world.objects if o.name == name]
    if not found:
        raise KeyError(f"no object {name!r} in the scene; have {[o.name for o in world.objects]}")
    obj = found[0]
    if math.hypot(obj.x - x, obj.y - y) - obj.size_m / 2 <= reach_m:
        return 0.0
    g = world.geometry
    x0, y0, x1, y1 = g.bounds
    xs = x0 + (np.arange(int(math.ceil((x1 - x0) / cell_m))) + 0.5) * cell_m  # [W] cell centres
    ys = y0 + (np.arange(int(math.ceil((y1 - y0) / cell_m))) + 0.5) * cell_m  # [H]
    free = clearance_grid(xs, ys, g.thin, g.rects, g.circles) >= world.radius  # [H, W]
    px, py = np.meshgrid(xs, ys)
    goal = free & (np.hypot(px - obj.x, py - obj.y) - obj.size_m / 2 <= reach_m)
    cell = (min(len(ys) - 1, max(0, int((y - y0) / cell_m))), min(len(xs) - 1, max(0, int((x - x0) / cell_m))))
    return shortest_length(free, cell, goal, cell_m)  # from the start cell's centre: within 3.5 cm
