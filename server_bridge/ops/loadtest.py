"""`server-bridge loadtest`: N replayed robots against a running verifier; SLO violations, goodput, capacity.

    server-bridge loadtest --trace TRACE.json [--url ws://127.0.0.1:8765] [--n 2,4,8] [--metrics-port 8765]
                           [--classes 8,2,6,4] [--gamma 4] [--draft-ms 8] [--tokens 48] [--window-s 20] [--json]
                           [--procs P]

The robots are real websocket clients (asyncio, one connection each, `X-Robot-Id: loadgen-<i>`). A robot
does not load a draft model: it replays a trace (tools/train/record_traces.py records one for a model
pair). At T = 0 the committed text is the target's greedy continuation, so the draft a robot would
propose after i committed tokens is the recorded chain at position i; it sleeps gamma x draft_ms, sends
that chain's first gamma tokens in a `verify`, and commits exactly what the `result` says (off the
recorded path it sends empty drafts). Each robot has a speed class (SLO, tokens/s), round-robin, and
generates `tokens` tokens a generation, then closes and opens the next prompt. An `overloaded` error is
the server shedding the request: a violation; the robot backs off and re-opens with its committed prefix.

Measured over window_s after warmup_s; every robot runs throughout, and on after the window (a tail)
until every generation opened in it is decided:

  violation   a generation violates its SLO when tokens / (last result - open) is below its class, or it
              was shed; decided at its last result, at its deadline open + tokens / class if unfinished
              then, or when shed. The window's sample is the generations *opened* in it, each followed to
              its outcome; a robot that opened none there contributes the one it spent the window in.
  goodput     committed tokens (results received in the window) / window, all robots.
  capacity    per class: the largest N such that at it and at every smaller N tried the violation rate,
              overall and of every class, is <= 5 %; a lower bound when every N tried passed.

A fleet of more robots than one event loop drives (1,024 on a 2-core machine) runs in --procs processes
(default one per 256 robots), one window for all; this process reads /metrics and merges their records.
With --metrics-port each point also says what the server spent over the window: its CPU per robot-round
(bridge_process_cpu_seconds_total; its own work apart from the engine's, bridge_engine_cpu_seconds_total),
the engine's busy fraction, rounds/s, sheds and evictions (server_spend), and each robot's tokens/s (mean,
min). The scheduler's decision time is not on /metrics: tools/bench/sched_decision.py measures it.

tools/bench/loadgen.py (a fresh server per point, scheduler policies compared), tools/bench/cluster.py,
tools/bench/gpu_fleet.py, tools/bench/fleet_cpu.py, tools/bench/peer.py and tools/cluster/soak.py run their robots
through this.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import re
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake

from protocol import wire

from ..config import LoadConfig, LoadtestConfig

log = logging.getLogger(__name__)

CLASSES = (8, 2, 6, 4)  # tokens/s, assigned round-robin: tight and loose mixed at every N
MAX_VIOLATION = 0.05
RECOVERABLE = {"unknown_session", "desync"}  # re-opening with the committed prefix repairs these
MAX_OPEN_TRIES = 50  # per (re-)open; the i-th shed one waits backoff(i)
MAX_BACKOFF_S = 5.0  # a robot shed again and again waits at most this long between tries
MAX_CONNECTS = 20  # per robot and point
MAX_TRACE_BYTES = 256 * 1024 * 1024  # a trace file is refused above this before it is parsed
ROBOTS_PER_PROCESS = 256  # run_fleet's share of one event loop when `procs` is not given
PROC_CPU = "proc_cpu_seconds_total"  # a reader's own sample of the server's CPU (/proc/PID/stat), beside /metrics
THREAD_CPU = "proc_thread_cpu_seconds_total"  # {tid="..."}: one of its threads' (/proc/PID/task/TID/stat)
MODEL_THREAD = "the busiest thread but the main one"  # the engine's CPU where the server counts none (a bound)
ENGINE_CPU, PROCESS_CPU = "bridge_engine_cpu_seconds_total", "bridge_process_cpu_seconds_total"
PASS_SECONDS = "bridge_batch_verify_seconds_total"


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
    def load(cls, path: str | Path) -> Trace:
        """An edgespec-trace/1 file, bounded in bytes before it is parsed; ValueError says what is wrong."""
        if Path(path).stat().st_size > MAX_TRACE_BYTES:
            raise ValueError(f"{path}: over {MAX_TRACE_BYTES >> 20} MiB, too big for a trace")
        d = json.loads(Path(path).read_text())
        if not isinstance(d, dict) or d.get("format") != "edgespec-trace/1":
            raise ValueError(
                f"{path}: not an edgespec-trace/1 file (record one with python -m tools.train.record_traces)"
            )
        try:
            prompts = [TracePrompt(p["prompt_ids"], p["target_ids"], p["chains"]) for p in d["prompts"]]
            for i, p in enumerate(prompts):
                if len(p.chains) != len(p.target_ids) or any(len(c) != d["gamma_max"] for c in p.chains):
                    raise ValueError(f"{path}: prompt {i} needs one chain of {d['gamma_max']} per target token")
            fields = (d["draft"], d["target"], d["vocab_hash"], d["vocab_size"], d["eos_ids"], d["gamma_max"])
        except (KeyError, TypeError) as e:
            raise ValueError(f"{path}: a trace without {e}") from None
        return cls(*fields, prompts)

    def save(self, path: str | Path) -> None:
        """As an edgespec-trace/1 file that `load` reads back (e.g. a trace replayed onto another target)."""
        head = {k: getattr(self, k) for k in ("draft", "target", "vocab_hash", "vocab_size", "eos_ids", "gamma_max")}
        prompts = [{"prompt_ids": p.prompt_ids, "target_ids": p.target_ids, "chains": p.chains} for p in self.prompts]
        Path(path).write_text(json.dumps({"format": "edgespec-trace/1", **head, "prompts": prompts}))


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
    client_cpu_s: float = 0.0  # CPU the robots' processes spent, every one together (run_fleet)
    processes: int = 1  # how many processes the robots ran in


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
        self.robot_id, self.client = f"loadgen-{idx}", f"loadgen/robot{idx}"  # X-Robot-Id, hello's client
        self.rng = random.Random(cfg.seed * 7919 + idx)  # its start offset, then its backoffs' jitter

    async def run(self) -> None:
        await asyncio.sleep(self.rng.uniform(0, self.cfg.stagger_s))
        g = 0
        for _ in range(MAX_CONNECTS):  # a lost connection ends its generation; the robot reconnects
            if self.halt.is_set():
                return
            try:
                async with self.dial() as ws:
                    self.ws = ws
                    await self.handshake()
                    while not self.halt.is_set():
                        g += 1
                        await self.generate(g - 1)
                    return
            except (OSError, ConnectionClosed, InvalidHandshake, asyncio.TimeoutError, RobotError) as e:
                self.out.errors.append(f"robot {self.idx}: {type(e).__name__}: {e}")
                await asyncio.sleep(0.5)
            finally:
                self.ws = None

    def dial(self, open_timeout: float = 10.0) -> Any:
        """The websocket connection to the verifier (await it, or use it as a context manager)."""
        return connect(
            self.url,
            open_timeout=open_timeout,
            close_timeout=1,
            ping_interval=None,
            max_size=2 * wire.DEFAULT_MAX_FRAME_BYTES,
            compression=None,
            additional_headers={"X-Robot-Id": self.robot_id},
        )

    async def handshake(self) -> wire.Welcome:
        """hello -> welcome (which names the replica); RobotError when refused."""
        trace = self.trace
        await self.send(wire.Hello("", self.client, draft_vocab_hash=trace.vocab_hash, vocab_size=trace.vocab_size))
        reply = await self.recv(wire.Welcome, None)
        if isinstance(reply, wire.Error):
            raise RobotError(f"handshake refused: {reply.code}: {reply.message}")
        return reply

    async def generate(self, g: int) -> None:
        prompt_no = (self.idx + g) % len(self.trace.prompts)
        prompt = self.trace.prompts[prompt_no]
        sid = f"r{self.idx}-g{g}"
        gen = Generation(self.idx, self.slo, prompt_no, min(self.cfg.tokens, len(prompt.target_ids)), time.monotonic())
        self.out.generations.append(gen)
        try:
            await self.rounds(sid, prompt, gen)
        except (ConnectionClosed, OSError, asyncio.TimeoutError, RobotError) as e:
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
        for tries in range(MAX_OPEN_TRIES):
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
            await asyncio.sleep(self.backoff(tries, reply))
            if self.halt.is_set():
                return  # the run is over: `rounds` ends without a round
        raise RobotError(f"{sid}: open shed {MAX_OPEN_TRIES} times in a row")

    async def recover(self, err: wire.Error, sid: str, prompt: TracePrompt, gen: Generation) -> None:
        """After an `error` on a round: a shed backs off; either way the session is re-opened."""
        if err.code == "overloaded":
            self.note_shed(gen)
            hint = (err.retry_after_ms or 0) / 1e3
            await asyncio.sleep(max(self.cfg.backoff_s, hint * (1.0 + 0.5 * self.rng.random()) if hint else 0.0))
        elif err.code in RECOVERABLE:
            gen.reopens += 1
        else:
            raise RobotError(f"verify refused: {err.code}: {err.message}")
        await self.open(sid, prompt, gen)

    def backoff(self, tries: int, err: wire.Error | None = None) -> float:
        """The wait after the tries-th shed in a row: backoff_s doubling to MAX_BACKOFF_S, jittered by +-50 %
        (a fleet shed together does not come back together), or the server's retry_after_ms, jittered up to
        +50 %, where that is longer (as agent/decoding/session.py waits)."""
        own = min(MAX_BACKOFF_S, self.cfg.backoff_s * 2**tries) * (0.5 + self.rng.random())
        hint = (err.retry_after_ms or 0) / 1e3 if err is not None else 0.0
        return max(own, hint * (1.0 + 0.5 * self.rng.random()))

    def note_shed(self, gen: Generation) -> None:
        now = time.monotonic()
        gen.sheds += 1
        gen.shed = gen.shed if gen.shed is not None else now
        self.out.sheds.append(now)

    @property
    def link(self) -> ClientConnection:
        if self.ws is None:
            raise RobotError("not connected")
        return self.ws

    async def send(self, msg: wire.Message) -> None:
        await self.link.send(wire.encode(msg))

    async def recv(self, want: type, sid: str | None, rnd: int | None = None) -> Any:
        """The reply to the request just sent: a `want` of this session (and round), or an `error` for it.

        Anything else is a late answer to an earlier request: counted in `stale` and skipped.
        """
        deadline = time.monotonic() + self.cfg.recv_timeout_s
        while True:
            frame = await asyncio.wait_for(self.link.recv(), max(0.0, deadline - time.monotonic()))
            try:
                msg = wire.decode(frame, 2 * wire.DEFAULT_MAX_FRAME_BYTES)
            except wire.WireError as e:
                raise RobotError(f"undecodable message from the server: {e}") from None
            mine = getattr(msg, "sid", None) == sid
            if isinstance(msg, wire.Error) and (mine or msg.sid is None):
                return msg
            if isinstance(msg, want) and (sid is None or mine) and (rnd is None or getattr(msg, "round", None) == rnd):
                return msg
            self.out.stale += 1


def fetch_metrics(port: int, timeout_s: float = 5.0) -> dict[str, float]:
    try:
        page = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=timeout_s).read().decode()
        return parse_metrics(page)
    except OSError as e:
        log.warning("GET /metrics failed: %s", e)
        return {}


def proc_cpu_s(pid: int, tid: int | None = None) -> float:
    """A process's CPU time, every thread (or one thread's), in seconds: utime + stime of /proc/PID/stat."""
    path = Path(f"/proc/{pid}/stat" if tid is None else f"/proc/{pid}/task/{tid}/stat")
    fields = path.read_text().rsplit(")", 1)[1].split()  # after the command's name: field 3 on
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def proc_samples(pid: int) -> dict[str, float]:
    """The process's CPU (PROC_CPU) and each thread's (THREAD_CPU{tid="..."}, the main one tid="main")."""
    got = {PROC_CPU: proc_cpu_s(pid)}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            got[f'{THREAD_CPU}{{tid="{"main" if int(task.name) == pid else task.name}"}}'] = proc_cpu_s(
                pid, int(task.name)
            )
        except OSError:  # the thread ended meanwhile
            continue
    return got


def server_reader(port: int, pid: int = 0, timeout_s: float = 5.0) -> Callable[[], dict[str, float]]:
    """run_fleet's `read`: the server's /metrics, and, for a server on this machine (pid), its process's and its
    threads' CPU from /proc (proc_samples): the same measures for a server of any version."""

    def read() -> dict[str, float]:
        page = fetch_metrics(port, timeout_s)
        return page | proc_samples(pid) if pid else page

    return read


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


