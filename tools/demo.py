"""The demo: a simulated robot told "go to the red box", thinking with speculative decoding.

A local server-bridge (the float32 target) runs in its own process on its own
core behind the network emulator (a Wi-Fi-like 20 ms RTT); the robot daemon's
parts run here on the other core: the sim robot and its camera, the perception
step, the draft model, the navigation loop, the safety layer and the control
loop. Part way through, the link is cut: the robot declares offline mode
(`local`: the draft model alone, every action marked unverified; or `hold`),
and goes back to verified mode when the link returns. Each step prints what
the robot saw, what the model said, the action, the command sent, the mode and
the latency; the path is drawn on the top-down map (green verified, orange offline).

Any scene (`--scene`, a name or a JSON file, agent/robot/scene.py) and any of its start poses
(`--starts all` runs them one after another with the same verifier and draft); each start
ends with whether the robot reached what the instruction names.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
import time
from pathlib import Path

from agent.app.daemon import Daemon
from agent.robot.scene import SceneError, load_scene
from runtime import llamalog
from tools.bench.link import served
from tools.cluster.netem import LinkProfile
from tools.robot.episode import navigate_with_cut, print_step, restart
from tools.robot.nav_eval import add_robot_args, robot_config

OUT = Path("build/demo")


def parse_starts(text: str, n: int) -> list[int]:
    """ "all" -> every start of the scene; "0,2" -> those; "1" -> that one (indices 0..n-1)."""
    if text.strip() == "all":
        return list(range(n))
    try:
        starts = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--starts wants 'all' or indices like 0,2, got {text!r}") from None
    bad = [i for i in starts if not 0 <= i < n]
    if not starts or bad:
        raise ValueError(f"--starts {text!r}: the scene has starts 0..{n - 1}")
    return starts


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scene", default="red_box", help="a shipped scene's name or a scene file (JSON)")
    ap.add_argument(
        "--starts", default=None, help="the start poses to run: 'all', or indices like 0,2 (default: --start)"
    )
    ap.add_argument("--start", type=int, default=0, help="one start pose (index into the scene's starts)")
    ap.add_argument("--instruction", default=None, help='default: the scene\'s ("go to the red box")')
    ap.add_argument("--max-steps", type=int, default=30)
    ap.add_argument("--cut-at", type=int, default=3, help="cut the link before this step (0: never)")
    ap.add_argument("--cut-steps", type=int, default=3, help="steps the link stays down")
    add_robot_args(ap)
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument(
        "--verbose",
        action="store_true",
        help="third-party logs (llama.cpp's model loads and context warnings) on the terminal; also EDGESPEC_VERBOSE=1",
    )
    args = ap.parse_args(argv)
    verbose = llamalog.want_verbose(args.verbose)
    logging.basicConfig(level=logging.INFO if verbose else logging.ERROR, stream=sys.stderr)
    llamalog.set_verbose(verbose)
    try:
        scene = load_scene(args.scene)
        starts = parse_starts(args.starts if args.starts is not None else str(args.start), len(scene.starts))
    except (SceneError, ValueError) as e:
        print(f"demo: {e}", file=sys.stderr)
        return 2
    instruction = args.instruction or scene.task() or "go to the red box"
    args.out.mkdir(parents=True, exist_ok=True)
    telemetry = args.out / "telemetry.jsonl"
    telemetry.unlink(missing_ok=True)

    print(f"starting the verifier (target smollm2-f32) behind a {args.rtt_ms:.0f} ms RTT link ...", flush=True)
    t0 = time.perf_counter()
    summaries = []
    with served(None, LinkProfile.from_rtt(args.rtt_ms, jitter_ms=2)) as s:
        link = s.link
        threads = len(s.agent_cpus)
        more = [f"robot.options.start={starts[0]}", f"record.path={json.dumps(str(args.out / 'demo.mcap'))}"]
        cfg = robot_config(link.url(), args, scene, telemetry, threads, *more)
        daemon = Daemon(cfg)
        print(
            f"verifier ready on cores {sorted(s.server_cpus)} in {time.perf_counter() - t0:.1f}s; the robot runs on "
            f"cores {sorted(s.agent_cpus)}; loading the draft and prefilling the prompt on both sides ...",
            flush=True,
        )
        daemon.start(notify_ready=False)
        world, nav = daemon.world, daemon.nav
        print(
            f"robot ready: controller sim (scene {world.scene}, starts {starts}), camera sim, perception "
            f"'{cfg.perception.kind}' (the simulator's ground truth of what the camera sees, as text: the bundled "
            f"models read text only), offline policy '{args.offline}', link {nav.link}\n",
            flush=True,
        )
        import cv2

        try:
            for k, start in enumerate(starts):
                if k:
                    restart(daemon, scene.starts[start], start)
                if len(starts) > 1:
                    x, y, th = scene.starts[start]
                    print(f"--- start {start}: ({x:.1f}, {y:.1f}) facing {math.degrees(th):.0f} deg ---")
                print(f'instruction: "{instruction}"\n')
                summary, _ = navigate_with_cut(
                    daemon,
                    world,
                    instruction,
                    args.max_steps,
                    cut_at=args.cut_at,
                    cut_steps=args.cut_steps,
                    link_proxy=link,
                    printer=print_step,
                    task=f"demo-{start}",
                )
                suffix = "" if len(starts) == 1 else f"_start{start}"
                summary["map"] = str(args.out / f"map{suffix}.png")
                cv2.imwrite(summary["map"], world.render_map())
                cv2.imwrite(str(args.out / f"camera{suffix}.png"), world.render_camera(320, 240))
                summaries.append(summary)
                print(_verdict(summary) + "\n", flush=True)
        finally:
            daemon.close()

    out = (
        summaries[0]
        if len(summaries) == 1
        else {
            "scene": scene.name,
            "instruction": instruction,
            "episodes": summaries,
            "reached": sum(s["reached"] for s in summaries),
            "of": len(summaries),
        }
    )
    (args.out / "summary.json").write_text(json.dumps(out, indent=1))
    if len(summaries) > 1:
        print(
            f"reached {out['reached']} of {len(summaries)} starts: "
            + ", ".join(f"start {s['start']} {'yes' if s['reached'] else 'no'}" for s in summaries)
        )
    print(
        f"map of the path: {', '.join(s['map'] for s in summaries)}; telemetry (one JSON line per step): "
        f"{telemetry}; summary: {args.out / 'summary.json'}; recording (open in Foxglove with "
        f"deploy/foxglove/edgespec-layout.json): {args.out / 'demo.mcap'}"
    )
    return 0


def _verdict(s: dict) -> str:
    what = s["target"] or "the target"
    return (
        f"{'reached the ' + what if s['reached'] else 'did not reach the ' + what} after {s['steps']} steps "
        f"({s['end']}; {s['distance_m']} m left, {s['collisions']} collisions, path {s['path_m']} m, shortest "
        f"{s['shortest_m']} m, SPL {s['spl']}); {s['verified_steps']} verified steps (mean tau {s['mean_tau']}), "
        f"{s['offline_steps']} offline steps with {s['unverified_tokens']} unverified tokens; parses {s['parses']}"
    )


if __name__ == "__main__":
    sys.exit(main())
