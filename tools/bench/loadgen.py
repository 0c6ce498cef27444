"""Multi-robot load generator: SLO violations, goodput and capacity of server-bridge's scheduler.

    python -m tools.bench.loadgen [--n 2,4,8,12,16,24,32] [--policies fcfs,slo] [--pairs smollm2-q4_1,smollm2-q2_k]
                            [--window-s 20] [--warmup-s 5] [--gamma 4] [--draft-ms 8] [--tokens 48]
                            [--classes 8,2,6,4] [--out docs/loadgen]

N simulated robots are real websocket clients (asyncio, one connection each) of a
real server-bridge this tool starts (server_bridge/fleet.py:LocalVerifier), one fresh server per
(pair, N, policy), started with `--scheduler POLICY` when `server-bridge serve` has
that flag. The server is pinned to one core with one torch thread, this process to
another, so robots and verifier do not compete.

A robot does not load a draft model: it replays a trace (tools/train/record_traces.py).
At T = 0 the committed text is the target's greedy continuation, so the draft a
robot would propose after i committed tokens is the recorded chain at position i;
it sleeps gamma x --draft-ms (the draft's measured cost per token on the robot),
sends that chain's first gamma tokens in a `verify`, and commits exactly what the
server's `result` says. Should its text ever leave the recorded path it sends
empty drafts (the server then answers with one target token a round). Each robot
has a speed class (SLO, tokens/s) from --classes, round-robin, and generates
--tokens tokens a generation, then closes and opens the next prompt.

An `error` `overloaded` is the server shedding the robot's request (its fallback
takes over): the generation counts as an SLO violation, the robot backs off
--backoff-s and re-opens with its committed prefix.

Measured over --window-s after --warmup-s; all robots run throughout, and on after
the window (a tail) until every generation opened in it is decided:

  violation   a generation violates its SLO when its speed, tokens / (last result -
              open), is below its class, or it was shed. It is decided when that is
              certain: at its last result, at its deadline open + tokens / class if
              unfinished by then, or when it is shed. The window's sample is the
              generations *opened* in it, each followed to its outcome, so a slow one
              counts as much as a fast one (the tail lasts at most the longest
              deadline, tokens / slowest class); a robot that opened none in the
              window (its generation outlasted it) contributes that generation.
  goodput     committed tokens (results received in the window) / window, all robots.
  capacity    per policy: the largest N of the grid such that at this N and at every
              smaller one the violation rate, overall and of every class, is <= 5 %.
              When even the largest N passes, capacity is that N and marked as a
              lower bound.

Writes loadgen.json (config, every point, capacities), loadgen.md and loadgen.png
into --out, printing a line as each point completes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import random
import re
import shlex
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake

from protocol import wire
from tools.bench import harness

log = logging.getLogger(__name__)

TRACES = Path(__file__).resolve().parents[1] / "traces"
TARGET = "smollm2-f32"
POLICIES = ("fcfs", "slo", "fixed")
CLASSES = (8, 2, 6, 4)  # tokens/s, assigned round-robin: tight and loose mixed at every N
MAX_VIOLATION = 0.05
RECOVERABLE = {"unknown_session", "desync"}  # re-opening with the committed prefix repairs these
MAX_OPEN_TRIES = 50  # per (re-)open; each shed one waits --backoff-s
MAX_CONNECTS = 20  # per robot and point


# --------------------------------------------------------------------------- traces


@dataclass(frozen=True)
class TracePrompt:
    prompt_ids: list[int]  # the chat-templated prompt
    target_ids: list[int]  # [n] the target's greedy continuation
    chains: list[list[int]]  # [n, gamma_max] the draft's greedy chain after prompt + target[:i]


@dataclass(frozen=True)
class Trace:
    draft: str
    target: str
    vocab_hash: str
    vocab_size: int
    eos_ids: list[int]
    gamma_max: int
    prompts: list[TracePrompt]

    @classmethod
    def load(cls, path: str | Path) -> "Trace":
        d = json.loads(Path(path).read_text())
        if d.get("format") != "edgespec-trace/1":
            raise ValueError(
                f"{path}: not an edgespec-trace/1 file (record one with python -m tools.train.record_traces)"
            )
        prompts = [TracePrompt(p["prompt_ids"], p["target_ids"], p["chains"]) for p in d["prompts"]]
        for i, p in enumerate(prompts):
            if len(p.chains) != len(p.target_ids) or any(len(c) != d["gamma_max"] for c in p.chains):
                raise ValueError(f"{path}: prompt {i} needs one chain of {d['gamma_max']} per target token")
        return cls(d["draft"], d["target"], d["vocab_hash"], d["vocab_size"], d["eos_ids"], d["gamma_max"], prompts)


def trace_alpha(trace: Trace) -> float:
    """How often the draft's first token is the target's, over the trace: the planner's alpha."""
    hits = [c[0] == t for p in trace.prompts for c, t in zip(p.chains, p.target_ids, strict=True)]
    return sum(hits) / len(hits)


def planned_gamma(trace: Trace, n: int, cfg: "LoadConfig", estimator: Path) -> tuple[int, dict]:
    """The draft length tools/bench/planner.py chooses for n robots like these (paper 000, Eq. 33 and its DP).

    The robots: cfg.draft_ms per draft token, alpha from the trace, the trace's mean prompt,
    cfg.tokens a generation, on loopback (no uplink time); the verifier: the fitted estimator.
    """
    from tools.bench import planner

    prefix = round(sum(len(p.prompt_ids) for p in trace.prompts) / len(trace.prompts))
    alpha = min(trace_alpha(trace), 0.999)
    devices = tuple(
        planner.Device(
            draft_ms_per_token=cfg.draft_ms,
            alpha=alpha,
            uplink_bits_per_token=0.0,
            prefix_tokens=prefix,
            spectral_efficiency=1.0,
            output_tokens=cfg.tokens,
        )
        for _ in range(n)
    )
    problem = planner.Problem(
        devices,
        total_bandwidth_hz=1e6,
        verify=planner.LinearVerifyModel.load(estimator),
        gammas=tuple(range(1, trace.gamma_max + 1)),
    )
    best = planner.plan(problem)
    return int(best.gammas[0]), {
        "alpha": round(alpha, 4),
        "prefix_tokens": prefix,
        "batches": best.batches,
        "gammas": best.gammas,
        "tokens_per_s": round(best.tokens_per_s, 2),
    }


