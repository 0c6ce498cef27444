"""Loopback TCP proxy that emulates a slow, jittery, flaky link.

Why this exists: the edge<->server speculative-decoding protocol is bound by
round trips, so tests and benchmarks need a reproducible "bad network" that
runs without root, tc or network namespaces. The proxy sits between a client
and an upstream server on 127.0.0.1 and, per direction, holds every chunk it
reads until the emulated link would have delivered it.

Timing model (per direction, times from ``loop.time()`` in seconds)::

    tx_start = max(t_read, wire_free)            # FIFO wire: one chunk at a time
    tx_end   = tx_start + nbytes * 8 / (mbps * 1e6)
    deliver  = max(tx_end + delay + U(-jitter, +jitter), previous_deliver)

i.e. serialization then propagation, as on a real link. The clamp to the
previous delivery time means jitter stretches gaps but never reorders bytes,
because TCP cannot reorder them either.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import itertools
import logging
import math
import random
import socket
import struct
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional, TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")

_READ_CHUNK = 64 * 1024  # bytes: largest single read from a socket
_WIRE_QUANTUM_S = 0.005  # s: with a bandwidth cap, read ~5 ms of wire time per chunk
_MIN_QUANTUM = 1024  # bytes: floor for that quantum at very low rates
_CLOSE_GRACE_S = 5.0  # s: how long a graceful close may flush before we abort
_CONTROL_TIMEOUT_S = 5.0  # s: how long a control call waits for the loop thread


# --------------------------------------------------------------------------
# Link profile and the per-direction wire clock
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class LinkProfile:
    """Shape of one emulated link; the same values apply in each direction."""

    one_way_delay_ms: float = 0.0  # ms, applied in each direction; RTT = 2x
    jitter_ms: float = 0.0  # ms, uniform +-jitter per chunk; order preserved
    bandwidth_mbps: float = 0.0  # Mbit/s per direction; 0 = unlimited

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            _check_non_negative(f"LinkProfile.{f.name}", getattr(self, f.name))

    @classmethod
    def from_rtt(cls, rtt_ms: float, jitter_ms: float = 0.0, bandwidth_mbps: float = 0.0) -> "LinkProfile":
        """Profile whose idle round-trip time is ``rtt_ms`` (half each way)."""
        _check_non_negative("rtt_ms", rtt_ms)
        return cls(rtt_ms / 2.0, jitter_ms, bandwidth_mbps)

    @property
    def rtt_ms(self) -> float:
        return 2.0 * self.one_way_delay_ms

    def serialization_s(self, nbytes: int) -> float:
        """Seconds the wire is busy sending ``nbytes``."""
        if self.bandwidth_mbps == 0:
            return 0.0
        return nbytes * 8 / (self.bandwidth_mbps * 1e6)

    def read_quantum(self) -> int:
        """Bytes per chunk; small under a bandwidth cap so delivery is smooth."""
        if self.bandwidth_mbps == 0:
            return _READ_CHUNK
        per_quantum = int(self.bandwidth_mbps * 1e6 / 8 * _WIRE_QUANTUM_S)
        return max(_MIN_QUANTUM, min(_READ_CHUNK, per_quantum))


def _check_non_negative(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be finite and >= 0, got {value!r}")


@dataclass
class _WireClock:
    """Per-direction state of the FIFO wire (seconds on the loop clock)."""

    wire_free: float = -math.inf  # when the wire finishes the last chunk
    last_delivery: float = -math.inf  # delivery time of the previous chunk

    def schedule(self, nbytes: int, now: float, profile: LinkProfile, rng: random.Random) -> float:
        """Return the loop time at which a chunk read at ``now`` is written."""
        tx_end = max(now, self.wire_free) + profile.serialization_s(nbytes)
        self.wire_free = tx_end
        jitter = rng.uniform(-profile.jitter_ms, profile.jitter_ms) if profile.jitter_ms else 0.0
        propagation = max(0.0, (profile.one_way_delay_ms + jitter) / 1000.0)
        deliver = max(tx_end + propagation, self.last_delivery)
        self.last_delivery = deliver
        return deliver


# --------------------------------------------------------------------------
# Counters shared between the loop thread and callers
# --------------------------------------------------------------------------


@dataclass
class _Stats:
    """Counters written on the loop thread and read from any thread."""

    connections_total: int = 0  # accepted client connections (incl. refused)
    connections_open: int = 0  # currently proxied
    connections_refused: int = 0  # closed at once: refuse_new() or upstream down
    bytes_up: int = 0  # client -> server, delivered
    bytes_down: int = 0  # server -> client, delivered
    chunks_up: int = 0  # delivered chunks (each got its own jitter)
    chunks_down: int = 0
    disconnects_injected: int = 0  # connections killed by disconnect/drop_prob
    buffered_bytes_peak: int = 0  # max bytes held in one direction of one conn
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock, repr=False)

    def add(self, **deltas: int) -> None:
        with self.lock:
            for name, delta in deltas.items():
                setattr(self, name, getattr(self, name) + delta)

    def note_buffered(self, nbytes: int) -> None:
        with self.lock:
            self.buffered_bytes_peak = max(self.buffered_bytes_peak, nbytes)

    def snapshot(self) -> dict[str, int]:
        with self.lock:
            return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "lock"}


@dataclass
class _DisconnectTrigger:
    """One-shot 'drop everything' armed by schedule_disconnect()."""

    bytes_left: Optional[int]  # server->client bytes still allowed
    timer: Optional[asyncio.TimerHandle] = None

    def cancel(self) -> None:
        if self.timer is not None:
            self.timer.cancel()


def _reset(writer: asyncio.StreamWriter) -> None:
    """Close abruptly: SO_LINGER=0 makes the kernel send RST, like a dead link."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


