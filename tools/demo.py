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
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path

from agent import config
from agent.daemon import Daemon
from agent.robot.actions import STOP
from tools.local_verifier import LocalVerifier, pin_cores
from tools.netem import LinkProfile, NetemProxy

OUT = Path("build/demo")


def _cmd(c: dict) -> str:
    parts = [f"{k} {v:+.2f}" for k, v in c.items() if abs(v) > 1e-9]
    return ", ".join(parts) if parts else "zero"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--instruction", default="go to the red box")
    ap.add_argument("--start", type=int, default=0, help="the sim's fixed start pose (0-3)")
    ap.add_argument("--max-steps", type=int, default=30)
    ap.add_argument("--rtt-ms", type=float, default=20.0)
    ap.add_argument("--cut-at", type=int, default=3, help="cut the link before this step (0: never)")
    ap.add_argument("--cut-steps", type=int, default=3, help="steps the link stays down")
    ap.add_argument("--offline", choices=("local", "hold"), default="local")
    ap.add_argument("--mode", choices=("sd", "fsd", "ar"), default="sd")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.ERROR, stream=sys.stderr)
    args.out.mkdir(parents=True, exist_ok=True)
    telemetry = args.out / "telemetry.jsonl"
    telemetry.unlink(missing_ok=True)

    agent_cpus, server_cpus = pin_cores()
    print(f"starting the verifier (target smollm2-f32) on cores {sorted(server_cpus)}; the robot runs on cores "
          f"{sorted(agent_cpus)} behind a {args.rtt_ms:.0f} ms RTT link ...", flush=True)
    t0 = time.perf_counter()
    with LocalVerifier(cpus=server_cpus, threads=len(server_cpus)) as server, \
            NetemProxy("127.0.0.1", server.port, LinkProfile.from_rtt(args.rtt_ms, jitter_ms=2)) as link:
        os.sched_setaffinity(0, agent_cpus)
        cfg = config.load(None, [
            f'link.verifier="{link.url()}"', f'offline.policy="{args.offline}"', f'agent.mode="{args.mode}"',
            f'robot.options={{ start = {args.start} }}', f'telemetry.path="{telemetry}"',
            f"agent.threads={len(agent_cpus)}", "link.verify_timeout_s=2.0", "camera.fps=20"])
        daemon = Daemon(cfg)
        print(f"verifier ready in {time.perf_counter() - t0:.1f}s; loading the draft and prefilling the prompt on "
              "both sides ...", flush=True)
        daemon.start(notify_ready=False)
        world, nav = daemon.world, daemon.nav
        print(f"robot ready: controller sim (scene {world.scene}, start {args.start}), camera sim, perception "
              f"'{cfg.perception.kind}' (the simulator's ground truth of what the camera sees, as text: the bundled "
              f"models read text only), offline policy '{args.offline}', link {nav.link}\n", flush=True)
        print(f'instruction: "{args.instruction}"\n')
        records, down_until, reached = [], None, False
        try:
            for n in range(1, args.max_steps + 1):
                if args.cut_at and n == args.cut_at:
                    link.refuse_new(True)
                    link.disconnect_all()
                    down_until = n + args.cut_steps
                    print(f"  ~~ link cut: the verifier is unreachable for the next {args.cut_steps} steps ~~")
                if down_until is not None and n == down_until:
                    link.refuse_new(False)
                    down_until = None
                    print("  ~~ link restored ~~")
                if sys.stdout.isatty():
                    print(f"[{n:2d}] looking and thinking ...", end="\r", flush=True)
                rec = nav.step(args.instruction, task="demo")
                records.append(rec)
                daemon.telemetry.write(rec.to_json())
                d = rec.decode
                dec = (f"{d.get('mode')}, {d.get('tokens')} tokens, tau {d['tau']:.1f}" if d.get("tau") else
                       f"{d.get('mode', '-')}, {d.get('tokens', 0)} tokens") if d else "no answer"
                mode = "VERIFIED" if rec.mode == "verified" else f"OFFLINE/{rec.offline_policy}"
                print(f"[{n:2d}] {mode:<14} {rec.latency_ms.get('step', 0) / 1e3:5.1f}s  sees: {rec.observation}")
                print(f"     says: {rec.text.strip()!r}" + ("  (unverified)" if rec.unverified_tokens else ""))
                print(f"     action: {rec.action} ({rec.parse}{'; ' + rec.parse_note if rec.parse_note else ''}) -> "
                      f"sent {_cmd(rec.command_peak)}; think {rec.latency_ms.get('generate', 0) / 1e3:.1f}s ({dec})"
                      + (f"\n     why: {rec.reason}" if rec.reason else ""), flush=True)
                if rec.action == str(STOP) and rec.parse in ("exact", "tolerant"):
                    reached = world.reached("red box")
                    break
        finally:
            daemon.close()
        map_png = args.out / "map.png"
        import cv2
        cv2.imwrite(str(map_png), world.render_map())
        cv2.imwrite(str(args.out / "camera.png"), world.render_camera(320, 240))

    verified = [r for r in records if r.mode == "verified"]
    offline = [r for r in records if r.mode == "offline"]
    taus = [r.decode["tau"] for r in verified if r.decode.get("tau")]
    summary = {"instruction": args.instruction, "steps": len(records), "reached": reached,
               "distance_left_m": round(world.distance_to("red box"), 2), "collisions": world.collisions,
               "verified_steps": len(verified), "offline_steps": len(offline),
               "unverified_tokens": sum(r.unverified_tokens for r in records),
               "mean_think_s_verified": round(sum(r.latency_ms["generate"] for r in verified) / max(1, len(verified))
                                              / 1e3, 2),
               "mean_tau": round(sum(taus) / len(taus), 2) if taus else None,
               "parses": {k: sum(r.parse == k for r in records) for k in ("exact", "tolerant", "miss", "refused")}}
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(f"\n{'reached the red box' if reached else 'did not reach the red box'} after {len(records)} steps "
          f"({summary['distance_left_m']} m left, {world.collisions} collisions); {len(verified)} verified steps "
          f"(mean tau {summary['mean_tau']}), {len(offline)} offline steps with {summary['unverified_tokens']} "
          f"unverified tokens; parses {summary['parses']}")
    print(f"map of the path: {map_png}; telemetry (one JSON line per step): {telemetry}; summary: "
          f"{args.out / 'summary.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