def next_draft(prompt: TracePrompt, committed: list[int], k: int) -> list[int]:
    """The k draft tokens a robot sends after `committed` (its generated tokens so far).

    On the target's path (committed == target[:n]) the draft after prompt + committed is
    the recorded chain at n. Off it, or past the recording, nothing is known: an empty
    draft, for which the server returns one target token.
    """
    n = len(committed)
    if k <= 0 or n >= len(prompt.chains) or committed != prompt.target_ids[:n]:
        return []
    return prompt.chains[n][:k]


# --------------------------------------------------------------------------- SLO rule and capacity


def judge(
    opened: float, done: float | None, tokens: int, goal: int, slo: float, lost: float | None, now: float
) -> tuple[float | None, bool]:
    """(when the generation's SLO outcome became certain, whether it violated); (None, False) if not yet.

    Violated: lost (shed, or failed: the robot's fallback took over at `lost`), or speed
    tokens / (done - opened) < slo. An unfinished generation is a certain violation once
    even finishing its `goal` tokens now would be too slow, i.e. from its deadline
    opened + goal / slo on; a late one is decided at that deadline.
    """
    deadline = opened + goal / slo
    if lost is not None:
        return min(lost, deadline), True
    if done is not None:
        late = tokens / max(done - opened, 1e-9) < slo
        return (min(deadline, done), True) if late else (done, False)
    return (deadline, True) if now >= deadline else (None, False)


def capacity(passes: dict[int, bool | None]) -> tuple[int | None, bool]:
    """(largest N such that it and every smaller N passed, whether the largest N with data passed).

    passes: N -> whether the point met the SLO bound; None (no data, e.g. no robot of a
    class at that N) neither passes nor breaks the run. 0 when the smallest N fails;
    (None, False) when no N has data.
    """
    cap = None
    for n in sorted(passes):
        if passes[n] is None:
            continue
        if not passes[n]:
            return cap or 0, False
        cap = n
    return cap, cap is not None


def point_passes(rate: float | None, by_class: dict[str, float | None], limit: float = MAX_VIOLATION) -> bool:
    """Overall and every class with data at or below `limit`; a point without decided generations fails."""
    return rate is not None and rate <= limit and all(r <= limit for r in by_class.values() if r is not None)


def capacity_search(
    run: Callable[[int], dict],
    classes: list[str],
    ns: tuple = (),
    start: int = 1,
    max_n: int = 256,
    refine: float = 0.1,
) -> dict:
    """The largest N each class holds, running as few points as it can.

    run(n) -> {class: passed (bool, or None without data)} for a fleet of n. With `ns`: those
    sizes in order, stopping once every class has failed. Otherwise N doubles from `start` until
    every class has failed above its capacity or max_n is reached; then, per class, bisection
    between its capacity and the next failing N until the gap is <= max(1, refine x capacity).
    Capacity is loadgen's: the largest N that passed with every smaller N tried (0: the smallest
    failed); lower_bound when every N tried passed.
    """
    seen: dict[int, dict] = {}

    def at(n: int) -> None:
        if n not in seen:
            seen[n] = run(n)

    def cap(c: str) -> tuple[int, bool]:
        got, held = capacity({n: r.get(c) for n, r in seen.items()})
        return got or 0, held

    def failed_above(c: str) -> int | None:
        lo = cap(c)[0]
        return min((n for n, r in seen.items() if r.get(c) is False and n > lo), default=None)

    if ns:
        for n in ns:
            at(n)
            if all(failed_above(c) is not None for c in classes):
                break
    else:
        n = max(1, min(start, max_n))
        while True:
            at(n)
            if n >= max_n or all(failed_above(c) is not None for c in classes):
                break
            n = min(2 * n, max_n)
        for c in classes:
            while (hi := failed_above(c)) is not None:
                lo = cap(c)[0]
                mid = (lo + hi) // 2
                if hi - lo <= max(1, int(refine * lo)) or mid <= lo or mid in seen:
                    break
                at(mid)
    return {c: {"capacity": cap(c)[0], "lower_bound": cap(c)[1], "tried": sorted(seen)} for c in classes}


# --------------------------------------------------------------------------- /metrics

_LABEL_VALUE = r'"(?:[^"\\]|\\.)*"'
_METRIC = re.compile(r"^(bridge_[A-Za-z0-9_:]*)(\{(?:[^}\"]|" + _LABEL_VALUE + r")*\})?\s+(\S+)(\s+-?\d+)?\s*$")
_LABEL = re.compile(r"\s*([A-Za-z_][A-Za-z0-9_]*)\s*=\s*(" + _LABEL_VALUE + r")\s*,?")


def _without_replica(labels: str) -> str:
    """'{code="x",replica="r1"}' -> '{code="x"}', '{replica="r1"}' -> '': the page is one replica's (every
    server-bridge sample carries its `replica` label), so the keys stay those of any replica."""
    kept = [f"{k}={v}" for k, v in _LABEL.findall(labels[1:-1]) if k != "replica"]
    return "{" + ",".join(kept) + "}" if kept else ""