async def _wait_closed(writer: asyncio.StreamWriter) -> None:
    """Wait until the transport is gone; abort if a peer stalls the flush."""
    try:
        await asyncio.wait_for(writer.wait_closed(), _CLOSE_GRACE_S)
    except asyncio.TimeoutError:
        _reset(writer)
        with contextlib.suppress(Exception):
            await writer.wait_closed()
    except (ConnectionError, OSError):
        pass


# --------------------------------------------------------------------------
# One direction of one connection
# --------------------------------------------------------------------------

_EOF = None  # queue sentinel: the source half-closed


class _Pipe:
    """One direction: a pump that timestamps chunks and one writer that releases them.

    Why a single writer per direction: ordering holds by construction and we
    sleep once per chunk, never per byte. Bytes held between the two
    (``in_flight``) are capped; at the cap the pump stops reading, so the
    source sees TCP backpressure instead of the proxy growing without bound.
    """

    def __init__(
        self, conn: "_Connection", direction: str, src: asyncio.StreamReader, dst: asyncio.StreamWriter
    ) -> None:
        self.conn = conn
        self.direction = direction  # "up" (client->server) or "down"
        self.src = src
        self.dst = dst
        self.clock = _WireClock()
        self.queue: asyncio.Queue[tuple[float, Optional[bytes]]] = asyncio.Queue()
        self.in_flight = 0  # bytes read but not yet written
        self.delivered = 0  # bytes written to dst
        self.room = asyncio.Event()

    async def pump(self) -> None:
        proxy = self.conn.proxy
        loop = asyncio.get_running_loop()
        while True:
            await self._wait_for_room(proxy.max_buffered_bytes)
            room = proxy.max_buffered_bytes - self.in_flight
            data = await self.src.read(min(proxy.profile.read_quantum(), room))
            now = loop.time()
            profile = proxy.profile  # re-read: set_profile() may have run meanwhile
            if not data:
                self.queue.put_nowait((self.clock.schedule(0, now, profile, proxy.rng), _EOF))
                return
            if proxy._roll_drop():
                self.conn.abort(f"drop_prob ({self.direction})", injected=True)
                return
            self.in_flight += len(data)
            proxy._stats.note_buffered(self.in_flight)
            deliver_at = self.clock.schedule(len(data), now, profile, proxy.rng)
            self.queue.put_nowait((deliver_at, data))

    async def _wait_for_room(self, cap: int) -> None:
        while self.in_flight >= cap:
            self.room.clear()
            await self.room.wait()

    async def deliver(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            deliver_at, data = await self.queue.get()
            wait = deliver_at - loop.time()
            if wait > 0:
                await asyncio.sleep(wait)
            if data is _EOF:
                self._forward_eof()
                return
            if not await self._write(data):
                return

    async def _write(self, data: bytes) -> bool:
        """Write one chunk; False when a scheduled disconnect fired on it."""
        held = len(data)
        data, fire = self.conn.proxy._pass_bytes(self.direction, data)
        if data:
            self.dst.write(data)
            await self.dst.drain()
            self.delivered += len(data)
        self.in_flight -= held
        self.room.set()
        if fire:
            self.conn.proxy._drop_all("schedule_disconnect(after_bytes_down)")
            return False
        return True

    def _forward_eof(self) -> None:
        """Propagate a half-close; the connection ends once both sides did."""
        if self.dst.can_write_eof() and not self.dst.transport.is_closing():
            self.dst.write_eof()
        self.conn.direction_done(self.direction)


# --------------------------------------------------------------------------
# One proxied connection
# --------------------------------------------------------------------------


class _Connection:
    """A client socket spliced to an upstream socket through two pipes."""

    def __init__(
        self,
        proxy: "NetemProxy",
        cid: int,
        client: tuple[asyncio.StreamReader, asyncio.StreamWriter],
        upstream: tuple[asyncio.StreamReader, asyncio.StreamWriter],
    ) -> None:
        self.proxy = proxy
        self.cid = cid
        self.writers = (client[1], upstream[1])
        self.up = _Pipe(self, "up", client[0], upstream[1])
        self.down = _Pipe(self, "down", upstream[0], client[1])
        self.tasks: list[asyncio.Task[None]] = []
        self.done_directions: set[str] = set()
        self.closed = False
        self.reason = "open"
        self.started = time.monotonic()

    async def run(self) -> None:
        steps = (self.up.pump, self.up.deliver, self.down.pump, self.down.deliver)
        self.tasks = [asyncio.create_task(self._guard(step), name=self._task_name(step)) for step in steps]
        try:
            await asyncio.gather(*self.tasks, return_exceptions=True)
        finally:
            self.abort("proxy shutdown", injected=False)
            for writer in self.writers:
                await _wait_closed(writer)

    def _task_name(self, step: Callable[[], Any]) -> str:
        return f"netem-{self.cid}-{step.__self__.direction}-{step.__name__}"

    async def _guard(self, step: Callable[[], Any]) -> None:
        """Any socket error on either side tears down both sides."""
        try:
            await step()
        except (ConnectionError, OSError) as exc:
            self.abort(f"{type(exc).__name__} ({step.__name__})", injected=False)
        except Exception:
            log.exception("netem conn %d: internal error", self.cid)
            self.abort("internal error", injected=False)

    def direction_done(self, direction: str) -> None:
        self.done_directions.add(direction)
        if len(self.done_directions) == 2 and not self.closed:
            self.closed, self.reason = True, "eof"
            for writer in self.writers:
                writer.close()

    def abort(self, reason: str, injected: bool) -> None:
        """Drop both sides at once (RST) and stop every task but the caller."""
        if self.closed:
            return
        self.closed, self.reason = True, reason
        if injected:
            self.proxy._stats.add(disconnects_injected=1)
        for writer in self.writers:
            _reset(writer)
        current = asyncio.current_task()
        for task in self.tasks:
            if task is not current:
                task.cancel()


# --------------------------------------------------------------------------
# The proxy
# --------------------------------------------------------------------------


class NetemProxy:
    """TCP proxy on its own event-loop thread that shapes traffic to ``upstream``.

    Use as a context manager, or ``start()`` / ``stop()``. All control methods
    are safe to call from any thread (the test's thread, typically).
    """

    def __init__(
        self,
        upstream_host: str,
        upstream_port: int,
        profile: LinkProfile = LinkProfile(),
        listen_host: str = "127.0.0.1",
        listen_port: int = 0,
        seed: int = 0,
        max_buffered_bytes: int = 8 * 2**20,
        drop_prob: float = 0.0,
    ) -> None:
        if not isinstance(profile, LinkProfile):
            raise TypeError(f"profile must be a LinkProfile, got {type(profile).__name__}")
        if not isinstance(max_buffered_bytes, int) or max_buffered_bytes <= 0:
            raise ValueError(f"max_buffered_bytes must be a positive int, got {max_buffered_bytes!r}")
        self.upstream_host = upstream_host
        self.upstream_port = upstream_port
        self.listen_host = listen_host
        self.max_buffered_bytes = max_buffered_bytes  # bytes per direction per connection
        self.profile = profile  # read by pumps for every chunk
        self.rng = random.Random(seed)  # used on the loop thread only
        self.drop_prob = _check_prob(drop_prob)
        self._listen_port = listen_port
        self._port: Optional[int] = None
        self._refusing = False
        self._stats = _Stats()
        self._ids = itertools.count(1)
        self._thread: Optional[threading.Thread] = None
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._stop_event: Optional[asyncio.Event] = None
        self._ready = threading.Event()
        self._startup_error: Optional[BaseException] = None
        # Loop-thread-only state.
        self._conns: set[_Connection] = set()
        self._pending: set[asyncio.StreamWriter] = set()  # clients awaiting upstream
        self._handlers: set[asyncio.Task[None]] = set()
        self._accepted: set[asyncio.StreamWriter] = set()  # client sockets not yet closed
        self._trigger: Optional[_DisconnectTrigger] = None

    # ---- lifecycle -------------------------------------------------------

    def start(self, timeout: float = 10.0) -> "NetemProxy":
        """Start the loop thread; returns once the socket is listening."""
        if self._thread is not None:
            raise RuntimeError("NetemProxy already started")
        self._thread = threading.Thread(
            target=self._thread_main, daemon=True, name=f"netem-proxy->{self.upstream_host}:{self.upstream_port}"
        )
        self._thread.start()
        if not self._ready.wait(timeout):
            raise RuntimeError("NetemProxy did not start listening in time")
        if self._startup_error is not None:
            self._thread.join(timeout)
            raise self._startup_error
        return self

    def stop(self, timeout: float = 5.0) -> None:
        """Close the listener and every connection, then join the thread."""
        thread = self._thread
        if thread is None or not thread.is_alive():
            return
        if threading.current_thread() is thread:
            raise RuntimeError("stop() cannot be called from the proxy's own loop")
        loop, stop_event = self._loop, self._stop_event
        if loop is not None and stop_event is not None:
            with contextlib.suppress(RuntimeError):  # loop already closed
                loop.call_soon_threadsafe(stop_event.set)
        thread.join(timeout)
        if thread.is_alive():
            log.warning("netem proxy thread did not exit within %.1f s", timeout)

    def __enter__(self) -> "NetemProxy":
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    # ---- addresses -------------------------------------------------------

    @property
    def port(self) -> int:
        if self._port is None:
            raise RuntimeError("NetemProxy is not listening yet; call start()")
        return self._port

    @property
    def address(self) -> str:
        """``host:port`` that clients should connect to."""
        host = f"[{self.listen_host}]" if ":" in self.listen_host else self.listen_host
        return f"{host}:{self.port}"

    def url(self, scheme: str = "ws", path: str = "") -> str:
        return f"{scheme}://{self.address}{path}"

    # ---- controls (any thread) ------------------------------------------

    def set_profile(self, profile: LinkProfile) -> None:
        """New link shape; applies to chunks read from now on."""
        if not isinstance(profile, LinkProfile):
            raise TypeError(f"profile must be a LinkProfile, got {type(profile).__name__}")
        self.profile = profile  # a single attribute store: atomic for readers

    def set_drop_prob(self, drop_prob: float) -> None:
        """Per-chunk probability of killing that connection (chaos, not loss)."""
        self.drop_prob = _check_prob(drop_prob)

    def refuse_new(self, flag: bool) -> None:
        """While True, accept new connections and close them at once."""
        self._refusing = bool(flag)

    def disconnect_all(self) -> int:
        """Abruptly drop every connection (client sees a reset); returns how many."""
        if not self._running():
            return 0
        return self._call_in_loop(self._drop_all, "disconnect_all()")

    def schedule_disconnect(self, after_bytes_down: Optional[int] = None, after_s: Optional[float] = None) -> None:
        """One-shot drop of all connections after N more server->client bytes
        or after ``after_s`` seconds, whichever comes first. Replaces any
        earlier schedule."""
        if after_bytes_down is None and after_s is None:
            raise ValueError("give after_bytes_down and/or after_s")
        if after_bytes_down is not None:
            if isinstance(after_bytes_down, bool) or not isinstance(after_bytes_down, int) or after_bytes_down < 0:
                raise ValueError(f"after_bytes_down must be an int >= 0, got {after_bytes_down!r}")
        if after_s is not None:
            _check_non_negative("after_s", after_s)
        if not self._running():
            raise RuntimeError("NetemProxy is not running; call start() first")
        self._call_in_loop(self._arm_trigger, after_bytes_down, after_s)

    def stats(self) -> dict[str, int]:
        """Snapshot of the counters (see ``_Stats`` for their meaning)."""
        return self._stats.snapshot()

    # ---- loop thread -----------------------------------------------------

    def _thread_main(self) -> None:
        try:
            asyncio.run(self._serve())
        except BaseException as exc:  # surfaced by start() if it failed there
            if not self._ready.is_set():
                self._startup_error = exc
            else:
                log.exception("netem proxy loop crashed")
        finally:
            self._ready.set()

    async def _serve(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop_event = asyncio.Event()
        server = await asyncio.start_server(self._on_accept, self.listen_host, self._listen_port)
        self._port = server.sockets[0].getsockname()[1]
        self._ready.set()
        try:
            await self._stop_event.wait()
        finally:
            server.close()
            if self._trigger is not None:
                self._trigger.cancel()
            await self._close_all()
            await server.wait_closed()

    async def _close_all(self) -> None:
        """Shutdown: cancel handlers, then reset sockets whose handler never ran."""
        await asyncio.sleep(0)  # let accepts already in progress reach _on_accept
        handlers = list(self._handlers)
        for task in handlers:
            task.cancel()
        await asyncio.gather(*handlers, return_exceptions=True)
        leftovers = list(self._accepted)
        for writer in leftovers:
            _reset(writer)
        for writer in leftovers:
            await _wait_closed(writer)

    def _running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self._loop is not None

    def _call_in_loop(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn`` on the loop thread and return its result synchronously."""
        if threading.current_thread() is self._thread:
            return fn(*args)
        future: concurrent.futures.Future[T] = concurrent.futures.Future()

        def run() -> None:
            try:
                future.set_result(fn(*args))
            except BaseException as exc:
                future.set_exception(exc)

        assert self._loop is not None
        self._loop.call_soon_threadsafe(run)
        return future.result(_CONTROL_TIMEOUT_S)

    def _on_accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Synchronous accept hook: registers the socket before any await,
        so shutdown can close it even if its handler never got to run."""
        self._accepted.add(writer)
        task = asyncio.get_running_loop().create_task(self._handle_client(reader, writer))
        self._handlers.add(task)
        task.add_done_callback(self._handlers.discard)

    async def _handle_client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await self._serve_client(reader, writer)
        finally:
            if not writer.transport.is_closing():
                _reset(writer)
            await _wait_closed(writer)
            self._accepted.discard(writer)

    async def _serve_client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        cid = next(self._ids)
        peer = writer.get_extra_info("peername")
        self._stats.add(connections_total=1)
        if self._refusing:
            self._refuse(cid, peer, writer, "refuse_new(True)")
            return
        upstream = await self._open_upstream(cid, peer, writer)
        if upstream is None:
            return
        conn = _Connection(self, cid, (reader, writer), upstream)
        self._conns.add(conn)
        self._stats.add(connections_open=1)
        log.info("netem conn %d open: %s -> %s:%s", cid, _fmt(peer), self.upstream_host, self.upstream_port)
        try:
            await conn.run()
        finally:
            self._conns.discard(conn)
            self._stats.add(connections_open=-1)
            log.info(
                "netem conn %d closed (%s): up=%dB down=%dB after %.2fs",
                cid,
                conn.reason,
                conn.up.delivered,
                conn.down.delivered,
                time.monotonic() - conn.started,
            )

    async def _open_upstream(
        self, cid: int, peer: Any, writer: asyncio.StreamWriter
    ) -> Optional[tuple[asyncio.StreamReader, asyncio.StreamWriter]]:
        self._pending.add(writer)
        try:
            upstream = await asyncio.open_connection(self.upstream_host, self.upstream_port)
        except OSError as exc:
            self._refuse(cid, peer, writer, f"upstream unreachable: {exc}")
            return None
        finally:
            self._pending.discard(writer)
        if writer.transport.is_closing():  # dropped while we were connecting
            _reset(upstream[1])
            await _wait_closed(upstream[1])
            return None
        return upstream

    def _refuse(self, cid: int, peer: Any, writer: asyncio.StreamWriter, why: str) -> None:
        self._stats.add(connections_refused=1)
        log.info("netem conn %d from %s refused: %s", cid, _fmt(peer), why)
        _reset(writer)

    def _drop_all(self, reason: str) -> int:
        """Loop thread: kill every proxied (and half-accepted) connection."""
        conns, pending = list(self._conns), list(self._pending)
        for conn in conns:
            conn.abort(f"injected: {reason}", injected=True)
        for writer in pending:
            _reset(writer)
        if pending:
            self._stats.add(disconnects_injected=len(pending))
        return len(conns) + len(pending)

    def _arm_trigger(self, after_bytes_down: Optional[int], after_s: Optional[float]) -> None:
        if self._trigger is not None:
            self._trigger.cancel()
        if after_bytes_down == 0:
            self._trigger = None
            self._drop_all("schedule_disconnect(after_bytes_down=0)")
            return
        trigger = _DisconnectTrigger(bytes_left=after_bytes_down)
        if after_s is not None:
            assert self._loop is not None
            trigger.timer = self._loop.call_later(after_s, self._fire_timer, trigger)
        self._trigger = trigger

    def _fire_timer(self, trigger: _DisconnectTrigger) -> None:
        if self._trigger is trigger:
            self._trigger = None
            self._drop_all("schedule_disconnect(after_s)")

    def _pass_bytes(self, direction: str, data: bytes) -> tuple[bytes, bool]:
        """Count delivered bytes; cut the chunk where a byte trigger fires.

        Returns (bytes to write, whether to drop everything after writing).
        """
        fire = False
        trigger = self._trigger
        if direction == "down" and trigger is not None and trigger.bytes_left is not None:
            if len(data) >= trigger.bytes_left:
                data, fire = data[: trigger.bytes_left], True
                trigger.cancel()
                self._trigger = None
            else:
                trigger.bytes_left -= len(data)
        if direction == "up":
            self._stats.add(bytes_up=len(data), chunks_up=1)
        else:
            self._stats.add(bytes_down=len(data), chunks_down=1)
        return data, fire

    def _roll_drop(self) -> bool:
        prob = self.drop_prob
        return prob > 0 and self.rng.random() < prob


def _check_prob(value: Any) -> float:
    _check_non_negative("drop_prob", value)
    if value > 1:
        raise ValueError(f"drop_prob must be <= 1, got {value!r}")
    return float(value)


def _fmt(peer: Any) -> str:
    if isinstance(peer, tuple) and len(peer) >= 2:
        return f"{peer[0]}:{peer[1]}"
    return str(peer)
