"""The simulated Go2 (agent/robot/go2_sim.py) in a process of its own, for tests that drive the real
unitree_sdk2py over real CycloneDDS.

DDS stays on this machine: the simulated robot and the test process are bound to the loopback interface
(`ChannelFactoryInitialize(domain, "lo")`: CycloneDDS sends and listens on `lo` only, so nothing leaves
the host or comes in from another), and on a DDS domain of this test process's own (DOMAIN, not the
Go2's 0), so two test runs on one machine do not see each other. The DDS participant is a per-process
singleton: every test in one pytest process uses DOMAIN.

`skip_reason()` says why these tests cannot run here (None when they can): the SDK or DDS not
installed (`make setup` installs both: the `go2` extra), or no loopback interface to bind to.
"""

from __future__ import annotations

import os
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOMAIN = 100 + os.getpid() % 100  # this test process's own DDS domain (the Go2's is 0)
INTERFACE = "lo"


def skip_reason() -> str | None:
    try:
        import cyclonedds  # noqa: F401
        import unitree_sdk2py  # noqa: F401
    except ImportError as e:
        return f"the Go2 SDK or CycloneDDS is not installed ({e}): `make setup` installs them (the go2 extra)"
    if not Path(f"/sys/class/net/{INTERFACE}").exists():
        return f"no {INTERFACE} interface to bind DDS to (a sandbox without loopback)"
    return None


class Go2Sim:
    """python -m agent.robot.go2_sim on DOMAIN over lo; `send("hang")` etc. as its docstring lists."""

    def __init__(self, *args: str):
        self.args = args
        self.proc: subprocess.Popen | None = None
        self._lines: queue.Queue = queue.Queue(1000)

    def start(self, timeout_s: float = 30.0) -> "Go2Sim":
        cmd = [sys.executable, "-m", "agent.robot.go2_sim", "--interface", INTERFACE, "--domain", str(DOMAIN)]
        self.proc = subprocess.Popen(
            [*cmd, *self.args],
            cwd=ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
        self._lines = queue.Queue(1000)
        threading.Thread(target=self._read, args=(self.proc, self._lines), daemon=True).start()
        self._expect("ready", timeout_s)
        return self

    @staticmethod
    def _read(proc: subprocess.Popen, lines: queue.Queue) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            try:
                lines.put_nowait(line.strip())
            except queue.Full:  # nobody reads: drop (the SDK prints a line per failed send)
                pass

    def _expect(self, want: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"the simulated Go2 did not say {want!r} in {timeout_s:.0f} s")
            try:
                if self._lines.get(timeout=min(left, 0.2)) == want:
                    return
            except queue.Empty:
                if self.proc is not None and self.proc.poll() is not None:  # it died: say so now, not at the timeout
                    raise RuntimeError(
                        f"the simulated Go2 exited ({self.proc.returncode}) before saying {want!r}: its log is above"
                    ) from None

    def send(self, command: str, timeout_s: float = 5.0) -> None:
        assert self.proc is not None and self.proc.stdin is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        self._expect(f"ok {command}", timeout_s)

    def report(self, timeout_s: float = 5.0) -> dict:
        """The robot's own account (pose, mode, collisions, distance to each object)."""
        import json

        assert self.proc is not None and self.proc.stdin is not None
        self.proc.stdin.write("report\n")
        self.proc.stdin.flush()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                line = self._lines.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                break
            if line.startswith("report "):
                return json.loads(line[len("report ") :])
        raise TimeoutError("the simulated Go2 did not report")

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout_s: float = 5.0) -> None:
        """The robot leaves the network (its participant closes, as when it is switched off)."""
        if self.proc is None:
            return
        try:
            if self.proc.poll() is None and self.proc.stdin is not None:
                self.proc.stdin.write("quit\n")
                self.proc.stdin.flush()
            self.proc.wait(timeout_s)
        except (subprocess.TimeoutExpired, BrokenPipeError, OSError):
            self.proc.kill()
            self.proc.wait(5)
        self.proc = None
