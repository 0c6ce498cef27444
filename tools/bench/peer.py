"""The peer a user would pick instead: llama.cpp's own `llama-server` streaming plain AR, measured like our robots.

    python -m tools.bench.peer [--model PATH] [--rtts 0,20,50] [--tokens 48] [--prompts 10]
                         [--classes 8,4,2] [--n 1,2,4,8,...] [--max-n 256] [--window-s 20] [--warmup-s 5]
                         [--server-core 1] [--client-core 0] [--cache-ram 0] [--skip-one] [--skip-fleet]
                         [--out bench_results/peer]

The server is llama.cpp's `llama-server` built from the llama.cpp vendored in the
llama-cpp-python sdist our engine is built from (`make llama-server`, i.e.
tools/build_llama_server.sh; cached under ~/.cache/edgespec/, built only for this
benchmark). It runs pinned to one core (`taskset -c --server-core`, `-t 1`) with
`--parallel N` slots and continuous batching; this process, the robots and the
network emulator (tools/cluster/netem) run on --client-core.

A robot asks for a completion of its prompt's token ids on the native
`/completion` endpoint (`stream`, `return_tokens`, `temperature` 0, `cache_prompt`,
`n_probs` 0) over HTTP/1.1 (stdlib asyncio, no client library; a fresh TCP connection per
completion, since llama-server closes it after each streamed response), and records each token id and when its
chunk arrived. Prompts are the
chat-templated benchmark prompts of the loadgen trace (tools/traces/), the same ids
our robots send, so the peer's greedy text can be checked against our target's.

  one robot   tokens/s at each RTT through the emulated link, --tokens per prompt over
              --prompts prompts, llama-server with one slot: total tokens / total time
              from request sent to the last token arriving (as tools/bench/decoding.py counts it).
  fleet       N robots streaming back to back, SLO classes round-robin from --classes;
              a generation violates when tokens / (last token - request) < its class
              (tools/bench/loadgen.py's rule, window, sample and capacity, imported from there);
              one fresh llama-server with --parallel N per point. N doubles from 1 until
              every class fails (or --max-n), then bisects per class; a class's capacity
              is the largest N at which it and every smaller N tried held <= 5 %.

`--cache-ram 0` (the default here) turns off llama-server's host-RAM prompt cache: the
benchmark repeats identical prompts, which a robot fleet would not, and our verifier does
not reuse one session's KV for another. `cache_prompt` (prefix reuse within a slot) stays on.

Writes peer.json, peer.md and peer.png (tokens/s against RTT; violations against N) into --out.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable, Iterable
from urllib.parse import urlsplit

from runtime import settings
from server_bridge.config import LoadConfig
from server_bridge.ops.fleet import free_port, stop_process
from tools.bench import harness

VERSION = "0.3.36"  # llama-cpp-python's sdist; its vendor/llama.cpp is our engine's llama.cpp
CACHE_ROOT = Path.home() / ".cache" / "edgespec"
BUILD_SCRIPT = Path(__file__).resolve().parents[1] / "build_llama_server.sh"
DEFAULT_TRACE = Path(__file__).resolve().parents[1] / "traces" / "smollm2-q4_1__smollm2-f32.json"
F32_GGUF = "SmolLM2-135M-Instruct.F32.gguf"
CLASSES = (8, 4, 2)  # tokens/s, round-robin over robots: the tightest first
PARALLEL_CAP = 512  # llama-server slots we ever ask for


# --------------------------------------------------------------------------- the binary and the model


def find_llama_server() -> Path | None:
    """$EDGESPEC_LLAMA_SERVER, else the newest cached build of VERSION; None if there is none."""
    env = os.environ.get("EDGESPEC_LLAMA_SERVER")
    if env:
        return Path(env) if os.access(env, os.X_OK) else None
    builds = [p for p in CACHE_ROOT.glob(f"llama-server-{VERSION}-*/llama-server") if os.access(p, os.X_OK)]
    return max(builds, key=lambda p: p.stat().st_mtime) if builds else None


def build_llama_server() -> Path:
    """Run tools/build_llama_server.sh (instant when cached; minutes the first time); the binary's path."""
    out = subprocess.run(["bash", str(BUILD_SCRIPT)], stdout=subprocess.PIPE, text=True, check=True)
    return Path(out.stdout.strip().splitlines()[-1])


def default_model() -> Path | None:
    """The F32 GGUF of the target in models/build, if it has been made."""
    from protocol import modelfiles

    path = modelfiles.build_dir() / F32_GGUF
    return path if path.exists() else None


