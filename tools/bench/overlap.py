"""Sequential against overlapped stepping (agent.overlap), side by side in one run, on the demo's setup.

One local server-bridge (the float32 target) behind the network emulator (20 ms RTT) on its own core, the robot
daemon (sim robot, camera, perception "sim", the draft, the safety layer, the control loop) on the other, as
`make demo` runs them. For every episode (the demo's four starts, then the first start of every other shipped
scene) the same daemon runs it twice from the same pose: sequential (look, think, move) and overlapped (step k + 1
decided while motion k runs, agent/app/overlap.py). Per episode and mode: time to goal (the episode's wall time),
the share of it the robot moved, steps, path length, success, collisions, plans refused as stale, offline steps.

The chat-load line: one overlapped episode (the demo's start 0) again while two clients stream chat answers in a
loop through the daemon's draft-model service (DraftService.chat_client(), the Client the OpenAI endpoint
serves): its mean step time against the same episode without them, and its stale refusals.

    python -m tools.bench.overlap                      # every episode (about 20 minutes on a quiet machine)
    python -m tools.bench.overlap --episodes 4 --max-steps 20

Writes docs/benchmarks/overlap/overlap.json (with the command and the config), overlap.md and overlap.png.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

import cv2

from agent.app.daemon import Daemon
from agent.robot.scene import Scene, builtin_scenes, load_scene
from tools.bench.link import served
from tools.cluster.netem import LinkProfile
from tools.robot.episode import navigate_with_cut, restart
from tools.robot.nav_eval import add_robot_args, robot_config

OUT = Path("docs/benchmarks/overlap")
TELEMETRY = Path("build/overlap_telemetry.jsonl")  # one JSON line per step, both modes
CHAT = [{"role": "user", "content": "Write a long story about a robot dog walking in a park."}]
KEYS = ("wall_s", "moving_share", "steps", "path_m", "reached", "collisions", "stale_refused", "offline_steps")


def episodes(limit: int | None) -> list[tuple[str, int]]:
    """(scene, start): the demo's four starts, then the first start of every other shipped scene."""
    demo = load_scene("red_box")
    out = [("red_box", i) for i in range(len(demo.starts))]
    out += [(name, 0) for name in builtin_scenes() if name != "red_box"]
    return out[:limit] if limit else out


def run_one(daemon: Daemon, scene: Scene, start: int, overlap: bool, max_steps: int) -> dict:
    """One episode from the scene's start pose, sequential or overlapped; its summary."""
    restart(daemon, scene.starts[start], start, timeout_s=60.0)  # a loaded machine renders slowly
    tag = f"{scene.name}-{start}-{'overlapped' if overlap else 'sequential'}-{time.monotonic():.0f}"
    summary, records = navigate_with_cut(
        daemon, daemon.world, scene.task(), max_steps, task=tag, say=None, overlap=overlap
    )
    step_s = [r.latency_ms["step"] / 1e3 for r in records if "step" in r.latency_ms and r.parse != "refused"]
    summary["mean_step_s"] = round(statistics.mean(step_s), 3) if step_s else None
    summary["standing_s"] = round(sum(r.latency_ms.get("standing", 0.0) for r in records) / 1e3, 2)
    summary["overlap"] = overlap
    summary["scene"] = scene.name
    return {k: summary[k] for k in ("scene", "start", "overlap", "end", "mean_step_s", "moving_s", "standing_s", *KEYS)}


class ChatLoad:
    """Two clients streaming chat answers in a loop through the daemon's draft-model service."""

    def __init__(self, daemon: Daemon, clients: int = 2, max_tokens: int = 200) -> None:
        assert daemon.drafts is not None
        self.client = daemon.drafts.chat_client()
        self.stop = threading.Event()
        self.tokens = 0
        self.threads = [threading.Thread(target=self._loop, args=(max_tokens,), daemon=True) for _ in range(clients)]

    def _loop(self, max_tokens: int) -> None:
        while not self.stop.is_set():
            for piece in self.client.stream(messages=CHAT, max_tokens=max_tokens):
                self.tokens += bool(piece)
                if self.stop.is_set():
                    break

    def __enter__(self) -> ChatLoad:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(120)
        self.client.close()


def table(rows: list[dict], chat: dict | None) -> str:
    """The markdown table: sequential and overlapped side by side per episode, then the totals."""
    head = "| scene | start | mode | time to goal (s) | moving | steps | path (m) | reached | collisions "
    head += "| stale refused | offline steps |"
    lines = [head, "|" + "---|" * 11]
    for r in rows:
        mode = "overlapped" if r["overlap"] else "sequential"
        lines.append(
            f"| {r['scene']} | {r['start']} | {mode} | {r['wall_s']:.1f} | {r['moving_share']:.0%} | {r['steps']} | "
            f"{r['path_m']:.2f} | {'yes' if r['reached'] else 'no'} | {r['collisions']} | {r['stale_refused']} | "
            f"{r['offline_steps']} |"
        )
    tot = totals(rows)
    lines += ["", "| mode | time (s) | moving | reached | collisions | stale refused |", "|---|---|---|---|---|---|"]
    for mode, t in tot.items():
        lines.append(
            f"| {mode} | {t['wall_s']:.1f} | {t['moving_share']:.0%} | {t['reached']}/{t['episodes']} | "
            f"{t['collisions']} | {t['stale_refused']} |"
        )
    if "sequential" in tot and "overlapped" in tot:
        ratio = tot["overlapped"]["wall_s"] / tot["sequential"]["wall_s"]
        lines.append(f"\nOverlapped time over sequential: **{ratio:.2f}x**.")
    if chat:
        lines.append(
            f"\nChat load (two clients streaming {chat['chat_tokens']} tokens meanwhile): mean step "
            f"{chat['with_chat_step_s']} s against {chat['alone_step_s']} s alone (**{chat['ratio']:.2f}x**), "
            f"stale refusals {chat['with_chat_stale']} (alone {chat['alone_stale']}); chat yields to navigation: "
            f"{chat['chat_yields']}."
        )
    return "\n".join(lines) + "\n"