async def read_window(read: Callable[[], dict[str, float]], window: tuple[float, float]) -> dict:
    """read() at the window's start and at its end (monotonic times), each in a thread of its own: "start" /
    "end", and when each answered, seconds after the window opened ("start_at" / "end_at": a busy server
    answers late, and its counters are those of when it answered). A late first answer does not delay the
    second's asking."""

    async def at(edge: float) -> tuple[dict[str, float], float]:
        await asyncio.sleep(max(0.0, edge - time.monotonic()))
        page = await asyncio.to_thread(read)
        return page, time.monotonic() - window[0]

    (start, start_at), (end, end_at) = await asyncio.gather(at(window[0]), at(window[1]))
    return {"start": start, "start_at": start_at, "end": end, "end_at": end_at, "asked_s": window[1] - window[0]}


async def run_robots(
    url: str,
    trace: Trace,
    n: int,
    cfg: LoadConfig,
    metrics_port: int | None = None,
    robot: Callable[..., Any] = Robot,
    grace_s: float | None = None,
    first: int = 0,
    t0: float | None = None,
    read: Callable[[], dict[str, float]] | None = None,
) -> PointLog:
    """N robots against `url`: warm-up, window, then a tail until every generation opened in the window
    is decided (the load unchanged meanwhile; at most the longest deadline). Bounded in time.

    robot(idx, url, trace, cfg, out, halt) makes one (Robot, or tools/bench/peer.py's PeerRobot); after
    the tail each gets grace_s to finish its request in flight (None: the reply timeout + 5 s, and one
    still running then is an error), then is cancelled. The robots are numbered first..first + n - 1 and
    the warm-up starts at t0 (monotonic; None: now), so the processes of one fleet (run_fleet) share a
    window. /metrics is read at the window's edges from metrics_port, or by `read` if given."""
    out = PointLog()
    halt = asyncio.Event()
    t0 = time.monotonic() if t0 is None else t0
    start, stop = t0 + cfg.warmup_s, t0 + cfg.warmup_s + cfg.window_s
    out.window = (start, stop)
    robots = [
        asyncio.create_task(robot(i, url, trace, cfg, out, halt).run(), name=f"robot-{i}")
        for i in range(first, first + n)
    ]
    if read is None and metrics_port is not None:
        read = partial(fetch_metrics, metrics_port)
    if read is not None:
        out.metrics = await read_window(read, out.window)
    await asyncio.sleep(max(0.0, stop - time.monotonic()))
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