def parse_metrics(text: str) -> dict[str, float]:
    """Every `bridge_*` sample of one replica's Prometheus text page: 'name{labels}' -> value, the labels
    as the page writes them less `replica` (e.g. 'bridge_errors_total{code="overloaded"}')."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = _METRIC.match(line.strip())
        if m is None:
            continue
        try:
            out[m.group(1) + _without_replica(m.group(2) or "{}")] = float(m.group(3))
        except ValueError:
            continue
    return out


def _is_counter(key: str) -> bool:
    name = key.split("{", 1)[0]
    return name.endswith(("_total", "_sum", "_count", "_bucket"))


def metrics_delta(start: dict[str, float], end: dict[str, float]) -> dict[str, float]:
    """What the window added: end - start for counters (and histogram/summary parts), end for gauges."""
    return {k: v - start.get(k, 0.0) if _is_counter(k) else v for k, v in end.items()}


def metric_means(delta: dict[str, float]) -> dict[str, float]:
    """X_sum / X_count over the window for every histogram or summary X (e.g. a batch size)."""
    out = {}
    for key, total in delta.items():
        name, brace, labels = key.partition("{")
        if name.endswith("_sum"):
            count = delta.get(name[:-4] + "_count" + brace + labels)
            if count:
                out[name[:-4] + brace + labels] = total / count
    return out


# --------------------------------------------------------------------------- one point: N robots


@dataclass(frozen=True)
class LoadConfig:
    gamma: int = 4  # draft tokens per round (<= the trace's gamma_max)
    draft_ms: float = 8.0  # emulated drafting cost per token on the robot (Q4_1, 2 threads)
    tokens: int = 48  # tokens per generation (fewer when the target ends first)
    classes: tuple = CLASSES  # SLO classes in tokens/s, round-robin over robots
    warmup_s: float = 5.0
    window_s: float = 20.0
    backoff_s: float = 0.2  # after a shed, before re-opening
    recv_timeout_s: float = 60.0  # a reply slower than this ends the generation with an error
    stagger_s: float = 0.5  # robots start at random offsets in [0, stagger_s)
    seed: int = 0

    def __post_init__(self) -> None:
        if not 1 <= self.gamma <= 256:
            raise ValueError(f"gamma must be 1-256, got {self.gamma}")
        if self.tokens < 1 or self.window_s <= 0 or self.warmup_s < 0 or self.draft_ms < 0 or self.backoff_s < 0:
            raise ValueError("tokens >= 1, window_s > 0, warmup_s >= 0, draft_ms >= 0 and backoff_s >= 0")
        if not self.classes or any(c <= 0 for c in self.classes):
            raise ValueError(f"classes must be positive tokens/s, got {self.classes}")


@dataclass
class Generation:
    """One robot's response to one prompt."""

    robot: int
    slo: float  # its class, tokens/s
    prompt: int  # index in the trace
    goal: int  # tokens it is to produce
    opened: float  # monotonic: when its first `open` was sent
    tokens: list[int] = field(default_factory=list)  # committed, as the server said
    done: float | None = None  # when the result with its last token arrived
    shed: float | None = None  # the first `overloaded`
    failed: float | None = None  # when an error ended it (the robot's fallback took over)
    sheds: int = 0
    reopens: int = 0  # re-opens for unknown_session / desync (not sheds)
    rounds: int = 0
    error: str | None = None  # anything else that ended it early


@dataclass
class PointLog:
    """Everything the robots of one point saw, with monotonic timestamps."""

    generations: list[Generation] = field(default_factory=list)
    rounds: list[tuple[float, float, int]] = field(default_factory=list)  # (result at, latency ms, committed)
    sheds: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    stale: int = 0  # replies for a round or session no longer waited for
    window: tuple[float, float] = (0.0, 0.0)
    ended: float = 0.0  # when the robots were told to halt (every window generation decided)
    metrics: dict = field(default_factory=dict)  # "start" / "end": parse_metrics of /metrics


class RobotError(RuntimeError):
    pass


class Robot:
    """One simulated robot: a connection, and generations back to back until `halt` is set."""

    def __init__(self, idx: int, url: str, trace: Trace, cfg: LoadConfig, out: PointLog, halt: asyncio.Event):
        self.idx = idx
        self.url = url
        self.trace = trace
        self.cfg = cfg
        self.out = out
        self.halt = halt
        self.slo = cfg.classes[idx % len(cfg.classes)]
        self.eos = set(trace.eos_ids)
        self.ws: ClientConnection | None = None

    async def run(self) -> None:
        await asyncio.sleep(random.Random(self.cfg.seed * 7919 + self.idx).uniform(0, self.cfg.stagger_s))
        g = 0
        for _ in range(MAX_CONNECTS):  # a lost connection ends its generation; the robot reconnects
            if self.halt.is_set():
                return
            try:
                async with connect(
                    self.url,
                    open_timeout=10,
                    close_timeout=1,
                    ping_interval=None,
                    max_size=2 * wire.DEFAULT_MAX_FRAME_BYTES,
                    compression=None,
                    additional_headers={"X-Robot-Id": f"loadgen-{self.idx}"},
                ) as ws:
                    self.ws = ws
                    await self.handshake()
                    while not self.halt.is_set():
                        g += 1
                        await self.generate(g - 1)
                    return
            except (OSError, ConnectionClosed, InvalidHandshake, TimeoutError, RobotError) as e:
                self.out.errors.append(f"robot {self.idx}: {type(e).__name__}: {e}")
                await asyncio.sleep(0.5)
            finally:
                self.ws = None

    async def handshake(self) -> None:
        await self.send(
            wire.Hello(
                token="",
                client=f"loadgen/robot{self.idx}",
                draft_vocab_hash=self.trace.vocab_hash,
                vocab_size=self.trace.vocab_size,
            )
        )
        reply = await self.recv(wire.Welcome, None)
        if isinstance(reply, wire.Error):
            raise RobotError(f"handshake refused: {reply.code}: {reply.message}")

    async def generate(self, g: int) -> None:
        prompt_no = (self.idx + g) % len(self.trace.prompts)
        prompt = self.trace.prompts[prompt_no]
        sid = f"r{self.idx}-g{g}"
        gen = Generation(self.idx, self.slo, prompt_no, min(self.cfg.tokens, len(prompt.target_ids)), time.monotonic())
        self.out.generations.append(gen)
        try:
            await self.rounds(sid, prompt, gen)
        except (ConnectionClosed, OSError, TimeoutError, RobotError) as e:
            gen.error, gen.failed = f"{type(e).__name__}: {e}", time.monotonic()
            raise
        await self.send(wire.Close(sid))

    async def rounds(self, sid: str, prompt: TracePrompt, gen: Generation) -> None:
        """Open, then verify rounds until the goal, an EOS or the end of the run."""
        await self.open(sid, prompt, gen)
        for rnd in range(4 * gen.goal + 64):  # >= goal rounds even on empty drafts, plus re-opens
            if len(gen.tokens) >= gen.goal or self.halt.is_set():
                return
            draft = next_draft(prompt, gen.tokens, min(self.cfg.gamma, gen.goal - len(gen.tokens) - 1))
            await asyncio.sleep(len(draft) * self.cfg.draft_ms / 1e3)  # the robot drafting
            t0 = time.monotonic()
            await self.send(wire.Verify(sid, rnd, len(prompt.prompt_ids) + len(gen.tokens), draft, {"kind": "none"}))
            reply = await self.recv(wire.Result, sid, rnd)
            if isinstance(reply, wire.Error):
                await self.recover(reply, sid, prompt, gen)
                continue
            t1 = time.monotonic()
            commit = draft[: reply.accepted] + [reply.token]
            gen.tokens += commit
            gen.rounds += 1
            self.out.rounds.append((t1, (t1 - t0) * 1e3, len(commit)))
            if len(gen.tokens) >= gen.goal or reply.token in self.eos:
                gen.done = t1
                return
            if reply.n_committed != len(prompt.prompt_ids) + len(gen.tokens):
                gen.reopens += 1  # the server disagrees: the committed prefix decides
                await self.open(sid, prompt, gen)
        raise RobotError(f"{sid}: no end after {4 * gen.goal + 64} rounds")

    async def open(self, sid: str, prompt: TracePrompt, gen: Generation) -> None:
        """(Re-)open with the committed prefix; a shed open backs off and tries again."""
        for _ in range(MAX_OPEN_TRIES):
            await self.send(
                wire.Open(
                    sid,
                    prompt.prompt_ids + gen.tokens,
                    {"temperature": 0.0, "top_k": 0, "seed": 0},
                    slo={"tokens_per_s": self.slo},
                    payload={"kind": "none", "k": 0},
                )
            )
            reply = await self.recv(wire.Opened, sid)
            if isinstance(reply, wire.Opened):
                return
            if reply.code != "overloaded":
                raise RobotError(f"open refused: {reply.code}: {reply.message}")
            self.note_shed(gen)
            await asyncio.sleep(self.cfg.backoff_s)
            if self.halt.is_set():
                return  # the run is over: `rounds` ends without a round
        raise RobotError(f"{sid}: open shed {MAX_OPEN_TRIES} times in a row")

    async def recover(self, err: wire.Error, sid: str, prompt: TracePrompt, gen: Generation) -> None:
        """After an `error` on a round: a shed backs off; either way the session is re-opened."""
        if err.code == "overloaded":
            self.note_shed(gen)
            await asyncio.sleep(self.cfg.backoff_s)
        elif err.code in RECOVERABLE:
            gen.reopens += 1
        else:
            raise RobotError(f"verify refused: {err.code}: {err.message}")
        await self.open(sid, prompt, gen)

    def note_shed(self, gen: Generation) -> None:
        now = time.monotonic()
        gen.sheds += 1
        gen.shed = gen.shed if gen.shed is not None else now
        self.out.sheds.append(now)

    async def send(self, msg: wire.Message) -> None:
        await self.ws.send(wire.encode(msg))

    async def recv(self, want: type, sid: str | None, rnd: int | None = None) -> wire.Message:
        """The reply to the request just sent: a `want` of this session (and round), or an `error` for it.

        Anything else is a late answer to an earlier request: counted in `stale` and skipped.
        """
        deadline = time.monotonic() + self.cfg.recv_timeout_s
        while True:
            frame = await asyncio.wait_for(self.ws.recv(), max(0.0, deadline - time.monotonic()))
            try:
                msg = wire.decode(frame, 2 * wire.DEFAULT_MAX_FRAME_BYTES)
            except wire.WireError as e:
                raise RobotError(f"undecodable message from the server: {e}") from None
            mine = getattr(msg, "sid", None) == sid
            if isinstance(msg, wire.Error) and (mine or msg.sid is None):
                return msg
            if isinstance(msg, want) and (sid is None or mine) and (rnd is None or msg.round == rnd):
                return msg
            self.out.stale += 1