@functools.lru_cache(maxsize=4)
def server_help(binary: str) -> str:
    """`llama-server --help`, to pass only flags this build knows."""
    out = subprocess.run([binary, "--help"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=30)
    return out.stdout


def server_version(binary: str | Path) -> str:
    out = subprocess.run(
        [str(binary), "--version"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=30
    )
    return " ".join(line.strip() for line in out.stdout.splitlines() if line.startswith(("version", "built")))


class LlamaServer:
    """llama-server on 127.0.0.1 (a free port) for one GGUF, optionally pinned to one core; a context manager.

    ctx: the whole KV size; default parallel x ctx_per_slot (with an explicit --parallel the
    server splits it evenly between its slots).
    """

    def __init__(
        self,
        model: str | Path,
        *,
        parallel: int = 1,
        threads: int = 1,
        ctx_per_slot: int = 512,
        ctx: int | None = None,
        core: int | None = None,
        cont_batching: bool = True,
        cache_ram_mib: int | None = 0,
        binary: str | Path | None = None,
        extra_args: Iterable[str] = (),
        start_timeout_s: float = 120.0,
        host: str = "127.0.0.1",
    ):
        if not 1 <= parallel <= PARALLEL_CAP:
            raise ValueError(f"parallel must be 1-{PARALLEL_CAP}, got {parallel}")
        self.model = Path(model)
        self.parallel, self.threads, self.core = parallel, threads, core
        self.ctx = ctx if ctx is not None else parallel * ctx_per_slot
        self.cont_batching = cont_batching
        self.cache_ram_mib = cache_ram_mib
        self.binary = Path(binary) if binary else find_llama_server()
        self.extra_args = list(extra_args)
        self.start_timeout_s = start_timeout_s
        self.host = host
        self.port = 0
        self.proc: subprocess.Popen | None = None
        self.log_path = Path(tempfile.mkstemp(prefix="llama-server-", suffix=".log")[1])
        self.cmd: list[str] = []

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def command(self) -> list[str]:
        if self.binary is None or not os.access(self.binary, os.X_OK):
            raise FileNotFoundError(
                f"no llama-server {VERSION} binary cached under {CACHE_ROOT}: run "
                "`make llama-server` (tools/build_llama_server.sh) first"
            )
        if not self.model.exists():
            raise FileNotFoundError(f"no model at {self.model}")
        helptext = server_help(str(self.binary))
        cmd = [
            str(self.binary),
            "-m",
            str(self.model),
            "--host",
            self.host,
            "--port",
            str(self.port),
            "-t",
            str(self.threads),
            "-tb",
            str(self.threads),
            "-c",
            str(self.ctx),
            "-np",
            str(self.parallel),
            "-cb" if self.cont_batching else "-nocb",
        ]
        ui_off = next((f for f in ("--no-ui", "--no-webui") if f in helptext.split()), None)
        if ui_off:  # the web UI's name changed: --no-ui, formerly --no-webui
            cmd.append(ui_off)
        if self.cache_ram_mib is not None and "--cache-ram" in helptext:
            cmd += ["--cache-ram", str(self.cache_ram_mib)]
        cmd += self.extra_args
        if self.core is not None and shutil.which("taskset"):
            cmd = ["taskset", "-c", str(self.core)] + cmd
        return cmd

    def start(self) -> "LlamaServer":
        self.port = free_port()
        self.cmd = self.command()
        pin = None
        if self.core is not None and not shutil.which("taskset"):
            pin = lambda: os.sched_setaffinity(0, {self.core})  # noqa: E731
        self.proc = subprocess.Popen(
            self.cmd, stdout=self.log_path.open("w"), stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, preexec_fn=pin
        )
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama-server exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=1) as r:
                    if r.status == 200:
                        return self
            except (OSError, urllib.error.HTTPError):  # refused while starting; 503 while loading
                pass
            time.sleep(0.1)
        self.stop()
        raise TimeoutError(f"llama-server did not answer /health in {self.start_timeout_s}s:\n{self.log_tail()}")

    def stop(self) -> None:
        stop_process(self.proc)

    def log_tail(self, n: int = 20) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])

    def __enter__(self) -> "LlamaServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
        self.log_path.unlink(missing_ok=True)


# --------------------------------------------------------------------------- HTTP + SSE, parsed incrementally


class PeerError(RuntimeError):
    """The server answered with an error (an HTTP status other than 200, or an error event in the stream)."""