def totals(rows: list[dict]) -> dict:
    out = {}
    for mode, on in (("sequential", False), ("overlapped", True)):
        rs = [r for r in rows if r["overlap"] == on]
        if not rs:
            continue
        wall, moving = sum(r["wall_s"] for r in rs), sum(r["moving_s"] for r in rs)
        out[mode] = {
            "episodes": len(rs),
            "wall_s": round(wall, 2),
            "moving_share": round(moving / wall, 3) if wall else 0.0,
            "reached": sum(r["reached"] for r in rs),
            "collisions": sum(r["collisions"] for r in rs),
            "stale_refused": sum(r["stale_refused"] for r in rs),
            "offline_steps": sum(r["offline_steps"] for r in rs),
        }
    return out


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    seq = [r for r in rows if not r["overlap"]]
    names = [f"{r['scene']}/{r['start']}" for r in seq]
    pair = {(r["scene"], r["start"]): r for r in rows if r["overlap"]}
    none = {"wall_s": 0.0, "moving_share": 0.0}
    ovl = [pair.get((r["scene"], r["start"]), none) for r in seq]  # an episode not run yet: an empty bar
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    x = range(len(names))
    a.bar([i - 0.2 for i in x], [r["wall_s"] for r in seq], 0.4, label="sequential")
    a.bar([i + 0.2 for i in x], [r["wall_s"] for r in ovl], 0.4, label="overlapped")
    a.set_ylabel("time to goal (s)")
    b.bar([i - 0.2 for i in x], [100 * r["moving_share"] for r in seq], 0.4, label="sequential")
    b.bar([i + 0.2 for i in x], [100 * r["moving_share"] for r in ovl], 0.4, label="overlapped")
    b.set_ylabel("time moving (%)")
    for ax in (a, b):
        ax.set_xticks(list(x), names, rotation=30, ha="right", fontsize=7)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--episodes", type=int, default=None, help="only the first N episodes (default: all)")
    ap.add_argument("--max-steps", type=int, default=30)
    ap.add_argument("--no-chat", action="store_true", help="skip the chat-load line")
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--set", action="append", default=[], help="a config override (KEY=VALUE), repeatable")
    add_robot_args(ap)
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    eps = episodes(args.episodes)
    rows: list[dict] = []
    chat, meta = None, {"command": "python -m tools.bench.overlap " + " ".join(sys.argv[1:] if argv is None else argv)}
    with served(None, LinkProfile.from_rtt(args.rtt_ms, jitter_ms=2)) as s:
        drafter = None
        for scene_name in dict.fromkeys(sc for sc, _ in eps):
            scene = load_scene(scene_name)
            cfg = robot_config(s.link.url(), args, scene, TELEMETRY, len(s.agent_cpus), *args.set)
            meta.setdefault("config", cfg.to_dict())
            daemon = Daemon(cfg, drafter=drafter)
            daemon.start(notify_ready=False)
            drafter = daemon.drafts.drafter if daemon.drafts is not None else None
            try:
                for start in [st for sc, st in eps if sc == scene_name]:
                    for overlap in (False, True):
                        r = run_one(daemon, scene, start, overlap, args.max_steps)
                        rows.append(r)
                        print(json.dumps(r), flush=True)
                        write(args.out, meta, rows, chat)  # the figures so far: a run cut short leaves them
                    cv2.imwrite(str(args.out / f"map_{scene.name}_{start}.png"), daemon.world.render_map())
                if scene_name == "red_box" and not args.no_chat:
                    chat = chat_line(daemon, scene, args.max_steps)
                    print(json.dumps(chat), flush=True)
            finally:
                daemon.close()
    print(write(args.out, meta, rows, chat))
    return 0


def write(out: Path, meta: dict, rows: list[dict], chat: dict | None) -> str:
    """overlap.json and overlap.md as they stand; returns the markdown."""
    data = {**meta, "episodes": rows, "totals": totals(rows), "chat": chat}
    (out / "overlap.json").write_text(json.dumps(data, indent=1))
    md = f"# Overlapped stepping: sequential against overlapped\n\n`{meta['command'].strip()}`\n\n" + table(rows, chat)
    (out / "overlap.md").write_text(md + "\n![time to goal and time moving](overlap.png)\n")
    plot(rows, out / "overlap.png")
    return md


def chat_line(daemon: Daemon, scene: Scene, max_steps: int) -> dict:
    """The demo's start 0 overlapped, alone and with two chat clients streaming meanwhile."""
    alone = run_one(daemon, scene, 0, True, max_steps)
    assert daemon.drafts is not None
    yields0 = daemon.drafts.turns.chat_yields
    t0 = time.perf_counter()
    with ChatLoad(daemon) as load:
        with_chat = run_one(daemon, scene, 0, True, max_steps)
    return {
        "alone_step_s": alone["mean_step_s"],
        "with_chat_step_s": with_chat["mean_step_s"],
        "ratio": round((with_chat["mean_step_s"] or 0) / (alone["mean_step_s"] or 1), 3),
        "alone_stale": alone["stale_refused"],
        "with_chat_stale": with_chat["stale_refused"],
        "alone_reached": alone["reached"],
        "with_chat_reached": with_chat["reached"],
        "chat_tokens": load.tokens,
        "chat_s": round(time.perf_counter() - t0, 1),
        "chat_yields": daemon.drafts.turns.chat_yields - yields0,
    }


if __name__ == "__main__":
    sys.exit(main())