def fetch_metrics(port: int) -> dict[str, float]:
    try:
        return parse_metrics(urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode())
    except OSError as e:
        log.warning("GET /metrics failed: %s", e)
        return {}


def sample(gens: list[Generation], window: tuple[float, float]) -> list[bool]:
    """Which generations the window's figures count (each followed to its outcome).

    Those opened in the window; and a robot that opened none there (its one generation
    outlasted the window: overload) contributes the generation it spent the window in,
    so an overloaded point is not left without data.
    """
    start, stop = window
    chosen = [start <= g.opened < stop for g in gens]
    covered = {g.robot for g, c in zip(gens, chosen, strict=True) if c}
    for i, g in enumerate(gens):
        if g.robot not in covered and g.opened < start and (g.done is None or g.done >= stop):
            chosen[i] = True
    return chosen


def outcome(g: Generation, now: float) -> tuple[float | None, bool]:
    """judge() of one generation as of `now`."""
    lost = min((t for t in (g.shed, g.failed) if t is not None), default=None)
    return judge(g.opened, g.done, len(g.tokens), g.goal, g.slo, lost, now)


def decided(g: Generation, now: float) -> bool:
    return outcome(g, now)[0] is not None


async def run_robots(
    url: str,
    trace: Trace,
    n: int,
    cfg: LoadConfig,
    metrics_port: int | None = None,
    robot: Callable[..., Any] = Robot,
    grace_s: float | None = None,
) -> PointLog:
    """N robots against `url`: warm-up, window, then a tail until every generation opened in the window
    is decided (the load unchanged meanwhile; at most the longest deadline). Bounded in time.

    robot(idx, url, trace, cfg, out, halt) makes one (Robot, or tools/bench/peer.py's PeerRobot); after
    the tail each gets grace_s to finish its request in flight (None: the reply timeout + 5 s, and one
    still running then is an error), then is cancelled."""
    out = PointLog()
    halt = asyncio.Event()
    t0 = time.monotonic()
    start, stop = t0 + cfg.warmup_s, t0 + cfg.warmup_s + cfg.window_s
    out.window = (start, stop)
    robots = [asyncio.create_task(robot(i, url, trace, cfg, out, halt).run(), name=f"robot-{i}") for i in range(n)]
    await asyncio.sleep(max(0.0, start - time.monotonic()))
    if metrics_port is not None:
        out.metrics["start"] = await asyncio.to_thread(fetch_metrics, metrics_port)
        out.metrics["start_at"] = time.monotonic() - start
    await asyncio.sleep(max(0.0, stop - time.monotonic()))
    if metrics_port is not None:
        out.metrics["end"] = await asyncio.to_thread(fetch_metrics, metrics_port)
        out.metrics["end_at"] = time.monotonic() - start
    tail_end = stop + cfg.tokens / min(cfg.classes) + 1.0  # every deadline of the window has passed by then
    while time.monotonic() < tail_end and any(
        c and not decided(g, time.monotonic())
        for g, c in zip(out.generations, sample(out.generations, out.window), strict=True)
    ):
        await asyncio.sleep(0.05)
    out.ended = time.monotonic()
    halt.set()
    # robots end once their round in flight is answered; a slower one is cancelled
    done, pending = await asyncio.wait(robots, timeout=cfg.recv_timeout_s + 5 if grace_s is None else grace_s)
    for task in pending:
        task.cancel()
        if grace_s is None:
            out.errors.append(f"{task.get_name()}: still running {cfg.recv_timeout_s + 5:.0f}s after the run")
    await asyncio.gather(*pending, return_exceptions=True)
    for task in done:
        if task.exception() is not None:
            out.errors.append(f"{task.get_name()}: {type(task.exception()).__name__}: {task.exception()}")
    return out


