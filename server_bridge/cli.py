"""`server-bridge serve`: run the verifier."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import ssl
import sys

from .config import DTYPES, ENGINES, EXIT_POLICIES, SCHEDULERS, ServerConfig


def _layers(text: str) -> list[int]:
    """'12,26' -> [12, 26]; '' or 'all' -> [] (every trained exit)."""
    if text.strip() in ("", "all"):
        return []
    try:
        return [int(t) for t in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated layer numbers, got {text!r}") from None


def _cidrs(text: str) -> list[str]:
    """'127.0.0.1/32,10.0.0.0/8' -> the list; '' -> [] (no trusted proxy)."""
    return [t.strip() for t in text.split(",") if t.strip()]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="server-bridge", description="Verify robots' drafts with the target model.")
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("serve", help="run the websocket verifier")
    s.add_argument("--config", help="TOML file ([server] table); flags override it")
    s.add_argument("--host")
    s.add_argument("--port", type=int)
    s.add_argument(
        "--token",
        help="shared secret robots send in hello, and /metrics wants as a Bearer credential (default: "
        "$VERIFIER_TOKEN; none means loopback clients only)",
    )
    s.add_argument(
        "--trust-loopback",
        action=argparse.BooleanOptionalAction,
        help="loopback clients need no token (default: only when no token is set; with a token, everyone, "
        "loopback included, presents it)",
    )
    s.add_argument(
        "--trusted-proxies",
        type=_cidrs,
        help="comma-separated CIDRs of proxies (HAProxy) whose X-Forwarded-For names the client, e.g. "
        "127.0.0.1/32 for a proxy on this host (default: none, X-Forwarded-For ignored)",
    )
    s.add_argument(
        "--metrics-listen",
        help="HOST:PORT for a plain-HTTP /metrics and full /healthz without a token, e.g. 127.0.0.1:9100 "
        "(default: off; on the main port a set token is needed as Authorization: Bearer)",
    )
    s.add_argument(
        "--hello-timeout-s", type=float, help="a connection without a valid hello this long after accept is closed (5)"
    )
    s.add_argument(
        "--max-unauthenticated",
        type=int,
        help="connections before hello over all peers; a newcomer beyond it evicts the oldest (64)",
    )
    s.add_argument(
        "--max-unauthenticated-per-address",
        type=int,
        help="connections before hello from one client address; beyond it a newcomer is closed at once (8)",
    )
    s.add_argument("--log-lines-per-10s", type=int, help="log lines per connection in 10 s, then one summary (20)")
    s.add_argument("--tls-cert", help="PEM certificate (chain): serve wss:// (robots: link.ca_file = its CA)")
    s.add_argument("--tls-key", help="PEM private key of --tls-cert")
    s.add_argument("--target", help="target name (smollm2-f32), a GGUF file or a Hugging Face model directory")
    s.add_argument(
        "--engine",
        choices=ENGINES,
        help="llamacpp (default for GGUF targets: llama.cpp, no torch) or torch (any transformers model on any device)",
    )
    s.add_argument("--mmproj", help="llamacpp engine: the target's vision projector GGUF (robots may then send images)")
    s.add_argument("--device", help="torch engine: auto (default: CUDA where present), cpu, cuda or cuda:N")
    s.add_argument(
        "--dtype",
        choices=DTYPES,
        help="torch engine: auto (default: bfloat16 on CUDA, float32 on the CPU), float32, bfloat16 or float16",
    )
    s.add_argument(
        "--n-gpu-layers",
        type=int,
        help="llamacpp engine: layers offloaded to the GPU (default -1: all, "
        "when llama.cpp was built with GPU support)",
    )
    s.add_argument(
        "--kv-tokens", type=int, help="KV memory in tokens over all sessions (default: max-sessions x max-context)"
    )
    s.add_argument("--kv-type", choices=("f16", "f32"), help="llamacpp engine: KV element type (default f16)")
    s.add_argument(
        "--kv-unified",
        choices=("auto", "on", "off"),
        help="llamacpp engine: one KV pool for every "
        "session (on) or a stream per session (off: faster batched passes on a GPU); auto (default) = off "
        "when layers are offloaded and no exits are tapped",
    )
    s.add_argument("--n-ubatch", type=int, help="llamacpp engine: tokens per micro-batch (default 0: a whole pass)")
    s.add_argument(
        "--flash-attn",
        choices=("auto", "on", "off"),
        help="llamacpp engine: flash attention (default auto: where the backend has it)",
    )
    s.add_argument("--threads", type=int, help="engine threads (llama.cpp or torch)")
    s.add_argument("--max-sessions", type=int)
    s.add_argument("--idle-timeout-s", type=float)
    s.add_argument(
        "--replica-id",
        help="this replica's name in welcome, opened, /healthz and /metrics "
        "(default HOST:PORT; on Kubernetes pass the pod's name)",
    )
    s.add_argument(
        "--detached-grace-s",
        type=float,
        help="how long a session whose connection closed keeps its KV for its robot to come back (default 60)",
    )
    s.add_argument(
        "--drain-timeout-s",
        type=float,
        help="SIGTERM drains: no new robots, rounds in flight finish, "
        "connections close with 1012; at most this long (default 30)",
    )
    s.add_argument(
        "--exits",
        help="early-exit adapters: path prefix of <prefix>.safetensors/.json; 'auto' (default) "
        "= models/exits/<target> if trained; '' = no exits",
    )
    s.add_argument(
        "--exit-layers", type=_layers, help="comma-separated exits to load, e.g. 22,26; '' or 'all' = every trained one"
    )
    s.add_argument(
        "--exit-policy",
        choices=EXIT_POLICIES,
        help="order of pending exit messages (and what a full outbox drops): priority (by confidence), fifo or random",
    )
    s.add_argument("--exit-queue", type=int, help="exit messages pending per connection before drops")
    s.add_argument("--exit-bonus-candidates", type=int, help="ids later exits score at the bonus row")
    s.add_argument(
        "--scheduler",
        choices=SCHEDULERS,
        help="which waiting rounds share a forward pass: slo "
        "(deadline- and utility-aware, WISP; default), fcfs (one at a time) or fixed (max-batch in "
        "arrival order)",
    )
    s.add_argument("--max-batch", type=int, help="sessions in one forward pass")
    s.add_argument("--max-queue", type=int, help="requests waiting for the target before newcomers are shed")
    s.add_argument("--max-wait-ms", type=float, help="a request waiting longer is shed (the robot falls back)")
    s.add_argument(
        "--batch-wait-ms",
        type=float,
        help="fixed: how long the oldest waits for a full batch; slo: how "
        "long a free target may wait for a robot due back (never while a request is critical)",
    )
    s.add_argument("--guard-ms", type=float, help="guard time in the latest start time")
    s.add_argument("--default-slo", type=float, help="tokens/s for sessions that open without one (0: best effort)")
    s.add_argument(
        "--estimator",
        help="verification-time coefficients JSON; 'auto' (default) = "
        "models/estimator/<target>.json; '' = rough defaults",
    )
    s.add_argument("--log-level", default="INFO")
    p = sub.add_parser(
        "prepare",
        help="make the target's GGUF (F32, from the shipped Q4_1) and, for --engine torch, its model directory",
    )
    p.add_argument("--target", default=None)
    p.add_argument("--engine", choices=ENGINES, default="auto")
    p.add_argument("--log-level", default="INFO")
    p.add_argument(
        "--verbose",
        action="store_true",
        help="llama.cpp's own log (the quantizer's line per tensor, "
        "the model load) on the terminal; also EDGESPEC_VERBOSE=1",
    )
    args = ap.parse_args(argv)

    logging.basicConfig(
        level=args.log_level.upper(), stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if args.cmd == "prepare":
        from runtime import llamalog

        from .target import load_target

        llamalog.want_verbose(args.verbose)

        target = load_target(args.target, args.engine, threads=1, max_sequences=1, kv_tokens=256, max_len=256)
        print(
            f"target {target.name} ready on the {target.engine.info.engine} engine: vocab {target.vocab_size}, "
            f"{target.n_layers} layers"
        )
        return 0
    token = args.token if args.token is not None else os.environ.get("VERIFIER_TOKEN")
    try:
        config = ServerConfig.load(
            args.config,
            host=args.host,
            port=args.port,
            token=token,
            trust_loopback=args.trust_loopback,
            trusted_proxies=args.trusted_proxies,
            metrics_listen=args.metrics_listen,
            hello_timeout_s=args.hello_timeout_s,
            max_unauthenticated=args.max_unauthenticated,
            max_unauthenticated_per_address=args.max_unauthenticated_per_address,
            log_lines_per_10s=args.log_lines_per_10s,
            tls_cert=args.tls_cert,
            tls_key=args.tls_key,
            target=args.target,
            engine=args.engine,
            mmproj=args.mmproj,
            device=args.device,
            dtype=args.dtype,
            n_gpu_layers=args.n_gpu_layers,
            kv_tokens=args.kv_tokens,
            kv_type=args.kv_type,
            kv_unified=args.kv_unified,
            n_ubatch=args.n_ubatch,
            flash_attn=args.flash_attn,
            threads=args.threads,
            max_sessions=args.max_sessions,
            idle_timeout_s=args.idle_timeout_s,
            replica_id=args.replica_id,
            detached_grace_s=args.detached_grace_s,
            drain_timeout_s=args.drain_timeout_s,
            exits=args.exits,
            exit_layers=args.exit_layers,
            exit_policy=args.exit_policy,
            exit_queue=args.exit_queue,
            exit_bonus_candidates=args.exit_bonus_candidates,
            scheduler=args.scheduler,
            max_batch=args.max_batch,
            max_queue=args.max_queue,
            max_wait_ms=args.max_wait_ms,
            batch_wait_ms=args.batch_wait_ms,
            guard_ms=args.guard_ms,
            default_slo=args.default_slo,
            estimator=args.estimator,
        )
    except (ValueError, OSError) as e:
        print(f"server-bridge: bad configuration: {e}", file=sys.stderr)
        return 2
    from .server import run, tls_context

    try:
        tls_context(config)  # a bad certificate or key fails here, before the model loads
    except (OSError, ssl.SSLError) as e:
        print(f"server-bridge: bad configuration: tls_cert/tls_key: {e}", file=sys.stderr)
        return 2
    logging.getLogger("server_bridge").info("config in use: %s", json.dumps(config.redacted()))

    asyncio.run(run(config))
    return 0


if __name__ == "__main__":
    sys.exit(main())
