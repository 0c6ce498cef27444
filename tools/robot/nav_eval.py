"""Does the robot reach what it is told to? Every scene file and start pose in a folder, with and without a link cut.

For each scene (the shipped ones, agent/robot/scenes/*.json) and each of its start
poses the robot is given the scene's instruction ("go to the blue ball") and runs until the
model says stop or --max-steps pass, twice: with the link up throughout, and with the link
cut before step 3 for 3 steps (as the demo does, through tools/cluster/netem's NetemProxy; the robot
goes on offline, `local` by default). One local verifier (the float32 target, on its own
cores behind a 20 ms RTT link) and one draft model serve the whole run; each scene gets a
fresh robot daemon, each start a fresh episode in it (SimWorld.restart).

Per episode and aggregated (all, no cut, cut, and per scene):

    success      the object the instruction names is within reach (0.6 m) when the episode ends
    SPL          success * shortest / max(path, shortest): the shortest path from the start to
                 within reach, around the obstacles inflated by the robot's radius
                 (agent/robot/shortest.py), over the path the robot took
    steps, path length, collisions, mean tau, mean time per step, verified and offline steps
    cut short    motions the obstacle stop cut short (Step.stopped_by "obstacle"), and their share of the
                 episode's steps (aggregated: the largest share of any episode)
    refusals     steps whose answer grammar left actions out (nav.feasible, agent/robot/feasible.py)

`--set KEY=VALUE` overrides the robot's config after this tool's own: `--set nav.feasible=false` runs today's
answer grammar beside the narrowed one; on a loaded machine, longer plan, frame and verify limits keep the load
from deciding the outcome (`agent.max_plan_age_s`, `camera.max_age_ms`, `safety.max_frame_age_s`,
`link.verify_timeout_s`).

Writes nav_eval.json (with the config in use), nav_eval.md, nav_eval.png (success per scene),
nav_eval_spl.png and maps/<scene>_start<i>_<cut|nocut>.png (the path on the top-down map) under
--out. `--policy scripted` runs agent/robot/scripted.py's policy on a fake clock instead of the
models (no verifier, no link: seconds), the baseline the model is measured against.

    python -m tools.robot.nav_eval                       # everything (about a minute an episode on 2 cores)
    python -m tools.robot.nav_eval --limit 1 --max-steps 3 --out build/nav_eval_smoke
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import textwrap
import time
from pathlib import Path

from agent.robot.scene import SCENE_DIR, Scene, SceneError, load_scene
from tools.plots import bar_plot

SCENES = SCENE_DIR  # the shipped scenes (package data), so `edge-agent run --scene NAME` takes each
OUT = Path("docs/nav_eval")
BUILTIN: tuple[str, ...] = ()  # shipped scenes evaluated beside a --scenes folder's
CUT_AT, CUT_STEPS = 3, 3  # the link is cut before step 3 for 3 steps (as in the demo)


def add_robot_args(ap: argparse.ArgumentParser) -> None:
    """The sim robot's flags the demo and this evaluation share: offline policy, mode, link, safety stop."""
    ap.add_argument("--offline", choices=("local", "hold"), default="local")
    ap.add_argument("--mode", choices=("sd", "fsd", "ar"), default="sd")
    ap.add_argument("--rtt-ms", type=float, default=20.0)
    ap.add_argument(
        "--min-clearance-m",
        type=float,
        default=None,
        help="the safety layer's obstacle stop (safety.min_clearance_m; default: the config's, on at "
        "0.2 m with the simulator's ray cast; the Go2 example has 0.4; 0: off)",
    )


def robot_config(url: str, args: argparse.Namespace, scene: Scene, telemetry: Path, threads: int, *more: str):
    """edge-agent's config for the sim robot in `scene` behind the link at `url`; `more`: further overrides."""
    from agent.app import config

    clearance = [f"safety.min_clearance_m={args.min_clearance_m}"] if args.min_clearance_m is not None else []
    return config.load(
        None,
        [
            f'link.verifier="{url}"',
            f'offline.policy="{args.offline}"',
            f'agent.mode="{args.mode}"',
            f"robot.options.scene={json.dumps(scene.path)}",
            f"telemetry.path={json.dumps(str(telemetry.resolve()))}",  # (a relative one is under the state dir)
            f"agent.threads={threads}",
            "link.verify_timeout_s=2.0",
            "camera.fps=20",
            *clearance,
            *more,
        ],
    )