class StreamParser:
    """Incremental parser of one HTTP/1.1 response whose body is server-sent events.

    feed(bytes) returns the JSON objects of the events that bytes completed; `done` is set
    at the end of the body (the last chunk, Content-Length reached, or feed_eof()). Comment
    lines (": ping") are skipped; `data: [DONE]` sets `sse_done`. A non-200 response's body
    is kept raw in `error_body`.
    """

    def __init__(self) -> None:
        self._buf = b""
        self.status: int | None = None
        self.headers: dict[str, str] = {}
        self.done = False
        self.sse_done = False
        self.error_body = b""
        self._mode = ""  # "chunked" | "length" | "close", once the head is read
        self._left = 0  # bytes left in the current chunk / the body
        self._crlf = False  # a chunk's data is read; its CRLF is not yet
        self._sse = b""

    @property
    def keep_alive(self) -> bool:
        return self.headers.get("connection", "").lower() != "close" and self._mode != "close"

    def feed(self, data: bytes) -> list[dict]:
        self._buf += data
        body = b""
        if self.status is None:
            head_end = self._buf.find(b"\r\n\r\n")
            if head_end < 0:
                return []
            self._head(self._buf[:head_end].decode("latin-1"))
            self._buf = self._buf[head_end + 4 :]
        while not self.done:
            if self._mode != "chunked":
                take = self._buf if self._mode == "close" else self._buf[: self._left]
                self._buf = self._buf[len(take) :]
                body += take
                if self._mode == "length":
                    self._left -= len(take)
                    self.done = self._left == 0
                break
            if self._crlf:  # the CRLF after a chunk's data
                if len(self._buf) < 2:
                    break
                self._buf, self._crlf = self._buf[2:], False
            elif self._left == 0:  # a chunk-size line
                eol = self._buf.find(b"\r\n")
                if eol < 0:
                    break
                size = int(self._buf[:eol].split(b";")[0].strip() or b"0", 16)
                if size == 0:  # the last chunk: then trailers (usually none), CRLF
                    rest = self._buf[eol + 2 :]
                    if rest.startswith(b"\r\n"):
                        end = 2
                    elif (t := rest.find(b"\r\n\r\n")) >= 0:
                        end = t + 4
                    else:
                        break
                    self._buf, self.done = rest[end:], True
                    break
                self._buf, self._left = self._buf[eol + 2 :], size
            else:  # chunk data
                take = self._buf[: self._left]
                if not take:
                    break
                self._buf = self._buf[len(take) :]
                self._left -= len(take)
                body += take
                self._crlf = self._left == 0
        return self._body(body)

    def feed_eof(self) -> list[dict]:
        """The connection closed: a close-delimited body ends here; anything else was cut short."""
        events = self._body(b"\n\n") if self._mode == "close" and self._sse.strip() else []
        if self._mode == "close":
            self.done = True
        return events

    def _head(self, head: str) -> None:
        lines = head.split("\r\n")
        parts = lines[0].split(" ", 2)
        if len(parts) < 2 or not parts[0].startswith("HTTP/"):
            raise PeerError(f"not an HTTP response: {lines[0]!r}")
        self.status = int(parts[1])
        for line in lines[1:]:
            k, _, v = line.partition(":")
            self.headers[k.strip().lower()] = v.strip()
        if "chunked" in self.headers.get("transfer-encoding", "").lower():
            self._mode = "chunked"
        elif "content-length" in self.headers:
            self._mode, self._left = "length", int(self.headers["content-length"])
            self.done = self._left == 0
        else:
            self._mode = "close"

    def _body(self, data: bytes) -> list[dict]:
        if self.status != 200:
            self.error_body += data
            return []
        self._sse = (self._sse + data).replace(b"\r\n", b"\n")
        events = []
        while True:
            end = self._sse.find(b"\n\n")
            if end < 0:
                break
            block, self._sse = self._sse[:end], self._sse[end + 2 :]
            ev = self._event(block.decode("utf-8", "replace"))
            if ev is not None:
                events.append(ev)
        return events

    def _event(self, block: str) -> dict | None:
        name, data = "", []
        for line in block.split("\n"):
            if not line or line.startswith(":"):
                continue
            k, _, v = line.partition(":")
            v = v[1:] if v.startswith(" ") else v
            if k == "data":
                data.append(v)
            elif k == "event":
                name = v
        if not data:
            return None
        text = "\n".join(data)
        if text.strip() == "[DONE]":
            self.sse_done = True
            return None
        obj = json.loads(text)
        if name == "error" and "error" not in obj:
            obj = {"error": obj}
        return obj


