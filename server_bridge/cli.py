"""`server-bridge`: `serve` runs the verifier (its flags derived from ServerConfig's fields), `prepare` makes
the target's files, `plan` plans a fleet's batches, `profile` fits the estimator, `train-exits` trains the
early exits, `fleet` runs replicas behind HAProxy and `loadtest` measures a running verifier's capacity."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import socket
import ssl
import sys

from protocol.modelfiles import ModelNotFound
from runtime import settings

from .config import (
    EngineSettings,
    FleetConfig,
    LoadConfig,
    LoadtestConfig,
    PlanConfig,
    ProfileConfig,
    ServerConfig,
    TrainExitsConfig,
)


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="server-bridge", description="Verify robots' drafts with the target model.")
    ap.add_argument("--version", action="version", version=f"%(prog)s {settings.version()}")
    ap.add_argument("--log-level", default="INFO", help="before or after the subcommand")
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("serve", help="run the websocket verifier")
    s.add_argument("--config", help="TOML file ([server] table); flags override it")
    settings.add_flags(s, ServerConfig, overriding=True)  # --host, --port, ..., one per field
    s.add_argument("--log-level", default=argparse.SUPPRESS, help="default INFO")
    p = sub.add_parser(
        "prepare",
        help="make the target's GGUF (F32, from the shipped Q4_1) and, for --engine torch, its model directory",
    )
    settings.add_flags(p, EngineSettings, only=("target", "engine"))
    p.add_argument("--log-level", default=argparse.SUPPRESS, help="default INFO")
    p.add_argument(
        "--verbose",
        action="store_true",
        help="llama.cpp's own log (the quantizer's line per tensor, "
        "the model load) on the terminal; also EDGESPEC_VERBOSE=1",
    )
    _tool_parsers(sub)
    return ap


def _tool_parsers(sub: argparse._SubParsersAction) -> None:
    """The operator's tools, each a subcommand whose flags come from its config in config.py."""
    p = sub.add_parser("plan", help="plan a fleet's batches and draft lengths (paper 000's pipelined serving)")
    settings.add_flags(p, PlanConfig)
    p.add_argument("--json", action="store_true", help="the plan as one JSON object")
    p = sub.add_parser("profile", help="time the target's batched pass and fit the estimator the scheduler reads")
    settings.add_flags(p, ProfileConfig)
    p = sub.add_parser("train-exits", help="train the target's early-exit adapters (FSD) by self-distillation")
    settings.add_flags(p, TrainExitsConfig)
    p = sub.add_parser("fleet", help="run N `serve` replicas behind HAProxy on loopback")
    settings.add_flags(p, FleetConfig)
    p = sub.add_parser("loadtest", help="N replayed robots against a running verifier: SLO violations, capacity")
    settings.add_flags(p, LoadtestConfig)
    settings.add_flags(p, LoadConfig)
    p.add_argument("--json", action="store_true", help="the points and capacities as one JSON object")
    for p in sub.choices.values():
        if "--log-level" not in p._option_string_actions:
            p.add_argument("--log-level", default=argparse.SUPPRESS, help="default INFO")


def _plan(args: argparse.Namespace) -> int:
    from .ops import planner

    try:
        config = PlanConfig(**settings.given(PlanConfig, args))
        return planner.run(config, as_json=args.json)
    except ValueError as e:
        print(f"server-bridge plan: {e}", file=sys.stderr)
        return 2


def _tool(args: argparse.Namespace) -> int:
    """profile, train-exits or fleet: its config from the flags (a bad value: one line, exit 2), then its run."""
    cls = {"profile": ProfileConfig, "train-exits": TrainExitsConfig, "fleet": FleetConfig}[args.cmd]
    try:
        config = cls(**settings.given(cls, args))
    except ValueError as e:
        print(f"server-bridge {args.cmd}: bad configuration: {e}", file=sys.stderr)
        return 2
    if args.cmd == "profile":
        from .ops import profile

        return profile.run(config, args.argv)
    if args.cmd == "train-exits":
        from .ops import train_exits

        try:
            return train_exits.run(config)
        except ValueError as e:  # a prompt file or a frame that is not what it should be
            print(f"server-bridge train-exits: {e}", file=sys.stderr)
            return 2
    from .ops import fleet

    return fleet.run(config)


def _loadtest(args: argparse.Namespace) -> int:
    from .ops import loadtest

    try:
        target = LoadtestConfig(**settings.given(LoadtestConfig, args))
        return loadtest.run(target, LoadConfig(**settings.given(LoadConfig, args)), as_json=args.json)
    except ValueError as e:
        print(f"server-bridge loadtest: {e}", file=sys.stderr)
        return 2


COMMANDS = {"plan": _plan, "profile": _tool, "train-exits": _tool, "fleet": _tool, "loadtest": _loadtest}


def _prepare(args: argparse.Namespace) -> int:
    from runtime import llamalog

    from .target import load_target

    llamalog.want_verbose(args.verbose)
    target = load_target(args.target, args.engine, threads=1, max_sequences=1, kv_tokens=256, max_len=256)
    print(
        f"target {target.name} ready on the {target.engine.info.engine} engine: vocab {target.vocab_size}, "
        f"{target.n_layers} layers"
    )
    return 0


def _serve(args: argparse.Namespace) -> int:
    flags = settings.given(ServerConfig, args)  # only the flags given: the file's values stand for the rest
    if "token" not in flags:
        flags["token"] = os.environ.get("VERIFIER_TOKEN")  # None (unset) leaves the file's token
    try:
        config = ServerConfig.load(args.config, **flags)
    except (ValueError, OSError) as e:
        print(f"server-bridge: bad configuration: {e}", file=sys.stderr)
        return 2
    from .server import run, tls_context

    try:
        tls_context(config)  # a bad certificate or key fails here, before the model loads
    except (OSError, ssl.SSLError) as e:
        print(f"server-bridge: bad configuration: tls_cert/tls_key: {e}", file=sys.stderr)
        return 2
    busy = _port_in_use(config.host, config.port)
    if busy:  # before the model loads (tens of seconds), not after
        print(f"server-bridge: cannot listen on {config.host}:{config.port}: {busy}", file=sys.stderr)
        return 1
    logging.getLogger("server_bridge").info("config in use: %s", json.dumps(config.redacted()))
    asyncio.run(run(config))
    return 0


def _port_in_use(host: str, port: int) -> str | None:
    """Why (host, port) cannot be bound now, or None. Port 0 (any free port) is always free."""
    if port == 0:
        return None
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        return str(e)
    for family, kind, proto, _, address in infos[:1]:
        with socket.socket(family, kind, proto) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server binds: TIME_WAIT is no obstacle
            try:
                s.bind(address)
            except OSError as e:
                return e.strerror or str(e)
    return None


def main(argv: list[str] | None = None) -> int:
    """Every error a user can cause is one line on stderr and a non-zero exit, not a traceback."""
    args = _parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(
        level=args.log_level.upper(), stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        if args.cmd in COMMANDS:
            return COMMANDS[args.cmd](args)
        return _prepare(args) if args.cmd == "prepare" else _serve(args)
    except ModelNotFound as e:
        print(f"server-bridge: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # the port taken between the check and the bind, a model file unreadable, ...
        print(f"server-bridge: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("server-bridge: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
