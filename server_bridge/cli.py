"""`server-bridge serve`: run the verifier."""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys

from .config import EXIT_POLICIES, SCHEDULERS, ServerConfig


def _layers(text: str) -> list[int]:
    """'12,26' -> [12, 26]; '' or 'all' -> [] (every trained exit)."""
    if text.strip() in ("", "all"):
        return []
    try:
        return [int(t) for t in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated layer numbers, got {text!r}") from None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="server-bridge", description="Verify robots' drafts with the target model.")
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("serve", help="run the websocket verifier")
    s.add_argument("--config", help="TOML file ([server] table); flags override it")
    s.add_argument("--host")
    s.add_argument("--port", type=int)
    s.add_argument("--token", help="shared secret robots send in hello (default: $VERIFIER_TOKEN; "
                   "none means loopback clients only)")
    s.add_argument("--target", help="target name (smollm2-f32), a GGUF file or a Hugging Face model directory")
    s.add_argument("--threads", type=int, help="torch threads")
    s.add_argument("--max-sessions", type=int)
    s.add_argument("--idle-timeout-s", type=float)
    s.add_argument("--exits", help="early-exit adapters: path prefix of <prefix>.safetensors/.json; 'auto' (default) "
                   "= models/exits/<target> if trained; '' = no exits")
    s.add_argument("--exit-layers", type=_layers, help="comma-separated exits to load, e.g. 22,26; "
                   "'' or 'all' = every trained one")
    s.add_argument("--exit-policy", choices=EXIT_POLICIES, help="order of pending exit messages (and what a full "
                   "outbox drops): priority (by confidence), fifo or random")
    s.add_argument("--exit-queue", type=int, help="exit messages pending per connection before drops")
    s.add_argument("--exit-bonus-candidates", type=int, help="ids later exits score at the bonus row")
    s.add_argument("--scheduler", choices=SCHEDULERS, help="which waiting rounds share a forward pass: slo "
                   "(deadline- and utility-aware, WISP; default), fcfs (one at a time) or fixed (max-batch in "
                   "arrival order)")
    s.add_argument("--max-batch", type=int, help="sessions in one forward pass")
    s.add_argument("--max-queue", type=int, help="requests waiting for the target before newcomers are shed")
    s.add_argument("--max-wait-ms", type=float, help="a request waiting longer is shed (the robot falls back)")
    s.add_argument("--batch-wait-ms", type=float, help="fixed: how long the oldest waits for a full batch; slo: how "
                   "long a free target may wait for a robot due back (never while a request is critical)")
    s.add_argument("--guard-ms", type=float, help="guard time in the latest start time")
    s.add_argument("--default-slo", type=float, help="tokens/s for sessions that open without one (0: best effort)")
    s.add_argument("--estimator", help="verification-time coefficients JSON; 'auto' (default) = "
                   "models/estimator/<target>.json; '' = rough defaults")
    s.add_argument("--log-level", default="INFO")
    p = sub.add_parser("prepare", help="convert and cache the target (first start takes ~1 min, later ones ~1 s)")
    p.add_argument("--target", default=None)
    p.add_argument("--log-level", default="INFO")
    args = ap.parse_args(argv)

    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.cmd == "prepare":
        from protocol import modelfiles
        from .target import TargetModel

        target = TargetModel(args.target or modelfiles.DEFAULT_TARGET)
        print(f"target {target.name} ready: vocab {target.vocab_size}, {target.n_layers} layers")
        return 0
    token = args.token if args.token is not None else os.environ.get("VERIFIER_TOKEN")
    try:
        config = ServerConfig.load(args.config, host=args.host, port=args.port, token=token, target=args.target,
                                   threads=args.threads, max_sessions=args.max_sessions,
                                   idle_timeout_s=args.idle_timeout_s, exits=args.exits,
                                   exit_layers=args.exit_layers, exit_policy=args.exit_policy,
                                   exit_queue=args.exit_queue, exit_bonus_candidates=args.exit_bonus_candidates,
                                   scheduler=args.scheduler, max_batch=args.max_batch, max_queue=args.max_queue,
                                   max_wait_ms=args.max_wait_ms, batch_wait_ms=args.batch_wait_ms,
                                   guard_ms=args.guard_ms, default_slo=args.default_slo, estimator=args.estimator)
    except (ValueError, OSError) as e:
        print(f"server-bridge: bad configuration: {e}", file=sys.stderr)
        return 2
    logging.getLogger("server_bridge").info("config in use: %s", json.dumps(config.redacted()))
    from .server import run

    asyncio.run(run(config))
    return 0


if __name__ == "__main__":
    sys.exit(main())