@dataclass
class StreamResult:
    """One streamed completion; times in seconds from the request being sent (time.monotonic)."""

    ids: list[int]
    t_first: float | None  # first token's arrival
    t_tokens: list[float]  # each token's arrival
    wall_s: float  # to the last token (to the end of the stream if there was none)
    sent_at: float = 0.0  # time.monotonic() when the request went out
    n_predicted: int | None = None  # the server's count (tokens_predicted): more than len(ids) if it withheld any
    n_prompt: int | None = None  # tokens_evaluated
    stop_type: str | None = None  # eos | limit | word
    timings: dict = field(default_factory=dict)  # the server's own: prompt_ms, predicted_per_token_ms, ...

    @property
    def tokens_per_s(self) -> float:
        return len(self.ids) / self.wall_s if self.wall_s > 0 else 0.0


def completion_body(prompt_ids: list[int], n_predict: int, temperature: float = 0.0, **extra) -> dict:
    return {
        "prompt": [int(t) for t in prompt_ids],
        "n_predict": int(n_predict),
        "temperature": temperature,
        "stream": True,
        "return_tokens": True,
        "cache_prompt": True,
        "n_probs": 0,
        **extra,
    }


class PeerConnection:
    """A robot's HTTP/1.1 link to llama-server (or a proxy in front of it); streams completions.

    llama-server (this build) closes the TCP connection after every streamed response even
    though it answers `Keep-Alive`, so by default each completion opens its own connection
    and asks for `Connection: close`; the time to connect counts in the completion's time.
    keep_alive=True reuses one connection for a server that keeps it open.
    """

    def __init__(self, host: str, port: int, keep_alive: bool = False):
        self.host, self.port, self.keep_alive = host, port, keep_alive
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    @classmethod
    def for_url(cls, url: str, keep_alive: bool = False) -> "PeerConnection":
        u = urlsplit(url)
        return cls(u.hostname or "127.0.0.1", u.port or 80, keep_alive)

    async def open(self) -> "PeerConnection":
        if self.writer is None or self.writer.is_closing():
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        return self

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        self.reader = self.writer = None

    async def __aenter__(self) -> "PeerConnection":
        return self

    async def __aexit__(self, *exc) -> None:
        self.close()

    async def completion(
        self,
        prompt_ids: list[int],
        n_predict: int,
        *,
        temperature: float = 0.0,
        timeout_s: float = 60.0,
        on_token: Callable[[int, float], None] | None = None,
        **extra,
    ) -> StreamResult:
        """POST /completion with stream=true; on_token(id, monotonic arrival) as each token arrives.

        timeout_s bounds the connect and each wait for bytes, not the whole stream.
        """
        body = json.dumps(completion_body(prompt_ids, n_predict, temperature, **extra)).encode()
        head = (
            f"POST /completion HTTP/1.1\r\nHost: {self.host}:{self.port}\r\nContent-Type: application/json\r\n"
            f"Accept: text/event-stream\r\nContent-Length: {len(body)}\r\n"
            f"Connection: {'keep-alive' if self.keep_alive else 'close'}\r\n\r\n"
        )
        parser = StreamParser()
        res = StreamResult([], None, [], 0.0)
        sent = res.sent_at = time.monotonic()
        try:
            await asyncio.wait_for(self.open(), timeout_s)
            self.writer.write(head.encode() + body)
            await self.writer.drain()
            while not parser.done:
                data = await asyncio.wait_for(self.reader.read(65536), timeout_s)
                now = time.monotonic()
                events = parser.feed(data) if data else parser.feed_eof()
                for ev in events:
                    _take(ev, res, now - sent, on_token, now)
                if not data and not parser.done:
                    raise ConnectionError("llama-server closed the connection mid-response")
        except BaseException:
            self.close()  # a half-read response leaves the connection unusable
            raise
        if not (self.keep_alive and parser.keep_alive):
            self.close()
        if parser.status != 200:
            self.close()
            raise PeerError(f"HTTP {parser.status}: {parser.error_body[:500].decode('utf-8', 'replace')}")
        res.wall_s = res.t_tokens[-1] if res.t_tokens else time.monotonic() - sent
        return res


def _take(ev: dict, res: StreamResult, t: float, on_token, now: float) -> None:
    if "error" in ev:
        raise PeerError(f"error event: {ev['error']}")
    for tok in ev.get("tokens") or ():
        res.ids.append(int(tok))
        res.t_tokens.append(t)
        if res.t_first is None:
            res.t_first = t
        if on_token is not None:
            on_token(int(tok), now)
    if "tokens_predicted" in ev:
        res.n_predicted = ev["tokens_predicted"]
    if "tokens_evaluated" in ev:
        res.n_prompt = ev["tokens_evaluated"]
    if ev.get("stop"):
        res.stop_type = ev.get("stop_type")
        res.timings = ev.get("timings") or {}


