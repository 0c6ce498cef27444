"""The episode runner the demo and nav_eval share: agent/app/episode.py's `navigate`, plus a link cut and a printer.

    navigate_with_cut(daemon_or_nav, world, instruction, max_steps=30, cut_at=3, cut_steps=3, link_proxy=proxy,
                      printer=print_step) -> (summary, records)

A cut makes the verifier unreachable before step `cut_at` for `cut_steps` steps: the proxy
(tools/cluster/netem's NetemProxy) resets every open connection and refuses new ones, then lets them
in again. The link is always restored when the episode ends, also when it ends during a cut.
"""

from __future__ import annotations

import sys
import time
from typing import Callable

from agent.app.episode import navigate
from agent.app.navigator import Step
from agent.app.transcript import step_lines
from agent.robot.camera import StaleFrame


class LinkCut:
    """before_step hook: cut the link at step `at` for `steps` steps (at 0 or no proxy: never)."""

    def __init__(self, proxy, at: int, steps: int, say: Callable[[str], None] | None = print):
        self.proxy, self.at, self.steps, self.say = proxy, at, steps, say
        self.down_until: int | None = None

    def __call__(self, n: int) -> None:
        if self.proxy is None or not self.at:
            return
        if n == self.at:
            self.proxy.refuse_new(True)
            self.proxy.disconnect_all()
            self.down_until = n + self.steps
            if self.say:
                self.say(f"  ~~ link cut: the verifier is unreachable for the next {self.steps} steps ~~")
        if self.down_until is not None and n == self.down_until:
            self.restore()

    def restore(self) -> None:
        if self.proxy is not None and self.down_until is not None:
            self.proxy.refuse_new(False)
            self.down_until = None
            if self.say:
                self.say("  ~~ link restored ~~")


def restart(daemon, pose: tuple[float, float, float], start_index: int | None = None, timeout_s: float = 5.0) -> None:
    """Put a started daemon's sim robot at `pose` for a new episode (SimWorld.restart) and wait for a camera
    frame rendered there, so the episode's first step cannot see the old pose."""
    daemon.control.halt("episode_end")
    daemon.world.restart(pose, start_index)
    want = tuple(daemon.world.start)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if tuple(daemon.grabber.read_latest(timeout_s * 1e3).meta.get("pose", ())) == want:
                return
        except StaleFrame:
            pass
        time.sleep(0.01)
    raise TimeoutError(f"no camera frame within {timeout_s} s of the restart")


def print_step(n: int, rec: Step) -> None:
    """The demo's lines for one step (agent/app/transcript.py, which `edge-agent run` prints too)."""
    print(step_lines(n, rec), flush=True)


def navigate_with_cut(
    daemon_or_nav,
    world,
    instruction: str,
    max_steps: int = 30,
    cut_at: int = 0,
    cut_steps: int = 3,
    link_proxy=None,
    printer: Callable[[int, Step], None] | None = None,
    task: str = "episode",
    telemetry=None,
    say: Callable[[str], None] | None = print,
    overlap: bool | None = None,
) -> tuple[dict, list[Step]]:
    """One instruction from the world's current pose until the model says stop or max_steps pass.

    daemon_or_nav: a started agent.app.daemon.Daemon (its Navigator and telemetry are used) or a Navigator.
    `task` keys the Navigator's per-task memory: give each episode its own. telemetry: a TelemetryWriter
    for one JSON line per step (default: the daemon's). say: where the cut's messages go (None: nowhere).
    The summary (agent.app.episode.summarize) also says where the link was cut. overlap: None, the config's.
    """
    nav = getattr(daemon_or_nav, "nav", None) or daemon_or_nav
    telemetry = telemetry if telemetry is not None else getattr(daemon_or_nav, "telemetry", None)
    cut = LinkCut(link_proxy, cut_at, cut_steps, say)
    record = getattr(daemon_or_nav, "record_step", None)  # the daemon's MCAP recording (record.path), if any

    def on_step(n: int, rec: Step) -> None:
        if telemetry is not None:
            telemetry.write(rec.to_json())
        if record is not None:
            record(rec)
        if printer is not None:
            printer(n, rec)

    def before(n: int) -> None:
        cut(n)
        if printer is not None and sys.stdout.isatty():
            print(f"[{n:2d}] looking and thinking ...", end="\r", flush=True)

    if nav.link == "down":  # a cut that outlived the last episode: probe now, not after a backoff
        nav.check_link()
    try:
        summary, records = navigate(
            nav, world, instruction, max_steps, task=task, before_step=before, on_step=on_step, overlap=overlap
        )
    finally:
        cut.restore()
    summary["cut"] = {"at": cut_at, "steps": cut_steps} if link_proxy is not None and cut_at else None
    return summary, records
