"""One instruction run to its end in the simulator, and the numbers that say how it went.

    target_object(world, instruction)   the object the instruction names (the most shared words, as
                                        agent.app.prompt.relevant scores a sighting; the nearest on a tie)
    navigate(nav, world, instruction, max_steps)
                                        step the Navigator through the one episode loop
                                        (agent/robot/episode.py run_episode: until the model says stop,
                                        three unparseable answers in a row, or max_steps steps), hooks
                                        before and after each step (a link cut, a printer), and summarize
    summarize(world, records, ...)      the summary: the names `edge-agent run --json`, tools/demo.py
                                        and tools/robot/nav_eval.py all report

Every step counts toward max_steps, a refused one too (offline hold, a stale frame): an
episode is bounded in steps whatever the link does. The daemon's own task loop
(agent/app/daemon.py) ends a task on the same conditions and counts only moving steps; its
records go through the same `summarize`.

    SPL = reached * shortest_m / max(path_m, shortest_m)    (agent/robot/shortest.py)
"""

from __future__ import annotations

import math
import threading
import time
from typing import Callable

from agent.robot.episode import run_episode
from agent.robot.perception import Sighting
from agent.robot.shortest import shortest_to_object
from agent.robot.sim import SimWorld

from .navigator import Navigator, Step
from .overlap import Overlapped, mark_decision
from .prompt import relevant


def target_object(world: SimWorld, instruction: str) -> str | None:
    """The name of the object `instruction` names best, None when it names none.

    The scene's own target when the instruction is the scene's; else every object scored by the
    words its name shares with the instruction (agent.app.prompt.relevant), the nearest of the best.
    """
    spec = getattr(world, "spec", None)
    if spec is not None and spec.target and instruction.strip().lower() == spec.task().lower():
        return spec.target
    x, y, _ = world.pose
    everything = [
        Sighting(o.name, 0.0, max(0.0, math.hypot(o.x - x, o.y - y) - o.size_m / 2), "sim") for o in world.objects
    ]
    best = relevant(everything, instruction)
    return best[0].name if best else None


def path_length(path: list[tuple], since_t: float = -math.inf) -> float:
    """Metres along a SimWorld.path ((t, x, y, theta, tag) points) from time since_t on."""
    pts = [p for p in path if p[0] >= since_t]
    return sum(math.hypot(b[1] - a[1], b[2] - a[2]) for a, b in zip(pts, pts[1:], strict=False))