async def stream_completion(
    url: str,
    prompt_ids: list[int],
    n_predict: int,
    *,
    conn: PeerConnection | None = None,
    temperature: float = 0.0,
    timeout_s: float = 60.0,
    on_token: Callable[[int, float], None] | None = None,
    **extra,
) -> StreamResult:
    """One robot's streamed completion of prompt_ids from llama-server at url (http://host:port).

    Pass conn to reuse its settings (and, with keep_alive=True, its connection); else one is made and closed.
    """
    own = conn is None
    conn = conn or PeerConnection.for_url(url)
    try:
        return await conn.completion(
            prompt_ids, n_predict, temperature=temperature, timeout_s=timeout_s, on_token=on_token, **extra
        )
    finally:
        if own:
            conn.close()


# --------------------------------------------------------------------------- prompts


def load_prompts(trace_path: str | Path = DEFAULT_TRACE, n: int | None = None):
    """The loadgen trace (loadtest.Trace): chat-templated prompt ids and our target's greedy continuation."""
    from server_bridge.ops.loadtest import Trace

    trace = Trace.load(trace_path)
    return replace(trace, prompts=trace.prompts[:n]) if n else trace


# --------------------------------------------------------------------------- one robot, RTT sweep


async def one_robot_runs(url: str, prompts: list[list[int]], n_predict: int, repeats: int = 1) -> list[StreamResult]:
    """One robot, the prompts back to back."""
    async with PeerConnection.for_url(url) as conn:
        return [await conn.completion(p, n_predict) for _ in range(repeats) for p in prompts]


def one_robot(
    model: str | Path,
    trace,
    rtts: list[float],
    n_predict: int = 48,
    *,
    core: int | None = None,
    threads: int = 1,
    binary: str | Path | None = None,
    cache_ram_mib: int | None = 0,
    log: Callable[[str], None] = print,
) -> list[dict]:
    """tokens/s of one robot at each RTT (llama-server with one slot behind the emulated link); a row per RTT."""
    from tools.cluster.netem import LinkProfile, NetemProxy

    prompts = [p.prompt_ids for p in trace.prompts]
    rows = []
    with (
        LlamaServer(
            model,
            parallel=1,
            threads=threads,
            core=core,
            binary=binary,
            cache_ram_mib=cache_ram_mib,
            ctx_per_slot=_ctx_per_slot(trace, n_predict),
        ) as srv,
        NetemProxy("127.0.0.1", srv.port) as link,
    ):
        asyncio.run(one_robot_runs(link.url("http"), prompts[:2], 8))  # warm-up
        for rtt in rtts:
            link.set_profile(LinkProfile.from_rtt(rtt))
            runs = asyncio.run(one_robot_runs(link.url("http"), prompts, n_predict))
            row = one_robot_row(rtt, runs, trace, n_predict)
            rows.append(row)
            log(
                f"  one robot, rtt {rtt:>4.0f} ms: {row['tokens_per_s']:6.2f} tok/s  (first token "
                f"{row['first_token_ms_mean']:.0f} ms, server {row['server_ms_per_token']:.1f} ms/token, "
                f"prompt {row['server_prompt_ms_mean']:.0f} ms; matches trace {row['matches_trace']}/{row['runs']})"
            )
    return rows


def one_robot_row(rtt: float, runs: list[StreamResult], trace, n_predict: int) -> dict:
    tok = sum(len(r.ids) for r in runs)
    wall = sum(r.wall_s for r in runs)
    gaps = [b - a for r in runs for a, b in zip(r.t_tokens, r.t_tokens[1:], strict=False)]
    pred = [r.timings.get("predicted_per_token_ms") for r in runs if r.timings.get("predicted_per_token_ms")]
    match = [
        r.ids == p.target_ids[: len(r.ids)] and len(r.ids) == min(n_predict, len(p.target_ids))
        for r, p in zip(runs, trace.prompts, strict=True)
    ]
    return {
        "rtt_ms": rtt,
        "mode": "llama-server AR",
        "runs": len(runs),
        "tokens": tok,
        "wall_s": wall,
        "tokens_per_s": tok / wall if wall else 0.0,
        "first_token_ms_mean": 1e3 * sum(r.t_first or 0 for r in runs) / len(runs),
        "inter_token_ms_mean": 1e3 * sum(gaps) / len(gaps) if gaps else None,
        "server_ms_per_token": sum(pred) / len(pred) if pred else None,
        "server_prompt_ms_mean": sum(r.timings.get("prompt_ms", 0.0) for r in runs) / len(runs),
        "withheld_tokens": sum(max(0, (r.n_predicted or 0) - len(r.ids)) for r in runs),
        "matches_trace": sum(match),
        "matches": f"{sum(match)}/{len(runs)}",
        "token_ids": [r.ids for r in runs],
    }


