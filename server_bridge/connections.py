"""Each connection's life: hello, welcome, its requests one at a time, its end; and the drain that hands every
robot here to the other replicas.

One handler per connection reads frames in order; every bad frame gets an `error` on that connection and the
handler goes on (or closes, for a failed handshake or an error in FATAL), so one robot's garbage never touches
another's session. A connection's sessions outlive it for `detached_grace_s`, so a robot back after a blip
finds its KV.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time

from websockets.asyncio.server import ServerConnection
from websockets.exceptions import ConnectionClosed

from protocol import wire

from .admission import Admission, Replica, client_key
from .config import ServerConfig
from .dispatch import Dispatcher
from .handshake import Handshake, decode
from .metrics import ServerMetrics
from .outbox import Outbox
from .peers import LogBudget, peer_ip
from .sessions import SessionTable

log = logging.getLogger(__name__)

# Errors after which an authenticated connection is closed too (before hello, every error closes it).
FATAL = {"bad_token", "vocab_mismatch", "bad_version", "not_authenticated"}
SHED_LOG_S = 10.0  # `overloaded` is routine under a full fleet: one line per this many seconds, not one per shed


class ShedLog:
    """Sheds (`overloaded`) counted and logged as one line per SHED_LOG_S (the first at once), with the last
    reason: a fleet beyond the engine sheds hundreds a second, and a line each cost the server more CPU than
    the shed itself. bridge_errors_total{code="overloaded"} counts every one."""

    def __init__(self) -> None:
        self.count, self.since = 0, 0.0  # sheds since the last line, and when it was written (0: none yet)

    def note(self, reason: str) -> None:
        self.count += 1
        now = time.monotonic()
        if not self.since or now - self.since >= SHED_LOG_S:
            span = f" in {now - self.since:.0f}s" if self.since else ""
            log.info("shed %d request(s)%s (overloaded), the last: %s", self.count, span, reason)
            self.count, self.since = 0, now


async def close_for_drain(ws: ServerConnection) -> None:
    # 1012 "service restart": the robot reconnects without backing off (agent/decoding/link.py)
    await ws.close(1012, "replica draining: reconnect")


class Connections:
    """The server's live connections: each one's loop, and the drain over all of them."""

    def __init__(
        self,
        config: ServerConfig,
        sessions: SessionTable,
        metrics: ServerMetrics,
        replica: Replica,
        admission: Admission,
        handshake: Handshake,
        dispatcher: Dispatcher,
    ):
        self.config = config
        self.sessions = sessions
        self.metrics = metrics
        self.replica = replica
        self.admission = admission
        self.handshake = handshake
        self.sheds = ShedLog()
        self.dispatcher = dispatcher
        self._ids = itertools.count(1)
        self.live: dict[int, ServerConnection] = {}  # conn_id -> connection, for the drain
        self.busy: set[int] = set()  # connections serving a request now

    async def handle(self, ws: ServerConnection) -> None:
        """serve's handler: one connection from its upgrade to its end."""
        conn_id = next(self._ids)
        self.live[conn_id] = ws
        client = getattr(ws, "client", None)
        peer = client.address if client is not None else peer_ip(ws.remote_address)
        robot = ws.request.headers.get_all("X-Robot-Id") if ws.request is not None else []  # get() raises on two
        if robot:
            log.debug("conn %d %s: robot %s", conn_id, peer, robot[0][:64])
        budget = LogBudget(self.config.log_lines_per_10s, name=f"conn {conn_id} {peer}")
        outbox = Outbox(self.config.exit_queue, self.config.exit_policy)
        sender = asyncio.create_task(self.dispatcher.send_exits(ws, outbox), name=f"exits-{conn_id}")
        authed = False
        try:
            hello = await self.handshake.hello(ws, conn_id, peer)
            if hello is None:
                return
            # the robot's share of the session table: believed now that its token is checked
            share = client_key(ws, self.config.loopback_trusted, hello if self.config.token else None)
            self.admission.gate.release(ws)
            if self.replica.connections >= self.config.max_connections:  # filled up since its upgrade: no welcome
                self.metrics.refused["busy"] += 1
                await ws.close(1013, "too many connections; retry later")  # "try again later": the robot backs off
                return
            authed = True  # from here on it counts toward max_connections
            self.replica.connections += 1
            await self.dispatcher.send(ws, self.handshake.welcome())
            if self.replica.draining:
                await close_for_drain(ws)
                return
            async for frame in ws:
                self.metrics.bytes_in += len(frame)
                self.busy.add(conn_id)
                try:
                    await self.dispatcher.dispatch(
                        ws, conn_id, outbox, decode(frame, self.config.max_frame_bytes), share
                    )
                except wire.WireError as e:
                    self.metrics.errors[e.code] += 1
                    if e.code == "overloaded":
                        self.sheds.note(f"conn {conn_id} {peer}: {e}")
                    else:
                        self.admission.log(budget, logging.INFO, "conn %d %s: %s", conn_id, peer, e)
                    await self.dispatcher.send(ws, wire.Error(e.code, e.message, e.sid, e.retry_after_ms))
                    if e.code in FATAL:
                        return
                finally:
                    self.busy.discard(conn_id)
                if self.replica.draining:  # its request is answered: hand the robot over
                    await close_for_drain(ws)
                    return
        except ConnectionClosed:
            pass
        finally:
            if authed:
                self.replica.connections -= 1
            self.admission.gate.release(ws)
            self.live.pop(conn_id, None)
            self.sessions.detach(conn_id)
            outbox.close()
            sender.cancel()
            await asyncio.gather(sender, return_exceptions=True)
            if budget.suppressed:
                log.warning("%s: %d log lines suppressed", budget.name, budget.flush())

    async def drain(self, timeout_s: float) -> int:
        """Stop taking robots and hand the ones here to the other replicas without losing a round.

        /healthz turns 503 at once, and the balancer stops sending new robots (HAProxy: within one
        check interval). Every connection is closed with 1012 as soon as it is not serving a request:
        the request in flight gets its answer first. After `timeout_s` (drain_timeout_s) whatever is
        left is closed the same way; the robot re-opens its session elsewhere with its committed prefix
        either way. Returns how many connections were closed."""
        self.replica.draining = True
        n = len(self.live)
        log.info("draining: %d connection(s), %d request(s) in flight, at most %.0fs", n, len(self.busy), timeout_s)
        t0 = time.monotonic()
        for conn_id, ws in list(self.live.items()):
            if conn_id not in self.busy:
                await close_for_drain(ws)
        while self.live and time.monotonic() - t0 < timeout_s:
            await asyncio.sleep(0.02)  # the handlers close the rest as their requests end
        late = list(self.live.values())
        for ws in late:
            await close_for_drain(ws)
        log.info(
            "drained %d connection(s) in %.2fs%s",
            n,
            time.monotonic() - t0,
            f" ({len(late)} still busy at the timeout)" if late else "",
        )
        return n

    @staticmethod
    async def _close_for_drain(ws: ServerConnection) -> None:
        # 1012 "service restart": the robot reconnects without backing off (agent/decoding/link.py)
        await ws.close(1012, "replica draining: reconnect")