# --------------------------------------------------------------------------- one point: robots in several processes


def _robots_process(conn: Any, url: str, trace: Trace, first: int, n: int, cfg: LoadConfig) -> None:
    """A child of run_fleet: says it is ready, waits for the fleet's t0, runs its robots, sends their log."""
    try:
        conn.send("ready")
        t0 = conn.recv()
        c0 = time.process_time()
        out = asyncio.run(run_robots(url, trace, n, cfg, first=first, t0=t0))
        out.client_cpu_s = time.process_time() - c0
        conn.send(out)
    except BaseException as e:  # the parent reads why, rather than an EOF
        conn.send(RobotError(f"robots {first}-{first + n - 1}: {type(e).__name__}: {e}"))
        raise
    finally:
        conn.close()


def merge_logs(logs: list[PointLog], window: tuple[float, float], metrics: dict) -> PointLog:
    """One fleet's log from its processes' (their robots numbered apart, one window)."""
    out = PointLog(window=window, metrics=metrics, processes=len(logs))
    for log_ in logs:
        out.generations += log_.generations
        out.rounds += log_.rounds
        out.sheds += log_.sheds
        out.errors += log_.errors
        out.stale += log_.stale
        out.client_cpu_s += log_.client_cpu_s
        out.ended = max(out.ended, log_.ended)
    return out


