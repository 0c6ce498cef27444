"""What the robot will see where its current motion ends: an overlapped step's look, moved by dead reckoning.

With `agent.overlap` the next step is decided while the current motion runs (agent/app/overlap.py). Its frame is
taken as the motion starts; with `agent.overlap_look = "end"` (the default) what that frame shows is moved to the
pose the motion will reach, so the plan is made for where the robot will be when it acts on it:

    a sighting at distance r and bearing b (positive left) sits at (x, y) = (r cos b, r sin b) in the robot's frame;
    a forward move of d = vx * T puts it at (x - d, y), a turn of a = wz * T at bearing b' = atan2(y, x - d) - a;
    a sighting whose new bearing leaves the camera's field of view (|b'| > hfov / 2) is dropped.

The range ahead is read the same way: after a forward move, the free distance ahead less d; after a turn, the range
sensor's reading along the heading the robot will face. Nothing here sees what the motion will bring into view:
the next step after it does. The safety layer checks every command against the live ranges whatever was predicted.
"""

from __future__ import annotations

import math
from typing import Callable

from agent.robot.actions import Motion
from agent.robot.perception import Sighting


def travel(motion: Motion) -> tuple[float, float]:
    """(metres forward, radians turned left) the motion covers (the executor's ramp-down gives back its ramp-up)."""
    return motion.cmd.vx * motion.duration_s, motion.cmd.wz * motion.duration_s


def seen_after(sightings: list[Sighting], motion: Motion, hfov_deg: float) -> list[Sighting]:
    """The sightings as the camera will see them from the pose `motion` reaches (those still in view)."""
    d, a = travel(motion)
    out = []
    for s in sightings:
        b = math.radians(s.bearing_deg)
        x, y = s.distance_m * math.cos(b) - d, s.distance_m * math.sin(b)
        bearing = math.degrees(math.atan2(y, x) - a)
        bearing = (bearing + 180.0) % 360.0 - 180.0
        if abs(bearing) <= hfov_deg / 2:
            out.append(Sighting(s.name, bearing, max(0.0, math.hypot(x, y)), s.source))
    return sorted(out, key=lambda s: s.distance_m)


def clearance_after(clearance_m: Callable[[float], float | None], motion: Motion) -> float | None:
    """The free distance ahead from the pose `motion` reaches. clearance_m(heading_rad): the range source's
    reading along a body-frame heading (positive left), None when it measures nothing."""
    d, a = travel(motion)
    if abs(a) > 1e-6:
        return clearance_m(a)
    ahead = clearance_m(0.0)
    return None if ahead is None else max(0.0, ahead - d)