# --------------------------------------------------------------------------- one point: summary


def exact(gen: Generation, trace: Trace) -> bool:
    """Greedy equivalence: what the robot committed is the target's own continuation."""
    return gen.tokens == trace.prompts[gen.prompt].target_ids[: len(gen.tokens)]


def diverged_at(gen: Generation, trace: Trace) -> int | None:
    """The first position where the robot's ids leave the target's recorded continuation, if any."""
    ref = trace.prompts[gen.prompt].target_ids
    return next((i for i, (a, b) in enumerate(zip(gen.tokens, ref, strict=False)) if a != b), None)


NEAR_TIE = 0.1  # logits: ~3x the llamacpp engine's rounding noise between batch shapes (tools/bench/divergence.py)
_solo_target = None


def near_ties(point: dict, gens: list[Generation], trace: Trace, bound: float = NEAR_TIE) -> None:
    """At each divergence from the trace: the target's top-2 margin there, in a one-token pass of its own.

    Under load a session's rows are computed in batches of changing shapes, which round
    differently from the solo passes that recorded the trace. A divergence is a near-tie when
    the recorded id and the robot's are the target's top two there and their logits are within
    `bound`; anything else is an exactness failure. Fills each diverged record's `divergence`
    and the point's `near_ties` (the count) and `exact_up_to_near_ties`.
    """
    global _solo_target
    from tools.logit_margin import top2

    point["near_ties"], point["exact_up_to_near_ties"] = 0, True
    for rec, g in zip(point["generation_records"], gens, strict=True):
        at = None if rec["exact"] else diverged_at(g, trace)
        if at is None:
            continue
        if _solo_target is None:
            from server_bridge.target import load_target

            _solo_target = load_target(trace.target, threads=1, max_sequences=2, kv_tokens=4096)
        p = trace.prompts[g.prompt]
        state = _solo_target.new_state(p.prompt_ids + p.target_ids[:at])
        best, second, _, margin = top2(np.asarray(_solo_target.score(state, [])[0], np.float64))
        tie = {p.target_ids[at], g.tokens[at]} == {best, second} and margin <= bound
        rec["divergence"] = {
            "at": at,
            "trace_id": p.target_ids[at],
            "robot_id": g.tokens[at],
            "margin": round(margin, 5),
            "near_tie": tie,
        }
        point["near_ties"] += tie
        point["exact_up_to_near_ties"] &= tie


def record(g: Generation, trace: Trace, chosen: bool, now: float) -> dict:
    """One generation for the JSON; in_sample: chosen by `sample` and decided by `now`."""
    at, bad = outcome(g, now)
    speed = len(g.tokens) / (g.done - g.opened) if g.done is not None else None
    return {
        "robot": g.robot,
        "slo": g.slo,
        "prompt": g.prompt,
        "tokens": len(g.tokens),
        "goal": g.goal,
        "wall_s": None if g.done is None else round(g.done - g.opened, 4),
        "tokens_per_s": None if speed is None else round(speed, 3),
        "rounds": g.rounds,
        "sheds": g.sheds,
        "reopens": g.reopens,
        "error": g.error,
        "in_sample": chosen and at is not None,
        "violated": bad if at is not None else None,
        "exact": exact(g, trace),
    }


def summarize(out: PointLog, trace: Trace, classes: tuple) -> dict:
    """The point's figures over its window (see the module docstring for the rules)."""
    start, stop = out.window
    span = stop - start
    per_class = {str(c): {"decided": 0, "violated": 0, "speeds": []} for c in classes}
    chosen = sample(out.generations, out.window)
    gens = [record(g, trace, c, max(out.ended, stop)) for g, c in zip(out.generations, chosen, strict=True)]
    undecided = sum(c and r["violated"] is None for c, r in zip(chosen, gens, strict=True))
    for r in gens:
        if r["in_sample"]:
            c = per_class[str(r["slo"])]
            c["decided"] += 1
            c["violated"] += r["violated"]
            if r["tokens_per_s"] is not None:
                c["speeds"].append(r["tokens_per_s"])
    rounds = [r for r in out.rounds if start <= r[0] <= stop]
    lat = np.array([r[1] for r in rounds])
    decided = sum(c["decided"] for c in per_class.values())
    violated = sum(c["violated"] for c in per_class.values())
    met_tokens = sum(g["tokens"] for g in gens if g["in_sample"] and not g["violated"])
    by_class = {c: (v["violated"] / v["decided"] if v["decided"] else None) for c, v in per_class.items()}
    return {
        "violation_rate": violated / decided if decided else None,
        "violation_rate_by_class": by_class,
        "decided": decided,
        "violations": violated,
        "undecided": undecided,
        "decided_by_class": {c: v["decided"] for c, v in per_class.items()},
        "speed_by_class": {c: (float(np.mean(v["speeds"])) if v["speeds"] else None) for c, v in per_class.items()},
        "goodput_tokens_per_s": sum(r[2] for r in rounds) / span,
        "slo_met_tokens_per_s": met_tokens / span,
        "rounds": len(rounds),
        "tokens_per_round": sum(r[2] for r in rounds) / len(rounds) if rounds else None,
        "round_ms_mean": float(lat.mean()) if lat.size else None,
        "round_ms_p95": float(np.percentile(lat, 95)) if lat.size else None,
        "sheds": sum(start <= t <= stop for t in out.sheds),
        "tail_s": max(0.0, out.ended - stop),
        "generations": len(out.generations),
        "errors": out.errors,
        "stale": out.stale,
        "exact": all(g["exact"] for g in gens),
        "passes": point_passes(violated / decided if decided else None, by_class),
        "generation_records": gens,
    }