def summarize(
    world: SimWorld,
    records: list[Step],
    instruction: str,
    *,
    target: str | None = None,
    end: str = "",
    since_t: float = -math.inf,
    collisions0: int = 0,
    start: tuple | None = None,
    wall_s: float | None = None,
    reach_m: float = 0.6,
) -> dict:
    """How an episode went (JSON-ready).

    world: the SimWorld it ran in; records: its Navigator steps; target: the object it was after
    (default: target_object); since_t / collisions0: the world's clock and collision count when it
    began (the defaults count the world's whole life); start: the start pose (default world.start).
    """
    target = target if target is not None else target_object(world, instruction)
    start = tuple(start) if start is not None else tuple(world.start)
    verified = [r for r in records if r.mode == "verified" and r.parse != "refused"]  # acted on, verified
    taus = [r.decode["tau"] for r in verified if r.decode.get("tau")]
    step_s = [r.latency_ms["step"] / 1e3 for r in records if "step" in r.latency_ms]
    reached = world.reached(target, reach_m) if target else False
    path_m = path_length(world.path, since_t)
    shortest_m = shortest_to_object(world, target, start[:2], reach_m) if target else math.inf
    spl = shortest_m / max(path_m, shortest_m, 1e-9) if reached and math.isfinite(shortest_m) else 0.0
    if reached and shortest_m == 0.0:
        spl = 1.0  # started within reach: nothing to walk
    spec = getattr(world, "spec", None)
    return {
        "scene": world.scene,
        "scene_file": spec.path if spec is not None else "",
        "start": world.start_index if getattr(world, "start_index", None) is not None else list(start),
        "instruction": instruction,
        "target": target,
        "end": end,
        "reached": reached,
        "steps": len(records),
        "distance_m": round(world.distance_to(target), 3) if target else None,
        "collisions": world.collisions - collisions0,
        "verified_steps": len(verified),
        "offline_steps": sum(r.mode == "offline" for r in records),
        "unverified_tokens": sum(r.unverified_tokens for r in records),
        "path_m": round(path_m, 3),
        "shortest_m": round(shortest_m, 3) if math.isfinite(shortest_m) else None,
        "spl": round(spl, 4),
        "mean_tau": round(sum(taus) / len(taus), 3) if taus else None,
        "mean_step_s": round(sum(step_s) / len(step_s), 3) if step_s else None,
        "mean_think_s_verified": round(
            sum(r.latency_ms.get("generate", 0.0) for r in verified) / max(1, len(verified)) / 1e3, 3
        ),
        "parses": {k: sum(r.parse == k for r in records) for k in ("exact", "tolerant", "miss", "refused")},
        # motions the obstacle stop cut short, and steps whose answer grammar left actions out (agent/robot/feasible.py)
        "cut_short": sum(r.stopped_by == "obstacle" for r in records),
        "cut_short_share": round(sum(r.stopped_by == "obstacle" for r in records) / len(records), 3)
        if records
        else 0.0,
        "refused_steps": sum(bool(r.refused) for r in records),
        "wall_s": round(wall_s, 2) if wall_s is not None else None,
        # agent.overlap: the robot's time moving, the steps decided during the previous motion, plans refused
        "moving_s": round(moving_s(records), 2),
        "moving_share": round(moving / wall_s, 3) if wall_s and (moving := moving_s(records)) else 0.0,
        "overlapped_steps": sum(bool(r.decided_during) for r in records),
        "stale_refused": sum(r.parse == "refused" and "older than its frame" in r.reason for r in records),
    }


def moving_s(records: list[Step]) -> float:
    """Seconds the robot spent running motions over the records."""
    return sum(r.latency_ms.get("act", 0.0) for r in records) / 1e3


def navigate(
    nav: Navigator,
    world: SimWorld,
    instruction: str,
    max_steps: int = 30,
    *,
    task: str = "episode",
    before_step: Callable[[int], None] | None = None,
    on_step: Callable[[int, Step], None] | None = None,
    cancel: threading.Event | None = None,
    overlap: bool | None = None,
) -> tuple[dict, list[Step]]:
    """Step `nav` (an agent.app.navigator.Navigator driving `world`) on `instruction`; returns (summary, records).

    before_step(n) runs before step n (1-based; the link cut goes here), on_step(n, record) after it.
    The summary's `end`: done (the model said stop), unparseable, or max_steps (agent/robot/episode.py).
    overlap: decide each step during the previous motion (agent/app/overlap.py); None: agent.overlap.
    """
    target = target_object(world, instruction)
    t0, collisions0, start, wall0 = world.clock(), world.collisions, tuple(world.pose), time.perf_counter()
    if overlap is None:  # agent.overlap: think while moving (a stand-in config without it: no)
        overlap = getattr(nav.cfg.agent, "overlap", False)
    runner = Overlapped(nav) if overlap else None

    def step(n: int) -> Step:
        if runner is None:
            rec = nav.step(instruction, task=task, cancel=cancel)
        else:
            rec = runner.step(instruction, task, cancel, last=n == max_steps)
        mark_decision(world, rec)
        return rec

    try:
        end, records = run_episode(step, max_steps, before_step=before_step, on_step=on_step)
    finally:
        if runner is not None:
            runner.drop()
    summary = summarize(
        world,
        records,
        instruction,
        target=target,
        end=end,
        since_t=t0,
        collisions0=collisions0,
        start=start,
        wall_s=time.perf_counter() - wall0,
        reach_m=nav.cfg.agent.reach_m,
    )
    return summary, records
