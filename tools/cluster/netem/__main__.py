"""CLI: run a NetemProxy in the foreground until SIGINT/SIGTERM.

Prints the listening address (``host:port``) as the first stdout line so a
script can start it with ``--listen 127.0.0.1:0`` and read the port back.
Per-connection open/close lines go to stderr.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
from typing import Optional, Sequence

from tools.cluster.netem.proxy import LinkProfile, NetemProxy


def parse_host_port(text: str) -> tuple[str, int]:
    """'127.0.0.1:9000' or '[::1]:9000' -> (host, port)."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {text!r}")
    return host.strip("[]"), int(port)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m tools.cluster.netem", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--listen",
        type=parse_host_port,
        default=("127.0.0.1", 0),
        help="HOST:PORT to listen on (port 0 = any free port; default 127.0.0.1:0)",
    )
    p.add_argument("--upstream", type=parse_host_port, required=True, help="HOST:PORT of the real server")
    p.add_argument("--rtt-ms", type=float, default=0.0, help="round-trip delay, split evenly")
    p.add_argument(
        "--jitter-ms", type=float, default=0.0, help="uniform +-jitter per chunk, per direction (never reorders)"
    )
    p.add_argument("--bandwidth-mbps", type=float, default=0.0, help="per-direction rate in Mbit/s (0 = unlimited)")
    p.add_argument(
        "--disconnect-after-s",
        type=float,
        default=None,
        help="drop all connections once, this many seconds after start",
    )
    p.add_argument(
        "--disconnect-after-bytes",
        type=int,
        default=None,
        help="drop all connections once, after this many server->client bytes",
    )
    p.add_argument(
        "--drop-prob",
        type=float,
        default=0.0,
        help="per-chunk probability of killing that connection (chaos; not packet loss)",
    )
    p.add_argument(
        "--max-buffered-bytes", type=int, default=8 * 2**20, help="per-direction in-flight cap before backpressure"
    )
    p.add_argument("--seed", type=int, default=0, help="seed for jitter and drop_prob")
    p.add_argument("--quiet", action="store_true", help="no per-connection log lines")
    return p


def make_proxy(args: argparse.Namespace) -> NetemProxy:
    profile = LinkProfile.from_rtt(args.rtt_ms, args.jitter_ms, args.bandwidth_mbps)
    return NetemProxy(
        args.upstream[0],
        args.upstream[1],
        profile,
        listen_host=args.listen[0],
        listen_port=args.listen[1],
        seed=args.seed,
        max_buffered_bytes=args.max_buffered_bytes,
        drop_prob=args.drop_prob,
    )


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.WARNING if args.quiet else logging.INFO, stream=sys.stderr, format="%(asctime)s %(message)s"
    )
    try:
        proxy = make_proxy(args)
    except ValueError as exc:
        parser.error(str(exc))
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    with proxy:
        if args.disconnect_after_s is not None or args.disconnect_after_bytes is not None:
            proxy.schedule_disconnect(after_bytes_down=args.disconnect_after_bytes, after_s=args.disconnect_after_s)
        print(proxy.address, flush=True)
        print(
            f"netem: {proxy.address} -> {args.upstream[0]}:{args.upstream[1]} {proxy.profile}",
            file=sys.stderr,
            flush=True,
        )
        while not stop.wait(0.5):  # short waits keep signal delivery prompt
            pass
    print(f"netem: stopped; stats {proxy.stats()}", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
