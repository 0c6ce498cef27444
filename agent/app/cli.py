"""`edge-agent generate`: one prompt through AR, SD or the draft alone, with metrics."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

from agent.spec.policy import POLICIES
from protocol import modelfiles, payload
from protocol.payload import PayloadSpec
from protocol.sampling import SamplingError, SamplingParams

log = logging.getLogger("edge-agent")


def _generate(args) -> int:
    from agent.spec.decoder import DecoderConfig, EdgeDecoder, FsdOptions
    from agent.spec.drafter import Drafter
    from agent.spec.link import LinkLost, ServerError, default_robot_id
    from agent.spec.policy import DraftPolicy

    if not args.local and not args.verifier:
        print("edge-agent: give --verifier ws://HOST:PORT, or --local for the draft alone", file=sys.stderr)
        return 2
    try:
        params = SamplingParams(temperature=args.temperature, top_k=args.top_k, seed=args.seed)
    except SamplingError as e:
        print(f"edge-agent: {e}", file=sys.stderr)
        return 2
    try:
        images = [Path(f).read_bytes() for f in args.image]
        drafter = Drafter(
            args.draft, threads=args.threads, n_gpu_layers=args.n_gpu_layers, mmproj=args.draft_mmproj or None
        )
        if images:
            prompt_ids, prompt_images = drafter.image_prompt(args.prompt, images, chat=args.chat)
        else:
            prompt_ids, prompt_images = drafter.tokenize(args.prompt, chat=args.chat), []
    except (OSError, ValueError) as e:  # a missing file, an image that is no JPEG/PNG
        print(f"edge-agent: {e}", file=sys.stderr)
        return 2
    token = args.token if args.token is not None else os.environ.get("VERIFIER_TOKEN", "")
    exits = None if args.exits == "all" else tuple(int(x) for x in args.exits.split(",") if x.strip())
    fsd = FsdOptions(
        exits=exits,
        workers=args.predraft_workers,
        policy=args.queue_policy,
        guesses=not args.no_guesses,
        threads=args.predraft_threads,
    )
    try:
        policy = DraftPolicy(
            args.draft_policy,
            min_len=args.min_draft,
            max_len=args.max_draft,
            predictor=args.predictor,
            threshold=args.predictor_threshold,
            as2=not args.no_as2,
        )
    except ValueError as e:
        print(f"edge-agent: {e}", file=sys.stderr)
        return 2
    decoder = EdgeDecoder(
        drafter,
        DecoderConfig(
            url=None if args.local else args.verifier,
            token=token,
            fsd=fsd,
            policy=policy,
            trace=args.trace,
            payload=PayloadSpec.parse(args.payload, args.topk),
            slo=args.slo,
            ca_file=args.ca_file,
            allow_insecure=args.allow_insecure,
            robot_id=default_robot_id() if args.robot_id is None else args.robot_id,
        ),
    )
    try:
        gen = decoder.generate(
            prompt_ids,
            mode="local" if args.local else args.mode,
            max_tokens=args.max_tokens,
            params=params,
            gamma=args.gamma,
            images=prompt_images,
        )
    except (LinkLost, ServerError) as e:
        print(f"edge-agent: {e}", file=sys.stderr)
        return 3
    except (FileNotFoundError, ValueError) as e:  # no predictor for this pair, a policy the mode lacks
        print(f"edge-agent: {e}", file=sys.stderr)
        return 2
    finally:
        decoder.close()
    m = gen.metrics
    print(gen.text)
    print(
        f"[{gen.mode}] {len(gen.token_ids)} tokens in {m.wall_s:.2f}s ({m.tokens_per_s:.1f} tok/s); "
        f"rounds {m.rounds}, tau {m.tau if m.tau is None else round(m.tau, 2)}, acceptance "
        f"{m.acceptance_rate if m.acceptance_rate is None else round(m.acceptance_rate, 3)}, "
        f"draft {m.draft_ms:.0f} ms, verify {m.verify_ms:.0f} ms, network {m.network_ms:.0f} ms, "
        f"up {m.bytes_up} B, down {m.bytes_down} B",
        file=sys.stderr,
    )
    if gen.mode == "fsd":
        print(
            f"[fsd] pre-draft hits {m.predraft_hits}, misses {m.predraft_misses}, failures "
            f"{m.predraft_failures}, exits received {m.exits_received}, avg exit layer "
            f"{m.avg_exit_layer if m.avg_exit_layer is None else round(m.avg_exit_layer, 1)}",
            file=sys.stderr,
        )
    if gen.mode in ("sd", "fsd"):
        print(
            f"[{m.draft_policy}] draft lengths {dict(sorted(m.draft_lengths.items(), key=lambda kv: int(kv[0])))}"
            f", predictor stops {m.predictor_stops}, gamma* {m.gamma_star}, expected speedup "
            f"{m.expected_speedup if m.expected_speedup is None else round(m.expected_speedup, 2)}, "
            f"streamed alone {m.streamed_tokens}, AS2 switches {[s['to'] for s in m.as2_switches]}",
            file=sys.stderr,
        )
    if args.json:
        print(json.dumps(gen.to_json()))
    return 0


INSTRUCTION_STEPS = 30  # --instruction's steps when --max-steps is not given


def _run(args) -> int:
    import asyncio

    from agent.robot.camera import CameraError
    from agent.robot.controllers.base import ControllerError
    from agent.robot.scene import SceneError

    from . import config
    from .api import LocalApi
    from .daemon import Daemon

    shortcuts = [
        f"{key}={value!r}".replace("'", '"')
        for key, value in (
            ("link.verifier", args.verifier),
            ("robot.controller", args.controller),
            ("camera.source", args.camera),
            ("perception.kind", args.perception),
            ("offline.policy", args.offline),
            ("api.listen", args.listen),
            ("telemetry.path", args.telemetry),
        )
        if value is not None
    ]
    shortcuts += [
        f"robot.options.{key}={json.dumps(value)}"
        for key, value in (("scene", args.scene), ("start", args.start))
        if value is not None
    ]
    if args.json and not (args.instruction and args.exit_when_done):
        print("edge-agent: --json reports the episode of --instruction: give it with --exit-when-done", file=sys.stderr)
        return 2
    try:
        cfg = config.load(args.config, shortcuts + list(args.set))
        if (args.scene is not None or args.start is not None) and cfg.robot.controller != "sim":
            raise config.ConfigError(
                f"--scene and --start are the simulator's: robot.controller is {cfg.robot.controller!r}, not 'sim'"
            )
        cfg.api.secrets()  # the local API's token files are read before anything moves
        daemon = Daemon(cfg, **({"max_steps": args.max_steps} if args.max_steps else {}))
    except (config.ConfigError, ControllerError, SceneError) as e:
        print(f"edge-agent: {e}", file=sys.stderr)
        return 2
    if args.instruction and args.exit_when_done and not cfg.link.verifier and cfg.offline.policy == "hold":
        log.warning(
            "no verifier and offline.policy 'hold': the robot will hold still until the task times out "
            "(--offline local lets the draft model alone drive)"
        )
    try:
        daemon.start(notify_ready=False)
    except (ControllerError, CameraError, FileNotFoundError, ValueError) as e:
        print(f"edge-agent: cannot start: {e}", file=sys.stderr)
        daemon.close()
        return 2
    try:
        rc = asyncio.run(_serve(daemon, LocalApi(daemon), args))
    finally:
        daemon.close()
    if args.json:
        print(json.dumps(_episode_summary(daemon, args.instruction)), flush=True)
    return rc


def _episode_summary(daemon, instruction: str) -> dict:
    """The --json line: how the --instruction's task went (agent/app/episode.py's names; in the simulator also
    whether the robot reached what the instruction names, the path it took and the shortest one)."""
    from .episode import summarize

    end = daemon.history[-1]["state"] if daemon.history else "interrupted"
    records = daemon.task_records
    if daemon.world is None:
        return {
            "instruction": instruction,
            "end": end,
            "steps": len(records),
            "verified_steps": sum(r.mode == "verified" for r in records),
            "offline_steps": sum(r.mode == "offline" for r in records),
        }
    return summarize(daemon.world, records, instruction, end=end, reach_m=daemon.cfg.agent.reach_m)


async def _serve(daemon, api, args) -> int:
    import asyncio
    import signal

    from .config import ConfigError

    loop = asyncio.get_running_loop()
    done = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, done.set)
    try:
        await api.start()
    except (ConfigError, OSError) as e:  # the socket's folder, its group, an address in use
        print(f"edge-agent: cannot start the local API: {e}", file=sys.stderr)
        return 2
    daemon.notifier.ready()
    print(f"edge-agent: ready; local API at {api.address}", file=sys.stderr, flush=True)
    if args.instruction:
        daemon.submit(args.instruction, max_steps=args.max_steps or INSTRUCTION_STEPS)
    while not done.is_set():
        try:
            await asyncio.wait_for(done.wait(), 0.2)
        except asyncio.TimeoutError:
            pass
        if args.exit_when_done and args.instruction and daemon.history:
            break
    await api.close()
    return 0


def _setup_logging(level: str) -> None:
    """stderr for journald; under systemd (JOURNAL_STREAM set) each line carries its syslog priority
    as a <N> prefix, so `journalctl -p warning` filters it and no timestamp is doubled."""
    if os.environ.get("JOURNAL_STREAM"):
        priority = {logging.DEBUG: 7, logging.INFO: 6, logging.WARNING: 4, logging.ERROR: 3, logging.CRITICAL: 2}

        class Priority(logging.Filter):
            def filter(self, record):
                record.priority = priority.get(record.levelno, 6)
                return True

        handler = logging.StreamHandler(sys.stderr)
        handler.addFilter(Priority())
        handler.setFormatter(logging.Formatter("<%(priority)d>%(name)s: %(message)s"))
        logging.basicConfig(level=level.upper(), handlers=[handler])
    else:
        logging.basicConfig(
            level=level.upper(), stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
        )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="edge-agent", description="The robot side of speculative edge-cloud decoding.")
    ap.add_argument(
        "--log-level", default=None, help="default: INFO for run (the config in use is logged), WARNING otherwise"
    )
    sub = ap.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("generate", help="answer one prompt")
    g.add_argument("--verifier", help="wss://HOST:PORT of server-bridge (ws:// on loopback)")
    g.add_argument("--token", help="shared secret (default: $VERIFIER_TOKEN)")
    g.add_argument(
        "--ca-file", default="", help="wss://: the CA (PEM) of the server's certificate (default: the system's CAs)"
    )
    g.add_argument(
        "--allow-insecure",
        action="store_true",
        help="send the token over plain ws:// to another host (refused otherwise)",
    )
    g.add_argument(
        "--robot-id",
        default=None,
        help="X-Robot-Id in the handshake, which a load balancer hashes (default: robot-<hash of this machine's id>)",
    )
    g.add_argument("--prompt", required=True)
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument(
        "--mode",
        choices=("ar", "sd", "fsd"),
        default="sd",
        help="ar: server alone; sd: speculative; fsd: sd + early exits and pre-drafting",
    )
    g.add_argument(
        "--gamma", type=int, default=4, help="draft tokens per round (fixed), the cap of the predictor policy"
    )
    g.add_argument(
        "--draft-policy",
        choices=POLICIES,
        default="fixed",
        help="fixed: gamma every round; predictor: stop at the first predicted rejection; optimal: "
        "gamma* by Lambert W, and target-only streaming while speculation cannot win (AS2)",
    )
    g.add_argument("--min-draft", type=int, default=1, help="the predictor never stops a draft shorter")
    g.add_argument(
        "--max-draft", type=int, default=None, help="longest draft (default: gamma; for optimal the server's limit)"
    )
    g.add_argument(
        "--predictor",
        default="auto",
        help="rejection predictor .onnx (default: the one shipped for this draft and target)",
    )
    g.add_argument(
        "--predictor-threshold",
        type=float,
        default=None,
        help="stop below this acceptance probability (default: the model's own)",
    )
    g.add_argument("--no-as2", action="store_true", help="optimal: never switch to target-only streaming")
    g.add_argument(
        "--trace", metavar="FILE", help="append one JSON line per judged draft token (predictor features and label)"
    )
    g.add_argument(
        "--exits", default="all", help="fsd: early-exit layers to ask for, e.g. 18,26; 'all' (default) or '' for none"
    )
    g.add_argument("--predraft-workers", type=int, default=1, help="fsd: branches pre-drafted at once")
    g.add_argument("--predraft-threads", type=int, default=1, help="fsd: llama threads of the pre-draft context")
    g.add_argument(
        "--queue-policy",
        choices=("priority", "fifo", "random"),
        default="priority",
        help="fsd: order in which early verdicts are pre-drafted",
    )
    g.add_argument(
        "--no-guesses",
        action="store_true",
        help="fsd: pre-draft only from early exits, not from the robot's own guesses",
    )
    g.add_argument(
        "--slo",
        type=float,
        default=0.0,
        help="tokens/s this robot needs: the verifier's SLO class "
        "(it schedules rounds by the deadlines this sets); 0 = best effort",
    )
    g.add_argument(
        "--payload",
        choices=payload.KINDS,
        default=payload.DEFAULT_KIND,
        help="what the uplink carries of the draft's distributions at temperature > 0: full (fp16 q), "
        "topk (the K ids and probabilities the draft sampled from), split (q(x) only; p comes "
        "back on a rejection) or none (greedy only). Temperature 0 always sends ids only",
    )
    g.add_argument("--topk", type=int, default=payload.DEFAULT_TOPK, metavar="K", help="K of --payload topk")
    g.add_argument("--local", action="store_true", help="generate with the draft alone (offline)")
    g.add_argument(
        "--draft", default=modelfiles.DEFAULT_DRAFT, help=f"draft name ({', '.join(modelfiles.DRAFTS)}) or a GGUF path"
    )
    g.add_argument("--draft-mmproj", default="", help="the draft's vision projector GGUF (a vision-language draft)")
    g.add_argument(
        "--image",
        action="append",
        default=[],
        metavar="FILE",
        help="a JPEG or PNG for the prompt (repeatable; needs --draft-mmproj and a target that reads "
        "images): on the prompt's image markers, in front of it, or with --chat in the user turn",
    )
    g.add_argument("--threads", type=int, default=2)
    g.add_argument(
        "--n-gpu-layers",
        type=int,
        default=-1,
        help="draft layers on the GPU (default -1: all when llama.cpp can offload; 0: CPU)",
    )
    g.add_argument("--json", action="store_true", help="last stdout line: one JSON object with text and metrics")
    r = sub.add_parser(
        "run", help="the robot daemon: camera + instruction -> safe navigation actions (systemd/edge-agent.service)"
    )
    r.add_argument("--config", help="TOML config (systemd/edge-agent.toml is the annotated example)")
    r.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="SECTION.FIELD=VALUE",
        help="override any config field, e.g. --set safety.max_vx=0.3 (repeatable; the value is TOML)",
    )
    r.add_argument("--verifier", help="= --set link.verifier=URL")
    r.add_argument("--controller", choices=("sim", "serial", "go2", "ros2"), help="= --set robot.controller=...")
    r.add_argument("--camera", help="= --set camera.source=...")
    r.add_argument(
        "--perception",
        choices=("sim", "color", "vlm"),
        help="= --set perception.kind=... (vlm: the "
        "camera image itself in the prompt; needs --set agent.draft_mmproj=PATH and a VLM draft)",
    )
    r.add_argument("--offline", choices=("hold", "local"), help="= --set offline.policy=...")
    r.add_argument(
        "--listen",
        help="= --set api.listen=unix:PATH|HOST:PORT (default: a Unix socket, mode 0600, in $RUNTIME_DIRECTORY, "
        "$XDG_RUNTIME_DIR/edge-agent or /tmp/edge-agent-UID; TCP needs api.token_file, and an address other "
        "than loopback also api.allow_remote = true)",
    )
    r.add_argument("--telemetry", help="= --set telemetry.path=FILE")
    r.add_argument(
        "--scene",
        help="sim: a scene file (JSON, agent/robot/scene.py) or a shipped scene's name "
        "(= --set robot.options.scene=...)",
    )
    r.add_argument(
        "--start", type=int, help="sim: which of the scene's start poses, from 0 (= --set robot.options.start=...)"
    )
    r.add_argument("--instruction", help="submit this instruction at start (as the local API's submit would)")
    r.add_argument(
        "--max-steps",
        type=int,
        default=None,
        help=f"steps per instruction before the robot gives up (default {INSTRUCTION_STEPS} for "
        "--instruction, 40 for the local API's tasks)",
    )
    r.add_argument("--exit-when-done", action="store_true", help="with --instruction: exit once it has finished")
    r.add_argument(
        "--json",
        action="store_true",
        help="with --instruction and --exit-when-done: the last stdout line is one JSON object saying how "
        "it went (reached, steps, distance_m, collisions, verified_steps, offline_steps, path_m, "
        "shortest_m, spl, ...)",
    )
    args = ap.parse_args(argv)
    _setup_logging(args.log_level or ("INFO" if args.cmd == "run" else "WARNING"))
    if args.cmd == "generate":
        return _generate(args)
    if args.cmd == "run":
        return _run(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
