"""A peer's grammar compiled first where a crash, a runaway or a flood costs only that peer's request.

LLGuidance's compiler is native code: a schema within every byte cap can still overflow its stack (a `$ref` chain of
4,000 definitions killed both the robot's daemon and the verifier with SIGSEGV) or run for seconds, and a thread
cannot be stopped. So a grammar that is not in the cache is compiled first by a `CompilePool`: a few worker
processes (protocol/compile_worker.py), each with the model's vocabulary, a memory cap and a smaller stack than
the serving process gives its own compile. A worker that crashes or passes the deadline is killed, and its death
is that request's refusal (GrammarError: the wire's bad_field, the endpoint's 400, the Python API's RequestError).
Only what compiled and took its first mask in a worker is compiled in the serving process.

Fair: compile work is shared between peers (a connection's credential, an endpoint's caller) in turns, and a peer
holds at most one worker at a time, counting a worker its own request killed until that worker is back. With two
workers, one peer's slow grammars never keep another peer's schema from a worker for longer than one deadline.
Bounded: a peer waits with at most MAX_WAITING_PER_PEER requests, all peers with MAX_WAITING, each for at most
QUEUE_TIMEOUT_S; past those it is refused at once (retry).

Pools are kept per vocabulary file (`pool_for`), started at the first grammar; a worker idle for IDLE_EXIT_S is
stopped and started again at the next grammar, and every worker leaves when the serving process does (its
requests' pipe closes).
"""

from __future__ import annotations

import logging
import os
import select
import signal
import struct
import subprocess
import sys
import threading
import time
from collections import OrderedDict, deque
from pathlib import Path
from typing import Any, BinaryIO

from .grammar import GrammarError, SchemaError

log = logging.getLogger(__name__)

WORKERS = 2  # per vocabulary: a flooding peer holds one, the rest serve everyone else
MAX_WAITING_PER_PEER = 2  # requests of one peer waiting for a worker; more are refused at once
MAX_WAITING = 64  # requests of all peers waiting
QUEUE_TIMEOUT_S = 15.0  # one request's wait for its turn (a first use waits for the workers to start: ~1-2 s)
START_TIMEOUT_S = 60.0  # a worker's start (Python, llama.cpp's vocabulary, LLGuidance's tokenizer)
WORKER_STACK_BYTES = 4 << 20  # a worker's compile thread; the serving process gives its own 4x that
WORKER_MEMORY_BYTES = 1 << 30  # address space a worker's compile may add to what the worker holds at rest
MAX_REPLY_BYTES = 64 << 10
MAX_POOLS = 4  # vocabularies with a pool; the least recently used one closes past it
RESTART_BACKOFF_S = 5.0  # a worker that could not start is tried again no sooner
IDLE_EXIT_S = 120.0  # a worker idle this long is stopped (~90 MB each), and started again at the next grammar
MAX_REQUEST_BYTES = 4 << 20  # a grammar's text is at most 1 MiB (structured.MAX_SCHEMA_BYTES); msgpack adds little


def read_frame(stream: BinaryIO, limit: int) -> dict[str, Any] | None:
    """The next frame's map; None at the end of the stream (the serving process has gone)."""
    import msgpack

    head = stream.read(4)
    if len(head) < 4:
        return None
    (n,) = struct.unpack(">I", head)
    if n > limit:
        raise ValueError(f"a frame of {n} bytes; at most {limit}")
    body = stream.read(n)
    if len(body) < n:
        return None
    value = msgpack.unpackb(body, raw=False, max_str_len=limit, max_bin_len=0, max_array_len=0, max_map_len=16)
    if not isinstance(value, dict):
        raise ValueError("a frame is a map")
    return value


def frame(value: dict[str, Any]) -> bytes:
    import msgpack

    body: bytes = msgpack.packb(value, use_bin_type=True)
    return struct.pack(">I", len(body)) + body


