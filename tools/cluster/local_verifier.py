"""Run server-bridge in a child process on a free loopback port, optionally pinned to CPU cores.

Used by the demo and the benchmark, so the verifier and the robot's draft
model do not compete for the same core (the latency model assumes they run
on separate machines).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_command(port: int, *args: str) -> list[str]:
    """`server-bridge serve` on 127.0.0.1:port, run by this interpreter, with more flags."""
    return [sys.executable, "-m", "server_bridge.cli", "serve", "--host", "127.0.0.1", "--port", str(port), *args]


def stop_process(proc: subprocess.Popen | None) -> None:
    """SIGTERM, then SIGKILL after 10 s: a server we started never outlives its benchmark."""
    if proc and proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


class LocalVerifier:
    def __init__(
        self,
        target: str | None = None,
        cpus: set[int] | None = None,
        threads: int = 1,
        token: str = "",
        start_timeout_s: float = 300.0,
        extra_args: list[str] = (),
    ):
        self.target = target
        self.cpus = cpus
        self.threads = threads
        self.token = token
        self.start_timeout_s = start_timeout_s
        self.extra_args = list(extra_args)  # more `server-bridge serve` flags
        self.port = free_port()
        self.proc: subprocess.Popen | None = None
        self.log_path = Path(tempfile.mkstemp(prefix="server-bridge-", suffix=".log")[1])

    @property
    def url(self) -> str:
        return f"ws://127.0.0.1:{self.port}"

    def __enter__(self) -> "LocalVerifier":
        cmd = serve_command(self.port, "--threads", str(self.threads))
        if self.target:
            cmd += ["--target", self.target]
        cmd += self.extra_args
        env = dict(os.environ, VERIFIER_TOKEN=self.token, OMP_NUM_THREADS=str(self.threads))
        cpus = self.cpus
        self.proc = subprocess.Popen(
            cmd,
            stdout=self.log_path.open("w"),
            stderr=subprocess.STDOUT,
            env=env,
            preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None,
        )
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server-bridge exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{self.port}/healthz", timeout=1).read()
                return self
            except OSError:
                time.sleep(0.25)
        self.__exit__()
        raise TimeoutError(f"server-bridge did not answer /healthz in {self.start_timeout_s}s:\n{self.log_tail()}")

    def __exit__(self, *exc) -> None:
        stop_process(self.proc)

    def metrics(self) -> str:
        """/metrics, with the token as a Bearer credential where the server has one (it wants it then)."""
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        request = urllib.request.Request(f"http://127.0.0.1:{self.port}/metrics", headers=headers)
        return urllib.request.urlopen(request, timeout=5).read().decode()

    def log_tail(self, n: int = 20) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])


def pin_cores() -> tuple[set[int], set[int]]:
    """(agent cores, server cores): disjoint when the machine has two or more."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        return set(cpus), set(cpus)
    half = len(cpus) // 2
    return set(cpus[:half]), set(cpus[half:])