def load_scenes(folder: Path, builtin: tuple[str, ...] = BUILTIN) -> list[Scene]:
    """The folder's scene files (sorted) and the shipped scenes not already there; each must name its target."""
    scenes = [load_scene(p) for p in sorted(folder.glob("*.json"))]
    scenes += [load_scene(n) for n in builtin if n not in {s.name for s in scenes}]
    for s in scenes:
        if not s.task():
            raise SceneError(f'scene {s.path}: names no target (give "target" or "instruction")')
    return scenes


def plan(scenes: list[Scene], cuts: tuple[bool, ...], limit: int | None = None) -> list[tuple[Scene, int, bool]]:
    """The episodes, scene by scene and start by start, (scene, start index, cut); the first `limit` of them."""
    episodes = [(s, i, cut) for s in scenes for i in range(len(s.starts)) for cut in cuts]
    return episodes[:limit] if limit else episodes


# ---------------------------------------------------------------- aggregation (pure)


def _mean(xs: list) -> float | None:
    xs = [x for x in xs if x is not None]
    return round(sum(xs) / len(xs), 3) if xs else None


def aggregate(episodes: list[dict]) -> dict:
    """Success rate, SPL and the rest over a list of episode summaries (agent.app.episode.summarize's names).

    Means are per episode, except tau (over verified steps: each episode's mean weighted by its verified
    steps) and the time per step (over steps).
    """
    n = len(episodes)
    verified = sum(e["verified_steps"] for e in episodes)
    steps = sum(e["steps"] for e in episodes)
    tau_w = [(e["mean_tau"], e["verified_steps"]) for e in episodes if e.get("mean_tau") is not None]
    step_w = [(e["mean_step_s"], e["steps"]) for e in episodes if e.get("mean_step_s") is not None]
    return {
        "episodes": n,
        "success_rate": round(sum(e["reached"] for e in episodes) / n, 3) if n else None,
        "spl": _mean([e["spl"] for e in episodes]),
        "mean_steps": _mean([e["steps"] for e in episodes]),
        "mean_path_m": _mean([e["path_m"] for e in episodes]),
        "mean_shortest_m": _mean([e["shortest_m"] for e in episodes]),
        "collisions": sum(e["collisions"] for e in episodes),
        "mean_collisions": _mean([e["collisions"] for e in episodes]),
        "mean_tau": round(sum(t * w for t, w in tau_w) / sum(w for _, w in tau_w), 3)
        if tau_w and sum(w for _, w in tau_w)
        else None,
        "mean_step_s": round(sum(t * w for t, w in step_w) / sum(w for _, w in step_w), 3)
        if step_w and sum(w for _, w in step_w)
        else None,
        "verified_steps": verified,
        "offline_steps": sum(e["offline_steps"] for e in episodes),
        "steps": steps,
        # motions the obstacle stop cut short: in all, and the largest share of an episode's steps
        "cut_short": sum(e.get("cut_short", 0) for e in episodes),
        "max_cut_short_share": max((e.get("cut_short_share", 0.0) for e in episodes), default=None),
        "refused_steps": sum(e.get("refused_steps", 0) for e in episodes),
    }


def condition(e: dict) -> str:
    return "cut" if e.get("cut") else "no cut"


def summarize_run(episodes: list[dict]) -> tuple[dict, dict]:
    """(aggregate by condition: all / no cut / cut, aggregate by scene and condition)."""
    overall = {"all": aggregate(episodes)}
    for c in ("no cut", "cut"):
        group = [e for e in episodes if condition(e) == c]
        if group:
            overall[c] = aggregate(group)
    by_scene: dict[str, dict] = {}
    for e in episodes:
        by_scene.setdefault(e["scene"], {}).setdefault(condition(e), []).append(e)
    return overall, {s: {c: aggregate(g) for c, g in conds.items()} for s, conds in by_scene.items()}


# ---------------------------------------------------------------- the report


def _fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return f"{v:.2f}"
    return str(v)