def run_fleet(
    url: str,
    trace: Trace,
    n: int,
    cfg: LoadConfig,
    procs: int = 1,
    metrics_port: int | None = None,
    read: Callable[[], dict[str, float]] | None = None,
) -> PointLog:
    """run_robots for a fleet too big for one event loop: N robots split over `procs` processes (spawned,
    each on the cores this one may use), one window for all; this process reads /metrics at its edges
    (from metrics_port, or by `read`) and merges the processes' logs. procs 1: in this process."""
    procs = max(1, min(procs, n))
    if read is None and metrics_port is not None:
        read = partial(fetch_metrics, metrics_port)
    if procs == 1:
        c0 = time.process_time()
        out = asyncio.run(run_robots(url, trace, n, cfg, read=read))
        out.client_cpu_s = time.process_time() - c0
        return out
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")  # not fork: this process may hold threads
    bounds = [n * i // procs for i in range(procs + 1)]
    children = []
    try:
        for first, end in zip(bounds, bounds[1:], strict=False):
            mine, theirs = ctx.Pipe()
            child = ctx.Process(target=_robots_process, args=(theirs, url, trace, first, end - first, cfg), daemon=True)
            child.start()
            theirs.close()
            children.append((child, mine))
        for child, conn in children:  # each has imported this module and is ready to dial
            if not conn.poll(120) or conn.recv() != "ready":
                raise RuntimeError(f"a robots' process did not start (exit code {child.exitcode})")
        t0 = time.monotonic() + 0.1
        for _, conn in children:
            conn.send(t0)
        window = (t0 + cfg.warmup_s, t0 + cfg.warmup_s + cfg.window_s)
        metrics = asyncio.run(read_window(read, window)) if read is not None else {}
        logs = [_child_log(conn, cfg) for _, conn in children]
    finally:
        for child, conn in children:
            child.join(5)
            if child.is_alive():
                child.terminate()
                child.join(5)
            conn.close()
    return merge_logs(logs, window, metrics)


def _child_log(conn: Any, cfg: LoadConfig) -> PointLog:
    """A child's PointLog, once its robots are done (the tail and the grace are bounded: so is this wait)."""
    bound = cfg.warmup_s + cfg.window_s + cfg.tokens / min(cfg.classes) + cfg.recv_timeout_s + 60
    if not conn.poll(bound):
        raise RuntimeError(f"a robots' process sent nothing in {bound:.0f}s")
    got = conn.recv()
    if isinstance(got, Exception):
        raise got
    return got


# --------------------------------------------------------------------------- one point: summary


def robot_speeds(out: PointLog) -> dict:
    """Each robot's tokens/s over its generations in the window's sample (`sample`): tokens over the wall
    time to its last token, or to the end of the run for one unfinished then; their mean over the robots
    and the slowest robot's. None without a sample."""
    now = max(out.ended, out.window[1])
    by_robot: dict[int, list[float]] = {}
    for g, chosen in zip(out.generations, sample(out.generations, out.window), strict=True):
        if chosen:
            wall = (g.done if g.done is not None else now) - g.opened
            by_robot.setdefault(g.robot, []).append(len(g.tokens) / max(wall, 1e-9))
    speeds = [sum(v) / len(v) for v in by_robot.values()]
    mean = round(sum(speeds) / len(speeds), 2) if speeds else None
    return {"speed_mean": mean, "speed_min": round(min(speeds), 2) if speeds else None, "robots_sampled": len(speeds)}


def exact(gen: Generation, trace: Trace) -> bool:
    """Greedy equivalence: what the robot committed is the target's own continuation."""
    return gen.tokens == trace.prompts[gen.prompt].target_ids[: len(gen.tokens)]


def diverged_at(gen: Generation, trace: Trace) -> int | None:
    """The first position where the robot's ids leave the target's recorded continuation, if any."""
    ref = trace.prompts[gen.prompt].target_ids
    return next((i for i, (a, b) in enumerate(zip(gen.tokens, ref, strict=False)) if a != b), None)


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
    per_class: dict[str, dict[str, Any]] = {str(c): {"decided": 0, "violated": 0, "speeds": []} for c in classes}
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


def server_spend(metrics: dict) -> dict:
    """What the server spent over the window, from the two /metrics pages: its CPU per robot-round (its
    own work, the engine's and both), how busy the engine was, rounds per second, sheds, evictions.

    The process's CPU: PROC_CPU if the reader sampled it, else the server's own counter (servers before
    issue 51 have none). The engine's: the model thread's CPU in the passes where the server counts it; else,
    with the threads sampled, the model thread's whole CPU (MODEL_THREAD: with one engine thread llama.cpp
    computes on it; it also runs the host's work around each pass, so the engine's share is an upper bound
    and host a lower one); else the passes' wall time (the same only when nothing else takes the core during a
    pass). `measured` says which; host = process - engine. pass_ms_per_round (the passes' wall time) and
    host_wall_ms_per_round (process - that) for every server alike. {} unless both pages were read; only
    their span and delay when they span less than half the window asked (a server too busy to answer)."""
    start, end = metrics.get("start") or {}, metrics.get("end") or {}
    if "bridge_rounds_total" not in start or "bridge_rounds_total" not in end:
        return {}
    d = metrics_delta(start, end)
    span = max(1e-9, metrics["end_at"] - metrics["start_at"])
    late = max(metrics["start_at"], metrics["end_at"] - metrics.get("asked_s", metrics["end_at"]))
    if span < metrics.get("asked_s", 0.0) / 2:  # both answers came together, long after the first edge
        return {"window_s": round(span, 3), "late_s": round(late, 3)}
    rounds = d.get("bridge_rounds_total", 0.0)
    process = PROC_CPU if PROC_CPU in d else PROCESS_CPU if PROCESS_CPU in d else None
    model_s = max((v for k, v in d.items() if k.startswith(THREAD_CPU) and 'tid="main"' not in k), default=None)
    engine = ENGINE_CPU if ENGINE_CPU in d else MODEL_THREAD if model_s is not None else PASS_SECONDS
    per = lambda s: None if s is None or not rounds else 1e3 * s / rounds  # noqa: E731
    process_s = d.get(process) if process else None
    engine_s = (model_s or 0.0) if engine == MODEL_THREAD else d.get(engine, 0.0)
    return {
        "window_s": round(span, 3),  # between the two answers
        "late_s": round(late, 3),  # how long after its edge the later answer came
        "rounds": int(rounds),
        "rounds_per_s": rounds / span,
        "cpu_ms_per_round": per(process_s),
        "engine_ms_per_round": per(engine_s),
        "host_ms_per_round": per(None if process_s is None else process_s - engine_s),
        "pass_ms_per_round": per(d.get(PASS_SECONDS, 0.0)),
        "host_wall_ms_per_round": per(None if process_s is None else process_s - d.get(PASS_SECONDS, 0.0)),
        "counter_ms_per_round": per(d.get(PROCESS_CPU)),  # the server's own count of its CPU, where it has one
        "model_thread_ms_per_round": per(model_s),
        "engine_busy": d.get(PASS_SECONDS, 0.0) / span,
        "process_cpu_share": None if process_s is None else process_s / span,
        "batch_mean": metric_means(d).get("bridge_batch_size"),
        "sheds": int(d.get('bridge_errors_total{code="overloaded"}', 0)),
        "evicted": int(d.get("bridge_sessions_evicted_total", 0)),
        "opened": int(d.get("bridge_sessions_opened_total", 0)),
        "measured": {"process": process, "engine": engine},
    }


def describe_spend(s: dict) -> str:
    """One line: the server's CPU per robot-round and what else it spent over the window."""
    if not s:
        return "      server: no /metrics read (--metrics-port)"
    ms = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
    return (
        f"      server: {ms(s['cpu_ms_per_round'])} ms CPU a robot-round (host {ms(s['host_ms_per_round'])}, "
        f"engine {ms(s['engine_ms_per_round'])}), engine busy {100 * s['engine_busy']:.0f} %, "
        f"{s['rounds_per_s']:.0f} rounds/s, sheds {s['sheds']}, evicted {s['evicted']}"
    )


# --------------------------------------------------------------------------- `server-bridge loadtest`


def class_passes(point: dict, classes: tuple) -> dict[str, bool | None]:
    """Per class: whether the point held it (violation rate <= MAX_VIOLATION); None without data."""
    rates = point["violation_rate_by_class"]
    return {str(c): None if rates[str(c)] is None else rates[str(c)] <= MAX_VIOLATION for c in classes}


def describe(n: int, s: dict) -> str:
    """One line for a point: the violations per class, goodput, rounds, sheds, errors."""
    pct = lambda r: "-" if r is None else f"{100 * r:.0f}%"  # noqa: E731
    by_class = " ".join(f"{c} tok/s {pct(r)}" for c, r in s["violation_rate_by_class"].items())
    lat = "-" if s["round_ms_mean"] is None else f"{s['round_ms_mean']:.0f}/{s['round_ms_p95']:.0f}"
    return (
        f"N={n:<4} violations {pct(s['violation_rate'])} of {s['decided']} ({by_class})  goodput "
        f"{s['goodput_tokens_per_s']:.1f} tok/s  round ms mean/p95 {lat}  shed {s['sheds']}  exact {s['exact']}"
        + (f"  errors {len(s['errors'])}" if s["errors"] else "")
    )


def run(config: LoadtestConfig, cfg: LoadConfig, as_json: bool = False) -> int:
    """Points at config.n (or a doubling and bisecting search) against config.url; each class's capacity."""
    trace = Trace.load(config.trace)
    if cfg.gamma > trace.gamma_max:
        raise ValueError(f"gamma {cfg.gamma} > the trace's gamma_max {trace.gamma_max}")
    points: dict[int, dict] = {}

    def one(n: int) -> dict[str, bool | None]:
        procs = config.procs or -(-n // ROBOTS_PER_PROCESS)
        read = server_reader(config.metrics_port, config.server_pid, 60.0) if config.metrics_port else None
        out = run_fleet(config.url, trace, n, cfg, procs, read=read)
        s = summarize(out, trace, cfg.classes)
        s.pop("generation_records")
        speeds = robot_speeds(out)
        spend = server_spend(out.metrics)
        client = {"processes": out.processes, "cpu_s": round(out.client_cpu_s, 3)}
        points[n] = {"n": n, **s, **speeds, "server_metrics": server_figures(out.metrics)["means"]}
        points[n] |= {"server": spend, "client": client}
        if not as_json:
            print(describe(n, s), flush=True)
            print(describe_spend(spend) + f"; robots' tok/s mean/min {speeds['speed_mean']}/{speeds['speed_min']}")
        return class_passes(s, cfg.classes)

    caps = capacity_search(one, [str(c) for c in cfg.classes], tuple(config.n), 1, config.max_n)
    if as_json:
        print(json.dumps({"trace": config.trace, "url": config.url, "points": list(points.values()), "capacity": caps}))
        return 0
    for c, v in caps.items():
        print(f"{c} tok/s: {'at least ' if v['lower_bound'] else ''}{v['capacity']} robots (N tried: {v['tried']})")
    return 0