def _ctx_per_slot(trace, n_predict: int) -> int:
    need = max(len(p.prompt_ids) for p in trace.prompts) + n_predict + 16
    return max(256, -(-need // 64) * 64)


# --------------------------------------------------------------------------- the fleet


class PeerRobot:
    """One robot streaming plain AR from llama-server: generations back to back until `halt` is set."""

    def __init__(self, idx: int, url: str, trace, cfg, out, halt: asyncio.Event):
        self.idx, self.url, self.trace, self.cfg, self.out, self.halt = idx, url, trace, cfg, out, halt
        self.slo = cfg.classes[idx % len(cfg.classes)]

    async def run(self) -> None:
        from server_bridge.ops.loadtest import MAX_CONNECTS

        await asyncio.sleep(random.Random(self.cfg.seed * 7919 + self.idx).uniform(0, self.cfg.stagger_s))
        g = 0
        for _ in range(MAX_CONNECTS):  # a lost connection ends its generation; the robot reconnects
            conn = PeerConnection.for_url(self.url)
            try:
                while not self.halt.is_set():
                    g += 1
                    await self.generate(conn, g - 1)
                return
            except (OSError, PeerError, asyncio.TimeoutError, ValueError) as e:
                self.out.errors.append(f"robot {self.idx}: {type(e).__name__}: {e}")
                await asyncio.sleep(0.5)
            finally:
                conn.close()

    async def generate(self, conn: PeerConnection, g: int) -> None:
        from server_bridge.ops.loadtest import Generation

        prompt_no = (self.idx + g) % len(self.trace.prompts)
        prompt = self.trace.prompts[prompt_no]
        gen = Generation(self.idx, self.slo, prompt_no, min(self.cfg.tokens, len(prompt.target_ids)), time.monotonic())
        self.out.generations.append(gen)
        last = [gen.opened]

        def on_token(tok: int, now: float) -> None:
            gen.tokens.append(tok)
            self.out.rounds.append((now, (now - last[0]) * 1e3, 1))
            last[0] = now

        try:
            res = await conn.completion(
                prompt.prompt_ids, gen.goal, timeout_s=self.cfg.recv_timeout_s, on_token=on_token
            )
        except (OSError, PeerError, asyncio.TimeoutError, ValueError) as e:
            gen.error, gen.failed = f"{type(e).__name__}: {e}", time.monotonic()
            raise
        gen.rounds = 1
        gen.done = res.sent_at + res.wall_s


def fleet_point(
    model: str | Path,
    trace,
    n: int,
    cfg,
    *,
    core: int | None = None,
    threads: int = 1,
    binary: str | Path | None = None,
    cache_ram_mib: int | None = 0,
    parallel: int | None = None,
    extra_args: Iterable[str] = (),
) -> dict:
    """A fresh llama-server with --parallel max(N, parallel), N robots against it; loadgen.summarize's figures.

    `exact` there means: every generation's ids equal our target's greedy continuation in the trace.
    """
    from server_bridge.ops.loadtest import run_robots, summarize

    t0 = time.perf_counter()
    with LlamaServer(
        model,
        parallel=max(n, parallel or n),
        threads=threads,
        core=core,
        binary=binary,
        cache_ram_mib=cache_ram_mib,
        ctx_per_slot=_ctx_per_slot(trace, cfg.tokens),
        extra_args=extra_args,
    ) as srv:
        started = time.perf_counter() - t0
        # streams in flight after the tail don't count: 2 s to finish, then cancelled
        out = asyncio.run(run_robots(srv.url, trace, n, cfg, robot=PeerRobot, grace_s=2.0))
        tail = srv.log_tail(8) if out.errors else None
    point = {
        "pair": "llama-server",
        "target": str(model),
        "policy": "peer",
        "n": n,
        "server_start_s": round(started, 2),
        **summarize(out, trace, cfg.classes),
    }
    point["matches_trace"] = point.pop("exact")
    point["generation_records"] = [r for r in point["generation_records"] if r["in_sample"]]
    if tail:
        point["server_log_tail"] = tail
    return point


def describe_point(p: dict, classes: tuple) -> str:
    pct = lambda r: "-" if r is None else f"{100 * r:.0f}%"  # noqa: E731
    by = " ".join(f"{c}:{pct(p['violation_rate_by_class'][str(c)])}" for c in sorted(classes))
    speed = " ".join(
        f"{c}:{'-' if v is None else f'{v:.1f}'}"
        for c, v in sorted(p["speed_by_class"].items(), key=lambda kv: float(kv[0]))
    )
    flags = f"  errors {len(p['errors'])}" if p["errors"] else ""
    return (
        f"peer N={p['n']:<4} violations {pct(p['violation_rate'])} ({by}) of {p['decided']}  "
        f"tok/s by class {speed}  goodput {p['goodput_tokens_per_s']:.1f} tok/s{flags}"
    )


def fleet_capacity(
    model: str | Path,
    trace,
    cfg,
    *,
    ns: list[int] | None = None,
    max_n: int = 256,
    refine: float = 0.1,
    core: int | None = None,
    threads: int = 1,
    binary: str | Path | None = None,
    cache_ram_mib: int | None = 0,
    log: Callable[[str], None] = print,
) -> dict:
    """The largest fleet llama-server holds per SLO class (loadgen's capacity rule over the N tried).

    N runs over `ns`, or doubles from 1 until every class has failed or max_n; then, per class,
    bisects between its capacity and the next N that failed (server_bridge.ops.loadtest.capacity_search).
    Returns {"points": [...], "capacity": {class: N}, "lower_bound": {class: bool}}.
    """
    from server_bridge.ops.loadtest import capacity_search, class_passes

    points: dict[int, dict] = {}

    def run(n: int) -> dict[str, bool | None]:
        points[n] = fleet_point(
            model, trace, n, cfg, core=core, threads=threads, binary=binary, cache_ram_mib=cache_ram_mib
        )
        log(f"  {describe_point(points[n], cfg.classes)}")
        return class_passes(points[n], cfg.classes)

    caps = capacity_search(run, [str(c) for c in cfg.classes], tuple(ns or ()), 1, max_n, refine)
    return {
        "points": [points[n] for n in sorted(points)],
        "capacity": {c: v["capacity"] for c, v in caps.items()},
        "lower_bound": {c: v["lower_bound"] for c, v in caps.items()},
    }


# --------------------------------------------------------------------------- report and CLI


def _classes(result: dict) -> list:
    return result["config"]["classes"]


REPORT = harness.Report(
    "peer",
    "# The peer: llama.cpp's llama-server streaming plain AR",
    [
        harness.Table(
            "one_robot",
            [
                harness.Col("rtt_ms", "RTT ms", "{:.0f}"),
                harness.Col("tokens_per_s", "tokens/s", "{:.2f}"),
                harness.Col("first_token_ms_mean", "first token ms", "{:.0f}"),
                harness.Col("inter_token_ms_mean", "inter-token ms", "{:.1f}"),
                harness.Col("server_ms_per_token", "server ms/token", "{:.1f}"),
                harness.Col("server_prompt_ms_mean", "server prompt ms", "{:.0f}"),
                harness.Col("matches", "matches our target's greedy"),
            ],
            "## One robot ({config[prompts]} prompts x {config[tokens]} tokens, greedy, one slot)",
        ),
        harness.Table(
            "fleet_points",
            lambda r: [
                harness.Col("n", "N"),
                harness.Col("violation_rate", "violations", harness.pct),
                *[
                    col
                    for c in _classes(r)
                    for col in (
                        harness.Col(f"violation_rate_by_class.{c}", f"{c} tok/s: violations", harness.pct),
                        harness.Col(f"speed_by_class.{c}", f"{c} tok/s: mean tok/s", "{:.1f}"),
                    )
                ],
                harness.Col("goodput_tokens_per_s", "goodput tok/s", "{:.1f}"),
                harness.Col("errors", fmt=len),
            ],
            "## Fleet (classes {config[classes]} tok/s round-robin, {config[tokens]} tokens a generation, "
            "window {config[window_s]} s after {config[warmup_s]} s)",
        ),
        harness.Table(
            "fleet_capacity",
            [harness.Col("class", "SLO class"), harness.Col("held", "largest fleet held (<= 5 % violations)")],
        ),
    ],
    [
        harness.Plot(
            "one_robot",
            x="rtt_ms",
            ys={"llama-server, plain AR": "tokens_per_s"},
            xlabel="round-trip time (ms)",
            ylabel="tokens / s (one robot)",
            title="The peer: one robot through the emulated link",
        ),
        harness.Plot(
            "fleet_points",
            x="n",
            ys=lambda r: {f"class {c} tok/s": f"violation_rate_by_class.{c}" for c in _classes(r)},
            xlabel="robots (N)",
            ylabel="share of generations violating their SLO",
            title="SLO violations against fleet size (llama-server --parallel N)",
            hline=0.05,
        ),
    ],
    intro="`{config[binary_version]}`, model `{config[model_name]}`; server pinned to core {config[server_core]} "
    "with `-t {config[threads]}`, robots on core {config[client_core]}; `--cache-ram {config[cache_ram]}`; "
    "started {started}.",
)


def add_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--model", default=None, help=f"the target GGUF (default: models/build/{F32_GGUF})")
    ap.add_argument("--binary", default=None, help="llama-server (default: the cached build; see --build)")
    ap.add_argument("--build", action="store_true", help="build llama-server first if it is not cached")
    ap.add_argument("--trace", default=str(DEFAULT_TRACE), help="loadgen trace whose prompts the robots send")
    ap.add_argument("--prompts", type=int, default=10)
    ap.add_argument("--rtts", type=harness.floats, default=[0.0, 20.0, 50.0], help="RTTs (ms) for one robot")
    settings.add_flags(ap, LoadConfig, only=("tokens", "warmup_s", "window_s"))  # as `server-bridge loadtest`
    ap.add_argument("--classes", type=harness.floats, default=list(CLASSES), help="SLO classes, tokens/s")
    ap.add_argument("--n", type=harness.ints, default=[], help="fleet sizes (default: doubling from 1, bisection)")
    ap.add_argument("--max-n", type=int, default=256)
    ap.add_argument("--threads", type=int, default=1, help="llama-server -t")
    ap.add_argument("--server-core", type=int, default=None, help="default: the last core")
    ap.add_argument("--client-core", type=int, default=None, help="default: the first core")
    ap.add_argument("--cache-ram", type=int, default=0, help="llama-server --cache-ram MiB (0 = off; -1 = no limit)")
    ap.add_argument("--skip-one", action="store_true", help="skip the one-robot RTT sweep")
    ap.add_argument("--skip-fleet", action="store_true", help="skip the fleet capacity search")


def measure(args: argparse.Namespace) -> dict:
    if args.quick:  # two prompts of 8 tokens at one RTT; one fleet of 1 for 2 s
        args.rtts, args.prompts, args.tokens, args.n, args.window_s, args.warmup_s = [0.0], 2, 8, [1], 2.0, 1.0
    model = Path(args.model) if args.model else default_model()
    if model is None or not model.exists():
        raise SystemExit(f"no target GGUF: pass --model PATH (default models/build/{F32_GGUF} does not exist)")
    binary = Path(args.binary) if args.binary else (build_llama_server() if args.build else find_llama_server())
    if binary is None:
        raise SystemExit(f"llama-server {VERSION} is not built: `make llama-server` (or pass --build)")
    cpus = sorted(os.sched_getaffinity(0))
    server_core = args.server_core if args.server_core is not None else cpus[-1]
    client_core = args.client_core if args.client_core is not None else cpus[0]
    trace = load_prompts(args.trace, args.prompts)
    classes = tuple(int(c) if float(c).is_integer() else c for c in args.classes)
    cfg = LoadConfig(**settings.given(LoadConfig, args) | {"classes": classes})
    config = {
        "model": str(model),
        "model_name": model.name,
        "binary": str(binary),
        "binary_version": server_version(binary),
        "prompts": len(trace.prompts),
        "classes": list(classes),
        "server_core": server_core,
        "client_core": client_core,
        "load_config": asdict(cfg),
    }
    print(f"peer: {config['binary_version']} on {model.name}; server core {server_core}, robots {client_core}")
    result: dict = {"config": config}
    every_cpu = os.sched_getaffinity(0)
    if client_core != server_core:
        os.sched_setaffinity(0, {client_core})
    server = {"core": server_core, "threads": args.threads, "binary": binary, "cache_ram_mib": args.cache_ram}
    try:
        if not args.skip_one:
            result["one_robot"] = one_robot(model, trace, args.rtts, args.tokens, **server)
        if not args.skip_fleet:
            fleet = fleet_capacity(model, trace, cfg, ns=args.n or None, max_n=args.max_n, **server)
            result["fleet_points"] = fleet.pop("points")
            result["fleet"] = fleet
            result["fleet_capacity"] = [
                {"class": f"{c} tok/s", "held": f"{fleet['capacity'][c]}{' (lower bound)' if lb else ''}"}
                for c, lb in fleet["lower_bound"].items()
            ]
    finally:
        os.sched_setaffinity(0, every_cpu)
    config["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
    return result


def main(argv: list[str] | None = None) -> int:
    return harness.main(__doc__, REPORT, measure, add_args, argv, out="bench_results/peer", pin_cores=False)


if __name__ == "__main__":
    sys.exit(main())