def server_figures(metrics: dict) -> dict:
    """/metrics at the end of the window, what the window added, and its histogram means.

    start_at / end_at: when each page was read, seconds after the window opened.
    """
    start, end = metrics.get("start", {}), metrics.get("end", {})
    delta = metrics_delta(start, end) if end else {}
    return {
        "end": end,
        "delta": delta,
        "means": metric_means(delta),
        "start_at": metrics.get("start_at"),
        "end_at": metrics.get("end_at"),
    }


# --------------------------------------------------------------------------- the sweep


def scheduler_flag_available() -> bool:
    """Whether `server-bridge serve` takes --scheduler (it is new; older servers run their one policy)."""
    try:
        r = subprocess.run(
            [sys.executable, "-m", "server_bridge.cli", "serve", "--help"], capture_output=True, text=True, timeout=120
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return "--scheduler" in r.stdout


def server_config(log_text: str) -> dict | None:
    """The config the server logged at start ("config in use: {json}"), saved beside its figures."""
    for line in log_text.splitlines():
        _, sep, rest = line.partition("config in use: ")
        if sep:
            try:
                return json.loads(rest)
            except ValueError:
                return None
    return None


def run_point(
    trace: Trace,
    n: int,
    policy: str,
    cfg: LoadConfig,
    server_cpus: set[int] | None,
    server_threads: int,
    server_args: list[str],
    use_flag: bool,
    keep_tokens: bool = False,
) -> dict:
    """A fresh server-bridge with `policy`, N robots against it; the point's summary."""
    from server_bridge.fleet import LocalVerifier

    extra = (["--scheduler", policy] if use_flag else []) + server_args
    t0 = time.perf_counter()
    with LocalVerifier(target=trace.target, cpus=server_cpus, threads=server_threads, extra_args=extra) as server:
        started = time.perf_counter() - t0
        out = asyncio.run(run_robots(server.url, trace, n, cfg, metrics_port=server.port))
        tail = server.log_tail(8) if out.errors else None
    log_text = server.log_path.read_text(errors="replace")
    server.log_path.unlink(missing_ok=True)
    point = {
        "pair": trace.draft,
        "target": trace.target,
        "policy": policy,
        "n": n,
        "scheduler_flag": use_flag,
        "server_start_s": round(started, 2),
        **summarize(out, trace, cfg.classes),
        "server_metrics": server_figures(out.metrics),
        "server_config": server_config(log_text),
    }
    near_ties(point, out.generations, trace)
    if tail:
        point["server_log_tail"] = tail
    if keep_tokens:  # every generation, with its ids
        for rec, g in zip(point["generation_records"], out.generations, strict=True):
            rec["token_ids"] = g.tokens
    else:  # the window's sample only: the JSON stays small
        point["generation_records"] = [r for r in point["generation_records"] if r["in_sample"] or "divergence" in r]
    return point


def describe(p: dict, classes: tuple) -> str:
    pct = lambda r: "  -  " if r is None else f"{100 * r:4.0f}%"  # noqa: E731
    by = " ".join(f"{c}:{pct(p['violation_rate_by_class'][str(c)]).strip()}" for c in sorted(classes))
    lat = "-" if p["round_ms_mean"] is None else f"{p['round_ms_mean']:.0f}/{p['round_ms_p95']:.0f}"
    flags = (
        ""
        if p["exact"]
        else f"  near-ties only ({p['near_ties']})"
        if p.get("exact_up_to_near_ties")
        else "  NOT EXACT"
    ) + (f"  errors {len(p['errors'])}" if p["errors"] else "")
    if p["decided"] < p["n"]:
        flags += "  (fewer decided generations than robots: raise --window-s)"
    return (
        f"{p['pair']} {p['policy']:<5} N={p['n']:<3} violations {pct(p['violation_rate'])} ({by}) of "
        f"{p['decided']}  goodput {p['goodput_tokens_per_s']:5.1f} tok/s  rounds {p['rounds']}  "
        f"shed {p['sheds']}  round ms mean/p95 {lat}{flags}"
    )


def capacities(points: list[dict], classes: tuple) -> dict:
    """pair -> policy -> capacity overall and per class; pair -> slo/fcfs ratios."""
    out: dict = {}
    for pair in dict.fromkeys(p["pair"] for p in points):
        out[pair] = {"policies": {}, "ratio_slo_over_fcfs": {}}
        for policy in dict.fromkeys(p["policy"] for p in points if p["pair"] == pair):
            sel = {p["n"]: p for p in points if p["pair"] == pair and p["policy"] == policy}
            cap, capped = capacity({n: p["passes"] for n, p in sel.items()})
            by_class = {}
            for c in classes:
                rates = {n: p["violation_rate_by_class"][str(c)] for n, p in sel.items()}
                by_class[str(c)] = capacity({n: None if r is None else r <= MAX_VIOLATION for n, r in rates.items()})
            out[pair]["policies"][policy] = {
                "capacity": cap,
                "lower_bound": capped,
                "by_class": {c: v[0] for c, v in by_class.items()},
                "by_class_lower_bound": {c: v[1] for c, v in by_class.items()},
            }
        pol = out[pair]["policies"]
        if "slo" in pol and "fcfs" in pol:
            out[pair]["ratio_slo_over_fcfs"] = {
                "overall": _ratio(pol["slo"]["capacity"], pol["fcfs"]["capacity"]),
                **{
                    f"class_{c}": _ratio(pol["slo"]["by_class"][str(c)], pol["fcfs"]["by_class"][str(c)])
                    for c in classes
                },
            }
    return out


def _ratio(a: int | None, b: int | None) -> float | None:
    """a / b; None where either has no data or b is 0 (fcfs fails at the smallest N)."""
    return None if a is None or not b else a / b


def sweep(args, cfg: LoadConfig) -> dict:
    traces = {pair: Trace.load(Path(args.traces) / f"{pair}__{args.target}.json") for pair in args.pairs}
    for t in traces.values():
        if args.gamma != "plan" and cfg.gamma > t.gamma_max:
            raise SystemExit(f"--gamma {cfg.gamma} exceeds the trace's recorded chains of {t.gamma_max}")
    use_flag = scheduler_flag_available() if args.scheduler_flag == "auto" else args.scheduler_flag == "yes"
    cpus = sorted(os.sched_getaffinity(0))
    client_cpus = {args.client_cpu} if args.client_cpu in cpus else set(cpus)
    server_cpus = {args.server_cpu} if args.server_cpu in cpus and args.server_cpu != args.client_cpu else None
    config = {
        **asdict(cfg),
        "gamma": args.gamma,
        "ns": args.n,
        "policies": args.policies,
        "pairs": args.pairs,
        "target": args.target,
        "scheduler_flag": use_flag,
        "server_args": args.server_args,
        "server_cpus": sorted(server_cpus or []),
        "server_threads": args.server_threads,
        "client_cpus": sorted(client_cpus),
        "cpu_count": os.cpu_count(),
        "max_violation": MAX_VIOLATION,
        "traces": {p: str(Path(args.traces) / f"{p}__{args.target}.json") for p in args.pairs},
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    print(
        f"loadgen: pairs {args.pairs} x N {args.n} x policies {args.policies}; window {cfg.window_s}s after "
        f"{cfg.warmup_s}s warm-up, gamma {cfg.gamma}, {cfg.draft_ms} ms/draft token, {cfg.tokens} tokens a "
        f"generation, classes {list(cfg.classes)} tok/s; server on cores {config['server_cpus'] or 'any'} "
        f"({args.server_threads} thread), robots on {sorted(client_cpus)}",
        flush=True,
    )
    if not use_flag:
        print(
            "loadgen: `server-bridge serve` has no --scheduler flag here: every policy runs the server's one "
            "scheduler (the points are labelled by policy all the same)",
            flush=True,
        )
    points = []
    total, step = len(args.pairs) * len(args.n) * len(args.policies), 0
    every_cpu = os.sched_getaffinity(0)
    os.sched_setaffinity(0, client_cpus)
    try:
        for pair in args.pairs:
            for n in args.n:
                point_cfg, plan = cfg, None
                if args.gamma == "plan":
                    gamma, plan = planned_gamma(traces[pair], n, cfg, Path(args.estimator))
                    point_cfg = replace(cfg, gamma=gamma)
                    print(f"  planner: gamma {gamma} for {n} robots of {pair} ({plan})", flush=True)
                for policy in args.policies:
                    step += 1
                    p = run_point(
                        traces[pair],
                        n,
                        policy,
                        point_cfg,
                        server_cpus,
                        args.server_threads,
                        shlex.split(args.server_args),
                        use_flag,
                        args.keep_tokens,
                    )
                    p["gamma"], p["plan"] = point_cfg.gamma, plan
                    points.append(p)
                    print(f"[{step}/{total}] {describe(p, cfg.classes)}", flush=True)
    finally:
        os.sched_setaffinity(0, every_cpu)
    config["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
    return {"config": config, "points": points, "capacities": capacities(points, cfg.classes)}


# --------------------------------------------------------------------------- report and CLI


def _cap(c: int | None, lower_bound: bool, ns: list[int]) -> str:
    if c is None:
        return "-"
    if c == 0:
        return f"< {min(ns)}"
    return f">= {c}" if lower_bound else str(c)


def capacity_rows(result: dict) -> list[dict]:
    """The capacity table: per pair and policy, the capacity overall and per class as written."""
    cfg = result["config"]
    return [
        {
            "pair": pair,
            "policy": policy,
            "all": _cap(c["capacity"], c["lower_bound"], cfg["ns"]),
            **{
                str(k): _cap(c["by_class"][str(k)], c["by_class_lower_bound"][str(k)], cfg["ns"])
                for k in cfg["classes"]
            },
        }
        for pair, caps in result["capacities"].items()
        for policy, c in caps["policies"].items()
    ]


def _intro(result: dict) -> str:
    cfg = result["config"]
    return (
        f"{len(cfg['pairs'])} pair(s) x N in {cfg['ns']} x policies {cfg['policies']}; target {cfg['target']}. "
        f"Each robot replays a recorded trace at T = 0 (gamma {cfg['gamma']}, {cfg['draft_ms']} ms drafting per "
        f"token emulated, {cfg['tokens']} tokens a generation) with SLO class "
        f"{', '.join(str(c) for c in cfg['classes'])} tok/s round-robin. Window {cfg['window_s']} s after "
        f"{cfg['warmup_s']} s warm-up; a fresh server per point on cores {cfg['server_cpus'] or 'any'} "
        f"({cfg['server_threads']} torch thread), robots on {cfg['client_cpus']}. "
        + (
            ""
            if cfg["scheduler_flag"]
            else "**The server had no --scheduler flag: every policy ran the same scheduler.** "
        )
        + f"Started {cfg['started']}.\n\n"
        "A generation violates its SLO when tokens / (last result - open) < its class, or it was shed; the "
        "sample is the generations opened in the window, each followed to its outcome. Goodput: tokens "
        "committed in the window / window (all robots); SLO-met: the tokens of the sample's generations that "
        "met their class / window. "
        f"Capacity: the largest N with every N up to it at <= {100 * cfg['max_violation']:.0f} % violations, "
        "overall and per class; '-' where no robot of a class ran, or no generation opened in the window "
        "(a point without any fails)."
    )


def _ratios(result: dict) -> list[str]:
    """A line per pair: slo's capacity against fcfs's, overall and for the tightest class."""
    cfg, out = result["config"], []
    tight = str(max(cfg["classes"]))
    for pair, caps in result["capacities"].items():
        r, pol = caps["ratio_slo_over_fcfs"], caps["policies"]
        if r:

            def cap(p: str, c: str | None = None, pol: dict = pol) -> str:
                key = "" if c is None else "by_class_"
                got = pol[p]["capacity"] if c is None else pol[p]["by_class"][c]
                return _cap(
                    got, pol[p][key + "lower_bound"] if c is None else pol[p][key + "lower_bound"][c], cfg["ns"]
                )

            ratio = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
            out.append(
                f"- {pair}: capacity slo {cap('slo')} vs fcfs {cap('fcfs')} robots, ratio {ratio(r['overall'])}; "
                f"tightest class ({tight} tok/s): slo {cap('slo', tight)} vs fcfs {cap('fcfs', tight)}, ratio "
                f"{ratio(r[f'class_{tight}'])}"
            )
    return out


def _exactness(p: dict) -> str:
    if p["exact"]:
        return "yes"
    return f"near-ties only ({p['near_ties']})" if p.get("exact_up_to_near_ties") else "**no**"


def _point_cols(result: dict) -> list[harness.Col]:
    cfg = result["config"]
    classes = sorted(cfg["classes"])
    means = lambda m: ", ".join(f"{k.removeprefix('bridge_')} {v:.2f}" for k, v in m.items()) or "-"  # noqa: E731
    return [
        harness.Col("n", "N"),
        harness.Col("policy"),
        *([harness.Col("gamma")] if cfg["gamma"] == "plan" else []),
        harness.Col("violation_rate", "violations", harness.pct),
        *[harness.Col(f"violation_rate_by_class.{c}", f"{c} tok/s", harness.pct) for c in classes],
        harness.Col("decided"),
        harness.Col("goodput_tokens_per_s", "goodput tok/s", "{:.1f}"),
        harness.Col("slo_met_tokens_per_s", "SLO-met tok/s", "{:.1f}"),
        harness.Col("tokens_per_round", "tokens/round", "{:.2f}"),
        harness.Col("round_ms_mean", "round ms mean", "{:.0f}"),
        harness.Col("round_ms_p95", "p95", "{:.0f}"),
        harness.Col("sheds", "shed"),
        harness.Col("server_metrics.means", "server means", means),
        harness.Col("exactness", "exact"),
    ]


REPORT = harness.Report(
    "loadgen",
    "# Multi-robot load: SLO violations, goodput and capacity",
    [
        harness.Table("points", _point_cols, "## {pair} -> {target}", facet="pair"),
        harness.Table(
            "capacity",
            lambda result: [
                harness.Col("pair"),
                harness.Col("policy"),
                harness.Col("all", "capacity (all classes)"),
                *[harness.Col(str(c), f"{c} tok/s") for c in sorted(result["config"]["classes"])],
            ],
            "## Capacity",
        ),
    ],
    [
        harness.Plot(
            "points",
            x="n",
            ys=lambda r: {
                "all": "violation_rate",
                f"{max(r['config']['classes'])} tok/s": f"violation_rate_by_class.{max(r['config']['classes'])}",
            },
            group="policy",
            facet="pair",
            xlabel="robots (N)",
            ylabel="SLO violation rate",
            title="{pair}: violations",
            ylim=(-0.02, 1.02),
            hline=MAX_VIOLATION,
        ),
        harness.Plot(
            "points",
            x="n",
            ys={"": "goodput_tokens_per_s"},
            group="policy",
            facet="pair",
            xlabel="robots (N)",
            ylabel="committed tokens / s (all robots)",
            title="{pair}: goodput",
        ),
    ],
    intro=_intro,
    extra=_ratios,
)


def _gamma(s: str) -> int | str:
    return s if s == "plan" else int(s)


def _classes(s: str) -> tuple:
    return tuple(int(x) if float(x).is_integer() else float(x) for x in s.split(",") if x)


def _policies(s: str) -> list[str]:
    names = harness.names(s)
    if not names or any(x not in POLICIES for x in names):
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of {', '.join(POLICIES)}")
    return names


def add_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--n", type=harness.ints, default=[2, 4, 8, 12, 16, 24, 32], help="robot counts")
    ap.add_argument("--policies", type=_policies, default=["fcfs", "slo"])
    ap.add_argument("--pairs", type=harness.names, default=["smollm2-q4_1", "smollm2-q2_k"], help="drafts (traces)")
    ap.add_argument("--target", default=TARGET)
    ap.add_argument("--traces", default=str(TRACES), help="folder of <draft>__<target>.json")
    ap.add_argument("--window-s", type=float, default=20.0, help="measurement window")
    ap.add_argument("--warmup-s", type=float, default=5.0)
    ap.add_argument(
        "--gamma",
        type=_gamma,
        default=4,
        help="draft tokens per round, or 'plan': tools/bench/planner.py's choice for each N",
    )
    ap.add_argument(
        "--estimator",
        default="models/estimator/smollm2-f32.json",
        help="with --gamma plan: the verifier's fitted estimator (`server-bridge profile`)",
    )
    ap.add_argument("--draft-ms", type=float, default=8.0, help="emulated drafting cost per token")
    ap.add_argument("--tokens", type=int, default=48, help="tokens per generation")
    ap.add_argument("--classes", type=_classes, default=CLASSES, help="SLO classes in tokens/s, round-robin")
    ap.add_argument("--backoff-s", type=float, default=0.2, help="wait after a shed before re-opening")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--server-cpu", type=int, default=1)
    ap.add_argument("--client-cpu", type=int, default=0)
    ap.add_argument("--server-threads", type=int, default=1)
    ap.add_argument("--server-args", default="", help="more `server-bridge serve` flags, e.g. \"--exits ''\"")
    ap.add_argument(
        "--scheduler-flag",
        choices=("auto", "yes", "no"),
        default="auto",
        help="pass --scheduler POLICY to the server (auto: if its serve --help lists it)",
    )
    ap.add_argument(
        "--keep-tokens",
        action="store_true",
        help="store every generation (not only the window's sample) with its token ids in the JSON",
    )


def measure(args: argparse.Namespace) -> dict:
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    if args.quick:  # one short point
        args.n, args.policies, args.pairs = args.n[:1], args.policies[:1], args.pairs[:1]
        args.window_s, args.warmup_s, args.tokens = min(args.window_s, 3.0), min(args.warmup_s, 1.0), 16
    try:
        cfg = LoadConfig(
            gamma=4 if args.gamma == "plan" else args.gamma,
            draft_ms=args.draft_ms,
            tokens=args.tokens,
            classes=args.classes,
            warmup_s=args.warmup_s,
            window_s=args.window_s,
            backoff_s=args.backoff_s,
            seed=args.seed,
        )
    except ValueError as e:
        raise SystemExit(f"loadgen: {e}") from None
    result = sweep(args, cfg)
    for p in result["points"]:
        p["exactness"] = _exactness(p)
    result["target"], result["capacity"] = args.target, capacity_rows(result)
    result["ok"] = all((p["exact"] or p.get("exact_up_to_near_ties")) and not p["errors"] for p in result["points"])
    return result


def main(argv: list[str] | None = None) -> int:
    return harness.main(__doc__, REPORT, measure, add_args, argv, out="docs/loadgen", pin_cores=False)


if __name__ == "__main__":
    sys.exit(main())