class _Worker:
    """One worker process and who holds it. States: stopped (never started, or retired idle), starting, idle, busy,
    broken (could not start: tried again after RESTART_BACKOFF_S)."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen[bytes] | None = None
        self.state = "stopped"
        self.idle_since = 0.0
        self.peer: str | None = None  # busy: the peer compiling; starting: the peer whose request killed it
        self.error = ""
        self.failed_at = 0.0


class CompilePool:
    """Worker processes compiling grammars over the vocabulary of one GGUF, `n_vocab` wide."""

    def __init__(self, gguf: str | os.PathLike[str], n_vocab: int, workers: int = WORKERS) -> None:
        self.gguf, self.n_vocab = str(gguf), int(n_vocab)
        self._workers = [_Worker() for _ in range(max(1, workers))]
        self._waiting: OrderedDict[str, deque[object]] = OrderedDict()  # peer -> its tickets; order = turns
        self._cv = threading.Condition()
        self._closed = False
        self._reaper: threading.Thread | None = None

    # ------------------------------------------------------------------ the one call

    def check(self, kind: str, text: str, peer: str = "", timeout_s: float = 0.9) -> None:
        """Compile `text` of `kind` in a worker; returns when it compiled and took its first mask there, raises
        its GrammarError (SchemaError) otherwise: the compiler's own refusal, or its crash or runaway."""
        worker = self._turn(peer)
        t0 = time.monotonic()
        try:
            reply = self._ask(worker, {"kind": kind, "text": text}, timeout_s)
        except _Died as e:
            self._restart(worker, peer)
            refusal = SchemaError if kind == "json_schema" else GrammarError  # as a compile's own refusal is typed
            if e.timed_out:
                waited = time.monotonic() - t0
                raise refusal(f"the grammar took over {waited:.2g} s to compile and was stopped; simplify it") from None
            raise refusal(
                f"the grammar crashed the compiler ({e.reason}: too deep a recursion or too much memory); simplify it"
            ) from None
        except BaseException:  # (a KeyboardInterrupt mid-request): the worker's state is unknown, so it goes
            self._restart(worker, peer)
            raise
        self._release(worker)
        if reply.get("ok"):
            return
        message = str(reply.get("message", "the grammar does not compile"))
        if reply.get("error") == "SchemaError":
            raise SchemaError.restored(message, reply.get("keyword"), str(reply.get("where") or ""))
        raise GrammarError(message)

    def close(self) -> None:
        with self._cv:
            self._closed = True
            workers = [w.proc for w in self._workers if w.proc is not None]
            self._cv.notify_all()
        for proc in workers:
            _kill(proc)

    # ------------------------------------------------------------------ turns

    def _turn(self, peer: str) -> _Worker:
        """An idle worker, once it is `peer`'s turn; GrammarError when the wait is over its bounds."""
        ticket = object()
        with self._cv:
            queue = self._waiting.get(peer)
            if queue is not None and len(queue) >= MAX_WAITING_PER_PEER:
                raise GrammarError(
                    f"{MAX_WAITING_PER_PEER} grammars of this peer are waiting to compile already; retry after them"
                )
            if sum(len(q) for q in self._waiting.values()) >= MAX_WAITING:
                raise GrammarError(f"{MAX_WAITING} grammars are waiting to compile; retry")
            self._waiting.setdefault(peer, deque()).append(ticket)
            deadline = time.monotonic() + QUEUE_TIMEOUT_S
            try:
                while True:
                    if self._closed:
                        raise GrammarError("the grammar compiler has stopped")
                    self._start_missing()
                    worker = self._grant(peer, ticket)
                    if worker is not None:
                        return worker
                    if all(w.state == "broken" for w in self._workers):
                        raise GrammarError(f"the grammar compiler could not start: {self._workers[0].error}")
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise GrammarError(f"the grammar compiler is busy (waited {QUEUE_TIMEOUT_S:g} s); retry")
                    self._cv.wait(min(left, RESTART_BACKOFF_S))
            finally:
                queue = self._waiting.get(peer)
                if queue is not None and ticket in queue:
                    queue.remove(ticket)
                if queue is not None and not queue:
                    del self._waiting[peer]
                self._cv.notify_all()  # the next in turn may go

    def _grant(self, peer: str, ticket: object) -> _Worker | None:
        """Under the lock: an idle worker for `ticket` if it heads the queue of the first peer in turn that holds no
        worker; that peer goes to the back of the turns."""
        idle = next((w for w in self._workers if w.state == "idle"), None)
        if idle is None:
            return None
        for p, queue in self._waiting.items():
            if queue and not self._holds(p):
                if p != peer or queue[0] is not ticket:
                    return None  # another request's turn
                queue.popleft()
                self._waiting.move_to_end(p)
                idle.state, idle.peer = "busy", peer
                return idle
        return None

    def _holds(self, peer: str) -> bool:
        return any(w.peer == peer and w.state in ("busy", "starting") for w in self._workers)

    def _release(self, worker: _Worker) -> None:
        with self._cv:
            worker.state, worker.peer, worker.idle_since = "idle", None, time.monotonic()
            self._cv.notify_all()

    # ------------------------------------------------------------------ workers

    def _start_missing(self) -> None:
        """Under the lock: every worker that is not running started (a broken one after its backoff)."""
        for w in self._workers:
            if w.state == "stopped" or (w.state == "broken" and time.monotonic() - w.failed_at >= RESTART_BACKOFF_S):
                self._spawn(w, None)
        if self._reaper is None:
            self._reaper = threading.Thread(target=self._retire_idle, name="grammar-reaper", daemon=True)
            self._reaper.start()

    def _retire_idle(self) -> None:
        """Workers idle for IDLE_EXIT_S stopped (a robot that compiles one schema an hour holds no processes for
        it); started again at the next grammar."""
        while True:
            with self._cv:
                if self._cv.wait_for(lambda: self._closed, IDLE_EXIT_S / 4):
                    return
                now = time.monotonic()
                idle: list[subprocess.Popen[bytes]] = []
                for w in self._workers:
                    if w.state == "idle" and now - w.idle_since >= IDLE_EXIT_S and w.proc is not None:
                        idle.append(w.proc)
                        w.state, w.proc = "stopped", None
            for proc in idle:
                _kill(proc)

    def _restart(self, worker: _Worker, peer: str) -> None:
        """The worker killed, and started again while counted as `peer`'s (its request killed it)."""
        if worker.proc is not None:
            _kill(worker.proc)
        with self._cv:
            if not self._closed:
                self._spawn(worker, peer)
            self._cv.notify_all()

    def _spawn(self, worker: _Worker, peer: str | None) -> None:
        """Under the lock: a new process for `worker`, ready when its first frame arrives (in a thread of its own)."""
        worker.state, worker.peer = "starting", peer
        cmd = [
            sys.executable,
            "-m",
            "protocol.compile_worker",
            self.gguf,
            str(self.n_vocab),
            str(WORKER_STACK_BYTES),
            str(WORKER_MEMORY_BYTES),
        ]
        try:
            proc = subprocess.Popen(
                cmd,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=None if os.environ.get("EDGESPEC_VERBOSE") else subprocess.DEVNULL,
                cwd=str(Path(__file__).resolve().parents[1]),  # protocol/ importable whatever the caller's cwd
                start_new_session=True,  # a terminal's Ctrl-C goes to the serving process, which ends it
            )
        except OSError as e:
            worker.state, worker.error, worker.failed_at = "broken", f"{type(e).__name__}: {e}", time.monotonic()
            return
        worker.proc = proc
        starter = threading.Thread(target=self._await_ready, args=(worker, proc), name="grammar-start", daemon=True)
        starter.start()

    def _await_ready(self, worker: _Worker, proc: subprocess.Popen[bytes]) -> None:
        try:
            reply = _read_reply(proc, time.monotonic() + START_TIMEOUT_S)
            ok, error = bool(reply.get("ready")), ""
        except _Died as e:
            ok, error = False, e.reason
        if not ok:
            _kill(proc)
            log.warning("a grammar-compile worker for %s did not start: %s", self.gguf, error or "no ready frame")
        with self._cv:
            if worker.proc is proc:
                if ok:
                    worker.state, worker.peer, worker.idle_since = "idle", None, time.monotonic()
                else:
                    worker.state, worker.peer = "broken", None
                    worker.error, worker.failed_at = error or "it sent no ready frame", time.monotonic()
            self._cv.notify_all()

    def _ask(self, worker: _Worker, request: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        proc = worker.proc
        assert proc is not None and proc.stdin is not None
        deadline = time.monotonic() + timeout_s
        try:
            proc.stdin.write(frame(request))
            proc.stdin.flush()
        except OSError:
            raise _Died(_ended(proc)) from None
        return _read_reply(proc, deadline)


class _Died(Exception):
    def __init__(self, reason: str, timed_out: bool = False) -> None:
        super().__init__(reason)
        self.reason, self.timed_out = reason, timed_out


def _read_reply(proc: subprocess.Popen[bytes], deadline: float) -> dict[str, Any]:
    """The worker's next frame, read by `deadline`; _Died when it ends, passes the deadline or sends garbage."""
    import msgpack

    assert proc.stdout is not None
    fd = proc.stdout.fileno()
    buf = b""
    need = 4
    while len(buf) < need:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            raise _Died("past its deadline", timed_out=True)
        chunk = os.read(fd, need - len(buf))
        if not chunk:
            raise _Died(_ended(proc))
        buf += chunk
        if need == 4 and len(buf) == 4:
            (n,) = struct.unpack(">I", buf)
            if n > MAX_REPLY_BYTES:
                raise _Died(f"a reply of {n} bytes")
            need, buf = n, b""
            if n == 0:
                break
    try:
        value = msgpack.unpackb(buf, raw=False)
    except Exception:
        raise _Died("an unreadable reply") from None
    if not isinstance(value, dict):
        raise _Died("an unreadable reply")
    return value


def _ended(proc: subprocess.Popen[bytes]) -> str:
    """How a worker ended: its signal's name, or its exit status."""
    try:
        code = proc.wait(2.0)
    except subprocess.TimeoutExpired:
        return "it stopped answering"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with {code}"


def _kill(proc: subprocess.Popen[bytes]) -> None:
    try:
        proc.kill()
        proc.wait(5.0)
    except (OSError, subprocess.TimeoutExpired):
        pass
    for pipe in (proc.stdin, proc.stdout):
        if pipe is not None:
            try:
                pipe.close()
            except OSError:
                pass


_pools: OrderedDict[tuple[str, int], CompilePool] = OrderedDict()
_pools_lock = threading.Lock()


def pool_for(gguf: str | os.PathLike[str], n_vocab: int) -> CompilePool:
    """The pool of the vocabulary in `gguf` (n_vocab wide), shared by every Vocabulary over that file."""
    key = (str(Path(gguf).resolve()), int(n_vocab))
    with _pools_lock:
        pool = _pools.get(key)
        if pool is None:
            pool = _pools[key] = CompilePool(key[0], key[1])
            while len(_pools) > MAX_POOLS:
                _, old = _pools.popitem(last=False)
                old.close()
        _pools.move_to_end(key)
        return pool