def _table(header: list[str], rows: list[list]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + [
        "| " + " | ".join(_fmt(v) for v in row) + " |" for row in rows
    ]


AGG_COLUMNS = [
    ("episodes", "episodes"),
    ("success_rate", "success"),
    ("spl", "SPL"),
    ("mean_steps", "steps"),
    ("mean_path_m", "path m"),
    ("mean_shortest_m", "shortest m"),
    ("collisions", "collisions"),
    ("mean_tau", "mean tau"),
    ("mean_step_s", "s/step"),
    ("verified_steps", "verified steps"),
    ("offline_steps", "offline steps"),
    ("cut_short", "cut short"),
    ("max_cut_short_share", "max cut-short share"),
    ("refused_steps", "steps with refusals"),
]
EPISODE_COLUMNS = [
    ("scene", "scene"),
    ("start", "start"),
    ("cut", "cut"),
    ("reached", "reached"),
    ("end", "end"),
    ("steps", "steps"),
    ("path_m", "path m"),
    ("shortest_m", "shortest m"),
    ("spl", "SPL"),
    ("distance_m", "left m"),
    ("collisions", "collisions"),
    ("mean_tau", "tau"),
    ("mean_step_s", "s/step"),
    ("verified_steps", "verified"),
    ("offline_steps", "offline"),
    ("cut_short", "cut short"),
    ("cut_short_share", "cut-short share"),
    ("refused_steps", "refusals"),
]


def write_report(out: Path, episodes: list[dict], meta: dict) -> dict:
    """nav_eval.json, nav_eval.md, nav_eval.png and nav_eval_spl.png under `out`; returns the JSON written."""
    overall, by_scene = summarize_run(episodes)
    report = {"meta": meta, "aggregate": overall, "by_scene": by_scene, "episodes": episodes}
    (out / "nav_eval.json").write_text(json.dumps(report, indent=1))
    scenes = list(by_scene)
    conds = [c for c in ("no cut", "cut") if any(c in by_scene[s] for s in scenes)]
    for name, key, label in (("nav_eval.png", "success_rate", "success rate"), ("nav_eval_spl.png", "spl", "SPL")):
        bar_plot(
            out / name,
            [textwrap.fill(s.replace("_", " "), 11) for s in scenes],
            {c: [by_scene[s].get(c, {}).get(key) or 0.0 for s in scenes] for c in conds},
            label,
            f"{label} per scene ({meta['policy']}, {meta['max_steps']} steps at most)",
        )
    cut = f"cut before step {meta['cut_at']} for {meta['cut_steps']} steps"
    agent_cfg = meta.get("config", {}).get("agent", {})
    pair = (
        f"draft {agent_cfg.get('draft', '?')}, target smollm2-f32 (llamacpp engine)"
        if meta["policy"] == "model"
        else "no models"
    )
    lines = [
        f"# Navigation to a goal: {len(episodes)} episodes ({meta['policy']}: {pair})",
        "",
        f"Scenes from `{meta['scenes']}` (+ {', '.join(meta['builtin']) or 'none'}), every start pose, "
        f"at most {meta['max_steps']} steps, the link {'up' if conds == ['no cut'] else cut}"
        + (
            ""
            if meta["policy"] == "scripted"
            else f" (offline policy `{meta['offline']}`, mode `{meta['mode']}`, {meta['rtt_ms']:.0f} ms RTT)"
        )
        + f"; {meta['wall_s'] / 60:.1f} min. Success: the object the "
        "instruction names within 0.6 m at the end. SPL: success x shortest / max(path, shortest), the shortest "
        "path around the obstacles inflated by the robot's radius (`agent/robot/shortest.py`). "
        "`python -m tools.robot.nav_eval` (`make nav-eval-scenes`) writes this.",
        "",
        "![success per scene](nav_eval.png)",
        "",
        "## All episodes",
        "",
    ]
    lines += _table(
        ["condition"] + [h for _, h in AGG_COLUMNS],
        [[c] + [agg.get(k) for k, _ in AGG_COLUMNS] for c, agg in overall.items()],
    )
    lines += ["", "## Per scene", ""]
    lines += _table(
        ["scene", "condition"] + [h for _, h in AGG_COLUMNS],
        [[s, c] + [agg.get(k) for k, _ in AGG_COLUMNS] for s in scenes for c, agg in by_scene[s].items()],
    )
    lines += [
        "",
        "## Per episode",
        "",
        "Maps of each path: `maps/<scene>_start<i>_<cut|nocut>.png` (green verified, orange offline).",
        "",
    ]
    lines += _table(
        [h for _, h in EPISODE_COLUMNS],
        [[condition(e) == "cut" if k == "cut" else e.get(k) for k, _ in EPISODE_COLUMNS] for e in episodes],
    )
    (out / "nav_eval.md").write_text("\n".join(lines) + "\n")
    return report


def map_name(scene: str, start: int, cut: bool) -> str:
    return f"{scene}_start{start}_{'cut' if cut else 'nocut'}.png"


def progress(i: int, n: int, e: dict, t0: float) -> None:
    elapsed = time.perf_counter() - t0
    eta = elapsed / i * (n - i)
    print(
        f"[{i}/{n}] {e['scene']} start {e['start']} {condition(e)}: "
        f"{'reached' if e['reached'] else 'not reached'} ({e['end']}) in {e['steps']} steps, path {e['path_m']:.2f} m "
        f"(shortest {_fmt(e['shortest_m'])}), SPL {e['spl']:.2f}, {e['collisions']} collisions, "
        f"{e['verified_steps']} verified / {e['offline_steps']} offline, {e.get('cut_short', 0)} cut short "
        f"({_fmt(e.get('cut_short_share'))}), {e.get('refused_steps', 0)} with refusals, tau {_fmt(e['mean_tau'])}, "
        f"{_fmt(e['mean_step_s'])} s/step; {elapsed / 60:.1f} min gone, ~{eta / 60:.1f} min to go",
        flush=True,
    )


# ---------------------------------------------------------------- running


def run_scripted(episodes: list[tuple[Scene, int, bool]], args, maps: Path) -> list[dict]:
    """The scripted policy (agent/robot/scripted.py) on a fake clock: no models, no link."""
    import cv2

    from agent.app.episode import summarize
    from agent.robot.safety import SafetyLimits
    from agent.robot.scripted import FakeClock
    from agent.robot.scripted import run_scripted as scripted_episode
    from agent.robot.sim import make_world

    out, t0 = [], time.perf_counter()
    for i, (scene, start, cut) in enumerate(episodes, 1):
        world = make_world(scene, start=start, clock=FakeClock())
        limits = SafetyLimits(max_frame_age_s=None, min_clearance_m=args.min_clearance_m)  # None: the default
        result = scripted_episode(world, None, scene.target, max_steps=args.max_steps, limits=limits)
        e = summarize(
            world,
            [],
            scene.task(),
            target=scene.target,
            start=scene.starts[start],
            end="done" if result.actions and result.actions[-1].kind == "stop" else "max_steps",
        )
        e.update(steps=result.steps, cut=None)
        cv2.imwrite(str(maps / map_name(scene.name, start, cut)), world.render_map())
        out.append(e)
        progress(i, len(episodes), e, t0)
    return out


def run_models(episodes: list[tuple[Scene, int, bool]], args, maps: Path, meta: dict) -> list[dict]:
    """The robot daemon with the draft model against one local verifier behind the link emulator."""
    import cv2

    from agent.app.daemon import Daemon
    from agent.decoding import DecoderSettings, open_decoder
    from tools.bench.link import served
    from tools.cluster.netem import LinkProfile
    from tools.robot.episode import navigate_with_cut, restart

    args.telemetry.parent.mkdir(parents=True, exist_ok=True)
    args.telemetry.unlink(missing_ok=True)
    print(f"starting the verifier ({args.rtt_ms:.0f} ms RTT) ...", flush=True)
    out, t0 = [], time.perf_counter()
    with served(None, LinkProfile.from_rtt(args.rtt_ms, jitter_ms=2)) as s:
        link = s.link
        print(f"verifier on cores {sorted(s.server_cpus)}, the robot on {sorted(s.agent_cpus)}", flush=True)
        drafter = None
        for scene in dict.fromkeys(sc for sc, _, _ in episodes):
            cfg = robot_config(link.url(), args, scene, args.telemetry, len(s.agent_cpus), *args.set)
            meta.setdefault("config", cfg.to_dict())
            if drafter is None:
                drafter = open_decoder(
                    DecoderSettings(
                        draft=cfg.agent.draft, threads=cfg.agent.threads, n_gpu_layers=cfg.agent.n_gpu_layers
                    )
                ).drafter
            daemon = Daemon(cfg, drafter=drafter)
            daemon.start(notify_ready=False)
            try:
                for _, start, cut in [ep for ep in episodes if ep[0] is scene]:
                    restart(daemon, scene.starts[start], start)
                    e, _ = navigate_with_cut(
                        daemon,
                        daemon.world,
                        scene.task(),
                        args.max_steps,
                        cut_at=CUT_AT if cut else 0,
                        cut_steps=CUT_STEPS,
                        link_proxy=link,
                        task=f"{scene.name}-{start}-{'cut' if cut else 'nocut'}",
                        say=None,
                    )
                    cv2.imwrite(str(maps / map_name(scene.name, start, cut)), daemon.world.render_map())
                    out.append(e)
                    progress(len(out), len(episodes), e, t0)
                    # the report so far after every episode: a run cut short still leaves its figures
                    write_report(
                        args.out,
                        out,
                        {
                            **meta,
                            "done": f"{len(out)} of {len(episodes)} episodes",
                            "wall_s": round(time.perf_counter() - t0, 1),
                        },
                    )
            finally:
                daemon.close()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scenes", type=Path, default=SCENES, help="a folder of scene files (JSON)")
    ap.add_argument("--builtin", default=",".join(BUILTIN), help="shipped scenes to add, comma-separated ('' none)")
    ap.add_argument("--max-steps", type=int, default=30)
    cuts = ap.add_mutually_exclusive_group()
    cuts.add_argument("--no-cut", action="store_true", help="only episodes with the link up throughout")
    cuts.add_argument("--cut-only", action="store_true", help="only episodes with the link cut")
    ap.add_argument("--limit", type=int, default=None, help="only the first N episodes (a quick check)")
    ap.add_argument(
        "--policy",
        choices=("model", "scripted"),
        default="model",
        help="model: the robot daemon with the draft and a local verifier; scripted: the scripted policy "
        "on a fake clock (no models, no link cut)",
    )
    add_robot_args(ap)
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a robot config override after this tool's own (repeatable), e.g. nav.feasible=false for today's "
        "answer grammar, agent.max_plan_age_s=30 on a loaded machine",
    )
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument(
        "--telemetry",
        type=Path,
        default=Path("build/nav_eval/telemetry.jsonl"),
        help="one JSON line per step (the step's task names its episode)",
    )
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.ERROR, stream=sys.stderr)
    builtin = tuple(n for n in args.builtin.split(",") if n.strip())
    try:
        scenes = load_scenes(args.scenes, builtin)
    except SceneError as e:
        print(f"nav_eval: {e}", file=sys.stderr)
        return 2
    conds = (False,) if args.no_cut or args.policy == "scripted" else (True,) if args.cut_only else (False, True)
    episodes = plan(scenes, conds, args.limit)
    maps = args.out / "maps"
    maps.mkdir(parents=True, exist_ok=True)
    print(
        f"{len(episodes)} episodes: {len(scenes)} scenes ({', '.join(s.name for s in scenes)}), "
        f"{'with and without a link cut' if len(conds) == 2 else 'link cut' if conds[0] else 'link up'}, "
        f"at most {args.max_steps} steps each",
        flush=True,
    )
    shown = args.scenes.resolve()
    shown = shown.relative_to(Path.cwd()) if shown.is_relative_to(Path.cwd()) else shown
    meta = {
        "policy": args.policy,
        "scenes": str(shown),
        "builtin": list(builtin),
        "max_steps": args.max_steps,
        "cut_at": CUT_AT,
        "cut_steps": CUT_STEPS,
        "offline": args.offline,
        "mode": args.mode,
        "rtt_ms": args.rtt_ms,
        "limit": args.limit,
        "min_clearance_m": args.min_clearance_m,
        "set": list(args.set),
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    t0 = time.perf_counter()
    results = (
        run_scripted(episodes, args, maps) if args.policy == "scripted" else run_models(episodes, args, maps, meta)
    )
    meta["wall_s"] = round(time.perf_counter() - t0, 1)
    report = write_report(args.out, results, {**meta, "done": f"{len(results)} of {len(episodes)} episodes"})
    a = report["aggregate"]
    for c, agg in a.items():
        print(
            f"{c}: success {_fmt(agg['success_rate'])} over {agg['episodes']} episodes, SPL {_fmt(agg['spl'])}, "
            f"{_fmt(agg['mean_steps'])} steps, {agg['collisions']} collisions, {agg['cut_short']} cut short "
            f"(at most {_fmt(agg['max_cut_short_share'])} of an episode's steps), tau {_fmt(agg['mean_tau'])}, "
            f"{_fmt(agg['mean_step_s'])} s/step"
        )
    print(
        f"wrote {args.out / 'nav_eval.json'}, nav_eval.md, nav_eval.png, nav_eval_spl.png and {len(results)} maps "
        f"in {maps}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
