"""server-bridge: the asyncio websocket server in front of the verifier.

One handler per connection reads frames in order; every bad frame gets an
`error` on that connection and the handler goes on (or closes, for a failed
handshake), so one robot's garbage never touches another's session. Every
model job (an open's prefill, a verify round, an ar token) goes through the
`Batcher`: the scheduler picks which waiting jobs share the next forward pass
(SLO-aware by default), the pass runs in a single model thread, and the event
loop keeps serving meanwhile. `/healthz` and `/metrics` (Prometheus text)
answer plain HTTP on the same port. With `tls_cert`/`tls_key` the port speaks
TLS only (wss:// and https:// for /healthz and /metrics).

Before hello a peer is a stranger (DESIGN.md, Trust; server_bridge/peers.py): it is counted from its
TCP accept (`_Connection`), capped over all strangers and per client address, must pass hello within
`hello_timeout_s`, and any error before then closes it (1008). Only a connection past hello counts
toward `max_connections`. The client's address is the TCP peer's, or the one a proxy in `trusted_proxies`
names (X-Forwarded-For, Forwarded's for=, X-Real-IP; naming none, a remote client of unknown address);
loopback clients skip the token only where `trust_loopback` says so (by default only on a tokenless
server). Once hello passed the token, a connection's sessions count against its robot's share of the
session table (its address, X-Robot-Id and hello's client: robots behind one NAT each have their own),
never before. With a token set, /metrics and the full /healthz want it as a Bearer
credential (or are served without one on `metrics_listen`); without it /healthz says only ok or
draining. Log lines are budgeted per connection, and for all strangers together.

One of many replicas (deploy/haproxy, deploy/k8s): each names itself
(`replica_id`) in welcome, opened, /healthz and /metrics. SIGTERM drains: /healthz
answers 503 so the balancer sends no new robots, an upgrade that still arrives
gets 503 (HAProxy retries it elsewhere), each connection finishes the request it
is serving and is then closed with 1012 ("service restart"), on which a robot
reconnects at once and re-opens its session, with its committed prefix, wherever
the balancer sends it. A connection's sessions outlive it for `detached_grace_s`,
so a robot back after a blip finds its KV.

Early-exit messages (FSD) are made in the model thread during a verify pass;
they reach the event loop by `call_soon_threadsafe`, wait in the connection's
bounded `Outbox` and go out from one sender task per connection, so they
overtake the pass they come from. A round's `result` goes out directly, and
its exits still pending then are purged: after the result they are useless.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import itertools
import json
import logging
import signal
import socket
import ssl
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from http import HTTPStatus
from typing import TYPE_CHECKING, Any, TypeVar, cast

from websockets.asyncio.server import Server, ServerConnection, serve
from websockets.exceptions import ConnectionClosed
from websockets.http11 import Request, Response

from protocol import images, modelfiles, wire

from .batcher import Batcher
from .config import ServerConfig
from .estimator import VerifyTimeModel, batch_memory_bytes
from .exit_setup import exit_taps
from .metrics import ServerMetrics
from .opens import slo_class
from .outbox import Outbox
from .peers import (
    FORWARDED_HEADERS,
    Client,
    Gate,
    LogBudget,
    address_key,
    client_address,
    parse_networks,
    peer_ip,
    share_key,
)
from .requests import ArOutcome, ArRequest, OpenNeedsRoom, OpenOutcome, OpenRequest, RoundOutcome, VerifyRequest
from .scheduler import Scheduler, deadline
from .sessions import Session, SessionTable, in_request
from .verifier import Verifier

if TYPE_CHECKING:
    from .target import Target

log = logging.getLogger(__name__)

T = TypeVar("T")

# Errors after which an authenticated connection is closed too (before hello, every error closes it).
FATAL = {"bad_token", "vocab_mismatch", "bad_version", "not_authenticated"}


def is_loopback(remote: Any) -> bool:
    try:
        return ipaddress.ip_address(remote[0]).is_loopback
    except (TypeError, ValueError, IndexError):
        return False


# An open that finds every engine sequence held evicts at most this many idle sessions before it is refused:
# more would mean something besides this table holds them, and one robot must not empty the table.
MAX_EVICTIONS_PER_OPEN = 4


def client_key(ws: ServerConnection, loopback_trusted: bool, hello: wire.Hello | None = None) -> str:
    """Whose share of the session table (max_sessions_per_client) a connection's sessions count against, once
    its `hello` passed: "" (no share of its own) for a loopback client the config trusts (this host's own tools
    and benchmarks); with the token checked, the robot (peers.share_key: its address and the robot it says it
    is, so robots behind one NAT address each hold their own share); else its client's address as
    process_request found it (behind a trusted proxy, the client the proxy names), an IPv6 address by its /64."""
    client = getattr(ws, "client", None)
    if client is None:
        address, loopback = peer_ip(ws.remote_address), is_loopback(ws.remote_address)
    else:
        address, loopback = client.address, client.loopback
    if loopback and loopback_trusted:
        return ""
    if hello is None or not hello.token:  # no token was checked: nothing it says about itself is believed
        return address_key(address)
    robot = ws.request.headers.get_all("X-Robot-Id") if ws.request is not None else []
    return share_key(address, robot[0] if len(robot) == 1 else "", hello.client)


class _Connection(ServerConnection):
    """websockets' connection, reported to its BridgeServer when TCP opens and closes (serve's
    `create_connection`), so a peer counts from its accept, before it has sent a byte."""

    bridge: BridgeServer
    accepted_at: float = 0.0  # time.monotonic() of the TCP accept (after TLS): hello's deadline counts from it
    exempt: bool = False  # a trusted loopback peer: not in the strangers' table
    client: Client | None = None  # who it is, from its request (process_request)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self.accepted_at = time.monotonic()
        self.bridge._accepted(self)

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        self.bridge.gate.release(self)


def tls_context(config: ServerConfig) -> ssl.SSLContext | None:
    """The server's TLS context from tls_cert/tls_key (None: plain ws://); raises OSError or ssl.SSLError."""
    if not config.tls_cert:
        return None
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(config.tls_cert, config.tls_key)
    return ctx


class BridgeServer:
    def __init__(self, verifier: Verifier, config: ServerConfig):
        self.verifier = verifier
        self.config = config
        self.sessions = SessionTable(
            config.max_sessions,
            config.max_sessions_per_connection,
            config.idle_timeout_s,
            config.detached_grace_s,
            max_per_client=config.max_sessions_per_client,
            on_release=self._release_sessions,
        )
        self.metrics = ServerMetrics()
        self.model_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="target")
        self.image_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="images")  # opens' images, decoded
        target = verifier.target
        self.scheduler = Scheduler(
            config.scheduler,
            load_estimator(config.estimator, target.name),
            max_queue=config.max_queue,
            max_batch=config.max_batch,
            guard_ms=config.guard_ms,
            memory_budget_bytes=config.batch_memory_mb * 2**20,
            memory_of=lambda members: batch_memory_bytes(
                members, target.kv_bytes_per_token, 4 * target.vocab_size, config.max_draft_len + 1
            ),
            batch_wait_ms=config.batch_wait_ms,
            max_wait_ms=config.max_wait_ms,
        )
        self.batcher = Batcher(verifier, self.scheduler, self.model_thread, self.metrics)
        self._conn_ids = itertools.count(1)
        self._connections = 0
        self._live: dict[int, ServerConnection] = {}  # conn_id -> connection, for the drain
        self._busy: set[int] = set()  # connections serving a request now
        self._server: Server | None = None
        self.port: int | None = None
        self.gate = Gate(config.max_unauthenticated, config.max_unauthenticated_per_address)  # before hello
        self._proxies = parse_networks(config.trusted_proxies)
        self._strangers_log = LogBudget(config.log_lines_per_10s, name="unauthenticated peers")
        self._metrics_server: Server | None = None
        self.metrics_port: int | None = None  # metrics_listen's port, once started
        self.replica_id = config.replica_id  # "" until start() knows the port
        self.draining = False

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        tls = tls_context(self.config)
        self._server = server = await serve(
            self.handle,
            self.config.host,
            self.config.port,
            process_request=self.process_request,
            ssl=tls,
            # frames between the cap and twice the cap get an `error`; beyond that websockets closes (1009)
            max_size=2 * self.config.max_frame_bytes,
            max_queue=16,
            compression=None,
            ping_interval=10,
            ping_timeout=10,
            # the TLS handshake (ssl_handshake_timeout defaults to it) and the HTTP upgrade: a peer that
            # sends nothing is gone after this; hello's own deadline then counts from the accept
            open_timeout=self.config.hello_timeout_s,
            create_connection=cast("type[ServerConnection]", self._new_connection),  # a factory serve calls
        )
        self.port = server.sockets[0].getsockname()[1]
        if self.config.metrics_address is not None:
            host, port = self.config.metrics_address
            self._metrics_server = metrics_server = await serve(
                _no_websocket,
                host,
                port,
                process_request=self._process_metrics_request,
                compression=None,
                open_timeout=self.config.hello_timeout_s,
            )
            self.metrics_port = metrics_server.sockets[0].getsockname()[1]
            log.info("/metrics and /healthz also on http://%s:%d, without a token", host, self.metrics_port)
        self.replica_id = self.config.replica_id or f"{socket.gethostname()}:{self.port}"
        self._janitor = asyncio.create_task(self._evict_idle_forever(), name="session-janitor")
        self.batcher.start()
        model = self.scheduler.model
        log.info(
            "server-bridge replica %s listening on %s://%s:%d (target %s on %s, token %s, scheduler %s, max batch %d, "
            "estimator %s)",
            self.replica_id,
            "wss" if tls else "ws",
            self.config.host,
            self.port,
            self.verifier.target.name,
            self.verifier.target.engine.info.as_dict(),
            "required" if self.config.token else "none: loopback clients only",
            self.config.scheduler,
            self.scheduler.max_batch,
            "fitted" if model.fitted else "defaults (run server-bridge profile)",
        )
        log.info(
            "peers: loopback clients %s; client addresses from the forwarding headers of %s; hello within %gs; at most "
            "%d unauthenticated connections, %d per address",
            "need no token" if self.config.loopback_trusted else "present the token like everyone",
            ", ".join(self.config.trusted_proxies) or "no proxy",
            self.config.hello_timeout_s,
            self.config.max_unauthenticated,
            self.config.max_unauthenticated_per_address,
        )

    async def stop(self) -> None:
        self._janitor.cancel()
        await self.batcher.stop()
        if self._metrics_server is not None:
            self._metrics_server.close()
            await self._metrics_server.wait_closed()
        assert self._server is not None, "stop() before start()"
        self._server.close()
        await self._server.wait_closed()
        if self.sessions.clear():  # their sequences go back to the engine (a target outlives its server)
            try:  # the model thread frees them after the pass in flight; this waits for that
                await asyncio.wait_for(self._in_model_thread(lambda: None), 10)
            except (asyncio.TimeoutError, RuntimeError):
                log.warning("stopping with sessions' sequences not yet freed (a pass is still running)")
        self.model_thread.shutdown(wait=False, cancel_futures=True)
        self.image_thread.shutdown(wait=False, cancel_futures=True)

    async def serve_forever(self) -> None:
        """Serve until SIGTERM (drain, then stop) or SIGINT (stop at once)."""
        await self.start()
        loop = asyncio.get_running_loop()
        stop: asyncio.Future[str] = loop.create_future()

        def stopping(how: str) -> None:
            if not stop.done():
                stop.set_result(how)

        loop.add_signal_handler(signal.SIGTERM, stopping, "drain")
        loop.add_signal_handler(signal.SIGINT, stopping, "stop")
        if await stop == "drain":
            await self.drain()
        log.info("shutting down")
        await self.stop()

    async def drain(self, timeout_s: float | None = None) -> int:
        """Stop taking robots and hand the ones here to the other replicas without losing a round.

        /healthz turns 503 at once, and the balancer stops sending new robots (HAProxy: within one
        check interval). Every connection is closed with 1012 as soon as it is not serving a request:
        the request in flight gets its answer first. After `timeout_s` (drain_timeout_s) whatever is
        left is closed the same way; the robot re-opens its session elsewhere with its committed prefix
        either way. Returns how many connections were closed."""
        timeout_s = self.config.drain_timeout_s if timeout_s is None else timeout_s
        self.draining = True
        n = len(self._live)
        log.info("draining: %d connection(s), %d request(s) in flight, at most %.0fs", n, len(self._busy), timeout_s)
        t0 = time.monotonic()
        for conn_id, ws in list(self._live.items()):
            if conn_id not in self._busy:
                await self._close_for_drain(ws)
        while self._live and time.monotonic() - t0 < timeout_s:
            await asyncio.sleep(0.02)  # the handlers close the rest as their requests end
        late = list(self._live.values())
        for ws in late:
            await self._close_for_drain(ws)
        log.info(
            "drained %d connection(s) in %.2fs%s",
            n,
            time.monotonic() - t0,
            f" ({len(late)} still busy at the timeout)" if late else "",
        )
        return n

    @staticmethod
    async def _close_for_drain(ws: ServerConnection) -> None:
        # 1012 "service restart": the robot reconnects without backing off (agent/spec/link.py)
        await ws.close(1012, "replica draining: reconnect")

    async def _evict_idle_forever(self) -> None:
        while True:
            await asyncio.sleep(min(5.0, self.config.idle_timeout_s / 4, max(0.25, self.config.detached_grace_s / 4)))
            self.sessions.evict_idle()

    # ------------------------------------------------------------------ peers

    def _new_connection(self, *args, **kwargs) -> _Connection:
        """serve's create_connection: websockets' connection, told who its server is."""
        conn = _Connection(*args, **kwargs)
        conn.bridge = self
        return conn

    def _from_proxy(self, remote: Any) -> bool:
        return client_address(peer_ip(remote), [], False, self._proxies).via_proxy

    def _accepted(self, conn: _Connection) -> None:
        """A TCP connection (TLS done): a stranger until its hello passes, capped now by its address. A trusted
        proxy's is capped by its client's once its request names it (process_request); a loopback peer's where
        loopback is trusted is not counted at all, unless its request turns out forwarded by a proxy nobody
        declared (then it is counted from there)."""
        remote = conn.remote_address
        proxy = self._from_proxy(remote)
        if self.config.loopback_trusted and is_loopback(remote) and not proxy:
            conn.exempt = True
            return
        self._admit(conn, None if proxy else peer_ip(remote))

    def _admit(self, conn: _Connection, address: str | None, abort: bool = True) -> bool:
        """Into the strangers' table, the oldest out if it is full; False (counted, and the connection aborted
        unless `abort` is False) when `address` holds its share already."""
        admitted, evicted = self.gate.admit(conn, address)
        for old in evicted:  # the oldest strangers make room: silent connections age out
            self.metrics.refused["evicted"] += 1
            self._log_stranger(
                logging.INFO,
                "%s: evicted before hello (%d unauthenticated connections)",
                peer_ip(old.remote_address),
                self.config.max_unauthenticated,
            )
            old.transport.abort()
        if not admitted:
            self.metrics.refused["address_cap"] += 1
            self._log_stranger(
                logging.INFO,
                "%s: refused: past its share of %d unauthenticated connections, and the table is full",
                address,
                self.config.max_unauthenticated_per_address,
            )
            if abort:
                conn.transport.abort()
        return admitted

    def _client(self, connection: ServerConnection, request: Request) -> Client:
        """Who sent `request`: the TCP peer, or the client a trusted proxy names (X-Forwarded-For, Forwarded's
        for=, X-Real-IP; none: a remote client of unknown address, never loopback)."""
        headers = getattr(request, "headers", None)
        values = {h: headers.get_all(h) if headers is not None else [] for h in FORWARDED_HEADERS}
        return client_address(
            peer_ip(connection.remote_address),
            values["X-Forwarded-For"],
            any(values.values()),
            self._proxies,
            forwarded=values["Forwarded"],
            real_ip=values["X-Real-IP"],
        )

    def _bearer_ok(self, request: Request) -> bool:
        """The request carries `Authorization: Bearer <token>` with this server's token."""
        headers = getattr(request, "headers", None)
        values = headers.get_all("Authorization") if headers is not None and self.config.token else []
        if len(values) != 1:
            return False
        scheme, _, credential = values[0].strip().partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(
            credential.strip().encode(), self.config.token.encode()
        )

    def _log_stranger(self, level: int, fmt: str, *args: object, exc_info: bool | None = None) -> None:
        self._log(self._strangers_log, level, fmt, *args, exc_info=exc_info)

    def _log(self, budget: LogBudget, level: int, fmt: str, *args: object, exc_info: bool | None = None) -> None:
        """One log line within `budget`; beyond it the line is counted, and the count logged once the window turns."""
        ok, dropped = budget.take()
        if dropped:
            log.warning("%s: %d log lines suppressed in %gs", budget.name, dropped, budget.window_s)
        if ok:
            log.log(level, fmt, *args, exc_info=exc_info)
        else:
            self.metrics.log_lines_suppressed += 1

    # ------------------------------------------------------------------ plain HTTP

    def process_request(self, ws: ServerConnection, request: Request) -> Response | None:
        # Refused before the websocket upgrade, so the robot sees why without a half-open session.
        connection = cast(_Connection, ws)  # serve makes every connection with _new_connection
        client = self._client(connection, request)
        connection.client = client
        trusted = self.config.loopback_trusted and client.loopback
        if trusted:
            self.gate.release(connection)  # this host, and the operator trusts it: no caps
        if not self.config.token and not trusted:
            if request.path == "/healthz" and client.unnamed:  # a trusted proxy's own check: the status alone
                return self._healthz(connection, full=False)
            self.metrics.errors["forbidden"] += 1
            return connection.respond(
                HTTPStatus.FORBIDDEN,
                "this verifier has no token configured and accepts loopback clients only (a request forwarded "
                "by a proxy outside trusted_proxies is not loopback)\n",
            )
        if request.path == "/healthz":
            # 503 while draining: the balancer's check and Kubernetes' readiness take the replica out.
            # Without the token (where one is set) only the status: who and what this is, is for operators.
            return self._healthz(connection, full=trusted or self._bearer_ok(request))
        if request.path == "/metrics":
            if not (trusted or self._bearer_ok(request)):
                self.metrics.errors["unauthorized"] += 1
                resp = connection.respond(
                    HTTPStatus.UNAUTHORIZED, "/metrics needs Authorization: Bearer <token> (or metrics_listen)\n"
                )
                resp.headers["WWW-Authenticate"] = 'Bearer realm="server-bridge"'
                return resp
            return self._metrics_page(connection)
        if self.draining:  # HAProxy's retry-on 503 sends it to another replica
            self.metrics.errors["draining"] += 1
            return connection.respond(HTTPStatus.SERVICE_UNAVAILABLE, "this replica is draining; reconnect\n")
        if self._connections >= self.config.max_connections:
            self.metrics.errors["busy"] += 1
            return connection.respond(HTTPStatus.SERVICE_UNAVAILABLE, "too many connections; retry later\n")
        if not trusted and getattr(connection, "exempt", False):  # loopback, forwarded by an undeclared proxy
            connection.exempt = False
            admitted = self._admit(connection, client.address, abort=False)
        else:
            admitted = trusted or self.gate.identify(connection, client.address)  # behind a trusted proxy
            if not admitted:
                self.metrics.refused["address_cap"] += 1
                self._log_stranger(logging.INFO, "%s: refused (429): over its share of strangers", client.address)
        if not admitted:
            return connection.respond(
                HTTPStatus.TOO_MANY_REQUESTS, "too many unauthenticated connections from your address; retry later\n"
            )
        return None  # everything else is a websocket upgrade

    def _process_metrics_request(self, connection: ServerConnection, request: Request) -> Response:
        """metrics_listen: /healthz (in full) and /metrics without a token; never a websocket."""
        if request.path == "/healthz":
            return self._healthz(connection, full=True)
        if request.path == "/metrics":
            return self._metrics_page(connection)
        return connection.respond(HTTPStatus.NOT_FOUND, "only /healthz and /metrics here\n")

    def _healthz(self, connection: ServerConnection, full: bool):
        status = HTTPStatus.SERVICE_UNAVAILABLE if self.draining else HTTPStatus.OK
        resp = connection.respond(status, json.dumps(self.health(full)) + "\n")
        del resp.headers["Content-Type"]
        resp.headers["Content-Type"] = "application/json"
        return resp

    def _metrics_page(self, connection: ServerConnection):
        resp = connection.respond(
            HTTPStatus.OK,
            self.metrics.render(
                self.sessions,
                self._connections,
                len(self.scheduler),
                self.verifier.target.engine,
                replica=self.replica_id,
                draining=self.draining,
                unauthenticated=len(self.gate),
            ),
        )
        del resp.headers["Content-Type"]  # Headers is a multidict: replace, not append
        resp.headers["Content-Type"] = "text/plain; version=0.0.4; charset=utf-8"
        return resp

    def health(self, full: bool = True) -> dict:
        """/healthz's JSON: who this replica is, what it serves and how loaded it is; only the status when not full."""
        status = {"status": "draining" if self.draining else "ok"}
        if not full:
            return status
        return {
            **status,
            "replica": self.replica_id,
            "target": self.verifier.target.name,
            **self.verifier.target.engine.info.as_dict(),
            "sessions": len(self.sessions),
            "connections": self._connections,
            "unauthenticated": len(self.gate),
            "queue": len(self.scheduler),
            "draining": self.draining,
        }

    # ------------------------------------------------------------------ websocket

    async def handle(self, ws: ServerConnection) -> None:
        conn_id = next(self._conn_ids)
        self._live[conn_id] = ws
        client = getattr(ws, "client", None)
        peer = client.address if client is not None else peer_ip(ws.remote_address)
        robot = ws.request.headers.get_all("X-Robot-Id") if ws.request is not None else []  # get() raises on two
        if robot:
            log.debug("conn %d %s: robot %s", conn_id, peer, robot[0][:64])
        budget = LogBudget(self.config.log_lines_per_10s, name=f"conn {conn_id} {peer}")
        outbox = Outbox(self.config.exit_queue, self.config.exit_policy)
        sender = asyncio.create_task(self._send_exits(ws, outbox), name=f"exits-{conn_id}")
        authed = False
        try:
            hello = await self._hello(ws, conn_id, peer)
            if hello is None:
                return
            # the robot's share of the session table: believed now that its token is checked
            share = client_key(ws, self.config.loopback_trusted, hello if self.config.token else None)
            self.gate.release(ws)
            if self._connections >= self.config.max_connections:  # filled up since its upgrade: no welcome
                self.metrics.refused["busy"] += 1
                await ws.close(1013, "too many connections; retry later")  # "try again later": the robot backs off
                return
            authed = True  # from here on it counts toward max_connections
            self._connections += 1
            await self._send(ws, self._welcome())
            if self.draining:
                await self._close_for_drain(ws)
                return
            async for frame in ws:
                self.metrics.bytes_in += len(frame)
                self._busy.add(conn_id)
                try:
                    await self._dispatch(ws, conn_id, outbox, self._decode(frame), share)
                except wire.WireError as e:
                    self.metrics.errors[e.code] += 1
                    self._log(budget, logging.INFO, "conn %d %s: %s", conn_id, peer, e)
                    await self._send(ws, wire.Error(e.code, e.message, e.sid))
                    if e.code in FATAL:
                        return
                finally:
                    self._busy.discard(conn_id)
                if self.draining:  # its request is answered: hand the robot over
                    await self._close_for_drain(ws)
                    return
        except ConnectionClosed:
            pass
        finally:
            if authed:
                self._connections -= 1
            self.gate.release(ws)
            self._live.pop(conn_id, None)
            self.sessions.detach(conn_id)
            outbox.close()
            sender.cancel()
            await asyncio.gather(sender, return_exceptions=True)
            if budget.suppressed:
                log.warning("%s: %d log lines suppressed", budget.name, budget.flush())

    async def _hello(self, ws: ServerConnection, conn_id: int, peer: str) -> wire.Hello | None:
        """The first frame must be a valid hello, there within hello_timeout_s of the TCP accept. The hello once
        it passed (the welcome is the caller's); anything else closes the connection (1008, after an `error`
        saying why) and is counted."""
        timeout = self.config.hello_timeout_s
        left = timeout - (time.monotonic() - getattr(ws, "accepted_at", time.monotonic()))
        try:
            frame = await asyncio.wait_for(ws.recv(), max(left, 0.0))  # recv is safe to cancel
        except asyncio.TimeoutError:
            self.metrics.refused["hello_timeout"] += 1
            self._log_stranger(logging.INFO, "conn %d %s: no hello within %gs: closed", conn_id, peer, timeout)
            self.gate.release(ws)  # its slot is free now, while the close handshake waits for the peer
            await ws.close(1008, f"no hello within {timeout:g}s")
            return None
        self.metrics.bytes_in += len(frame)
        try:
            return self._check_hello(ws, self._decode(frame))
        except wire.WireError as e:
            error = e
        except Exception:  # a bug in a check must not close with 1011 and a traceback for any stranger to trigger
            self._log_stranger(logging.WARNING, "conn %d %s: hello raised", conn_id, peer, exc_info=True)
            error = wire.WireError("bad_frame", "the first message could not be checked")
        self.metrics.errors[error.code] += 1
        self.metrics.refused["error_before_hello"] += 1
        self._log_stranger(logging.INFO, "conn %d %s: closed before hello: %s", conn_id, peer, error)
        self.gate.release(ws)
        await self._send(ws, wire.Error(error.code, error.message, error.sid))
        await ws.close(1008, error.code)
        return None

    def _decode(self, frame: str | bytes) -> wire.Message:
        """wire.decode, with anything it raises besides WireError turned into bad_frame: a decoder bug must not
        end the connection with 1011 and a traceback."""
        try:
            return wire.decode(frame, self.config.max_frame_bytes)
        except wire.WireError:
            raise
        except Exception as e:
            raise wire.WireError("bad_frame", f"undecodable message ({type(e).__name__})") from e

    def _check_hello(self, ws: ServerConnection, msg: wire.Message) -> wire.Hello:
        """`msg`, or WireError unless it is a hello this verifier serves: the token (unless loopback is trusted
        and this is loopback), the draft's vocabulary."""
        if not isinstance(msg, wire.Hello):
            raise wire.WireError("not_authenticated", f"the first message must be hello, got {msg.TYPE}")
        client = getattr(ws, "client", None)
        trusted = self.config.loopback_trusted and client is not None and client.loopback
        if (
            self.config.token
            and not trusted
            and not hmac.compare_digest(msg.token.encode(), self.config.token.encode())
        ):
            raise wire.WireError("bad_token", "the token in hello does not match this verifier's")
        target = self.verifier.target
        # Both hashes cover the real part only (modelfiles.vocab_hash), its size included: equal hashes are equal
        # vocabularies up to a tail of padding ids on either side. hello's vocab_size is the draft's full size, so
        # it holds at least the real part; the agreed vocabulary is the real part (target.vocab_size, welcome's).
        if msg.draft_vocab_hash != target.vocab_hash or msg.vocab_size < target.vocab_size:
            raise wire.WireError(
                "vocab_mismatch",
                f"the draft's vocabulary (size {msg.vocab_size}, hash "
                f"{msg.draft_vocab_hash[:12]}) differs from the target {target.name}'s (size "
                f"{target.vocab_size} without padding, hash {target.vocab_hash[:12]}); speculative decoding "
                "needs identical tokenizers",
            )
        return msg

    def _welcome(self) -> wire.Welcome:
        target = self.verifier.target
        return wire.Welcome(
            target=target.name,
            vocab_size=target.vocab_size,
            vocab_hash=target.vocab_hash,
            eos_ids=target.eos_ids,
            exits=self.verifier.exit_layers,
            limits={
                "max_frame_bytes": self.config.max_frame_bytes,
                "max_draft_len": self.config.max_draft_len,
                "max_context": self.config.max_context,
                "max_sessions": self.config.max_sessions,
                "grammar": target.grammars_supported,
                "top_p": True,  # open.sampling.top_p is understood (older servers would ignore it)
                **self._image_limits(),
            },
            engine=target.engine.info.as_dict(),
            replica=self.replica_id,
        )

    def _image_limits(self) -> dict:
        """welcome.limits.images where the target reads images: its marker id and the wire's bounds."""
        marker = self.verifier.target.image_marker
        if marker is None:
            return {}
        return {"images": {"marker": marker, **images.limits()}}

    async def _decode_images(self, msg: wire.Open) -> None:
        """An open's images decoded and tiled in the image thread (one: one image at a time, bounded in pixels
        by protocol/images.py), never in the model thread, which every robot waits on."""
        if msg.images:
            await asyncio.get_running_loop().run_in_executor(self.image_thread, self.verifier.decode_images, msg)

    async def _dispatch(
        self, ws: ServerConnection, conn_id: int, outbox: Outbox, msg: wire.Message, client: str
    ) -> None:
        """One request of an authenticated connection; `client` is its share of the session table (client_key)."""
        if isinstance(msg, wire.Open):
            self.sessions.check_owner(msg.sid, conn_id, msg.resume)  # refused: the owner never notices
            slo = slo_class(msg.slo, self.config.default_slo, msg.sid)  # bad_field before any queueing
            await self._decode_images(msg)  # bad_image before any queueing; the model thread only embeds them
            self.metrics.exits_purged += outbox.purge(msg.sid)  # hints for the old generation
            self.sessions.make_room(msg.sid, conn_id, client)  # idle sessions go before a robot is refused
            secret = self.sessions.secret_for(msg.sid, conn_id, msg.resume)
            opened = await self._open(msg, conn_id, slo)
            session = opened.session
            if opened.ended is not None:
                self.metrics.count_generation(opened.ended.slo, *opened.ended.generation_ended())
            session.client, session.resume = client, secret
            try:
                self.sessions.check_owner(msg.sid, conn_id, msg.resume)  # another connection took it meanwhile
                self.sessions.put(session)
            except wire.WireError:
                session.retired = True
                self._release_sessions([session])
                raise
            self.metrics.sessions_opened += 1
            await self._send(
                ws,
                wire.Opened(
                    msg.sid,
                    len(session.state.ids),
                    {"prefill_ms": opened.ms, "passes": session.state.passes},
                    self.replica_id,
                    session.resume,
                ),
            )
            session.state.passes = 0
        elif isinstance(msg, wire.Verify):
            session = self.sessions.get(msg.sid, conn_id)
            emit = self._exit_sink(outbox) if session.exits else None
            try:
                outcome = await self._submit(
                    VerifyRequest(session, msg, emit), len(msg.draft_ids), len(msg.draft_ids) + (msg.fix is not None)
                )
                assert isinstance(outcome, RoundOutcome)
            finally:
                # Every exit of this round is in the outbox by now (queued before the pass returned);
                # what is still pending there is useless once the result is out. No await from here
                # to the result's write, so none of them can slip out after it.
                self.metrics.exits_purged += outbox.purge(msg.sid, msg.round)
            verdict = outcome.verdict
            self.metrics.count_round(
                len(msg.draft_ids), verdict.accepted, outcome.verify_ms, outcome.exit_layer, outcome.exit_ms
            )
            if outcome.residual is not None:
                self.metrics.residuals_sent += 1
            await self._send(
                ws,
                wire.Result(
                    msg.sid,
                    msg.round,
                    verdict.accepted,
                    verdict.token,
                    len(session.state.ids),
                    outcome.timing(),
                    outcome.residual,
                ),
            )
        elif isinstance(msg, wire.Ar):
            await self._stream_ar(ws, conn_id, msg)
        elif isinstance(msg, wire.Close):
            self.metrics.exits_purged += outbox.purge(msg.sid)
            closing = self.sessions.peek(msg.sid)
            if self.sessions.discard(msg.sid, conn_id) and closing is not None:  # closing a gone session is fine
                self.metrics.count_generation(closing.slo, *closing.generation_ended())
        else:
            raise wire.WireError("bad_type", f"{msg.TYPE} is not a request a robot may send")

    async def _stream_ar(self, ws: ServerConnection, conn_id: int, msg: wire.Ar) -> None:
        """The cloud-autoregressive baseline: one target token per forward pass, each sent at once."""
        stop = set(msg.stop_ids)
        session = self.sessions.get(msg.sid, conn_id)
        await self._in_model_thread(self.verifier.fix, session, msg.fix)  # a split correction owed, if any
        for seq in range(msg.max_tokens):
            session = self.sessions.get(msg.sid, conn_id)  # evicted mid-stream -> unknown_session
            out = await self._submit(ArRequest(session), 0, 0)
            assert isinstance(out, ArOutcome)
            token, ms, p = out
            self.metrics.count_ar_token(ms)
            done = seq + 1 == msg.max_tokens or token in stop
            sent = await self._send(ws, wire.Token(msg.sid, seq, token, done, {"verify_ms": ms, "passes": 1}, p))
            if done or not sent:  # a dead link stops the stream: the robot re-opens and asks again
                return

    async def _open(self, msg: wire.Open, conn_id: int, slo: float) -> OpenOutcome:
        """An open through the batcher. While the engine's shared room is all held
        (every sequence; a unified KV pool's cells), the least recently used session not in a request
        (detached first) is evicted and the open tried again: `overloaded` only when every session is in
        a request (or MAX_EVICTIONS_PER_OPEN went and still no room)."""
        now = time.monotonic()
        evictions = 0
        while True:
            previous = self.sessions.peek(msg.sid)  # a re-open keeps the KV of what it shares
            try:
                with in_request(previous):
                    # worth one token, due when the first token is at the class's speed: an open is always
                    # urgent, since the first round's budget counts from it
                    return await self.batcher.submit(
                        OpenRequest(msg, conn_id, previous, now),
                        (0, len(msg.prompt_ids) - 1 if previous is None else 1),
                        1.0,
                        deadline(slo, now, 1.0),
                        slo,
                    )
            except OpenNeedsRoom as e:
                if evictions == MAX_EVICTIONS_PER_OPEN:
                    raise
                if self.sessions.evict_one(msg.sid, e.reason) is None:
                    raise wire.WireError(
                        "overloaded", f"{e.reason}, each by a session in a request now: retry later", msg.sid
                    ) from None
                evictions += 1

    def _release_sessions(self, sessions: list[Session]) -> None:
        """SessionTable.on_release: free the engine sequences of sessions let go, in the model thread after
        the pass running now (which may still use one) and before the next (they are retired: none prepares
        them)."""
        try:
            self.model_thread.submit(self.verifier.release, sessions)
        except RuntimeError:  # the model thread has stopped: they go when collected
            pass

    async def _submit(self, req: VerifyRequest | ArRequest, k: int, extra: int) -> RoundOutcome | ArOutcome:
        """A verify round (k drafted tokens) or an ar token (k 0) through the batcher; `extra` new tokens beyond
        the session's uncached ids."""
        session = req.session
        state = session.state
        value = session.alpha * k + 1  # expected committed tokens
        with in_request(session):  # not evicted while it waits or runs
            return await self.batcher.submit(
                req,
                (state.cached, len(state.ids) - state.cached + extra),
                value,
                deadline(session.slo, max(session.t0, session.t_last), value),
                session.slo,
            )

    def _exit_sink(self, outbox: Outbox):
        """A callback for the model thread that queues an exit message into this connection's outbox."""
        loop = asyncio.get_running_loop()

        def queue(msg: wire.Exit) -> None:  # in the event loop
            self.metrics.exits_dropped += outbox.put(msg)

        def emit(msg: wire.Exit) -> None:  # in the model thread
            try:
                loop.call_soon_threadsafe(queue, msg)
            except RuntimeError:  # the loop is closed: the server is stopping
                pass

        return emit

    async def _send_exits(self, ws: ServerConnection, outbox: Outbox) -> None:
        """The connection's one exit sender: the outbox's best pending message, as the link allows."""
        while True:
            msg = await outbox.get()
            if not await self._send(ws, msg):
                return
            self.metrics.exits_sent += 1

    async def _in_model_thread(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self.model_thread, fn, *args)

    async def _send(self, ws: ServerConnection, msg: wire.Message) -> bool:
        """Send one message; False when the connection is already gone."""
        frame = wire.encode(msg)
        try:
            await ws.send(frame)
        except ConnectionClosed:
            return False
        self.metrics.bytes_out += len(frame)
        return True


async def _no_websocket(ws: ServerConnection) -> None:  # metrics_listen answers every request in process_request
    await ws.close(1008, "no websocket here")


def load_estimator(spec: str, target_name: str) -> VerifyTimeModel:
    """The verification-time model: a JSON file, "auto" (the profiled one for this target, if any), or ""."""
    path = modelfiles.resolve_estimator(spec, target_name)
    if path is None:
        log.warning(
            "no profiled verification-time estimator for %s: using rough defaults; run "
            "`server-bridge profile` on this machine",
            target_name,
        )
        return VerifyTimeModel()
    model = VerifyTimeModel.load(path)
    log.info(
        "verification-time estimator from %s: a %.3g ms/token, b_c %.3g ms/interaction, b_r %.3g ms/cached "
        "token, c %.3g ms",
        path,
        model.a,
        model.b_c,
        model.b_r,
        model.c,
    )
    return model


def target_from_config(config: ServerConfig) -> Target:
    """The target on the engine the config names, sized by its session and context limits."""
    from .target import load_target

    # llama.cpp taps only the exits' layers, and none when exits are off: its eval callback is
    # then not installed at all
    return load_target(
        config.target,
        config.engine,
        device=config.device,
        dtype=config.dtype,
        threads=config.threads,
        max_sequences=config.max_sessions,
        kv_tokens=config.kv_budget,
        n_gpu_layers=config.n_gpu_layers,
        max_len=config.max_context,
        kv_type=config.kv_type,
        tap_layers=exit_taps(config, modelfiles.target_name(config.target)),
        **config.llama_options,
    )  # the torch engine ignores them


async def run(config: ServerConfig) -> None:
    t0 = time.perf_counter()
    target = target_from_config(config)
    log.info("target ready in %.1fs: %s", time.perf_counter() - t0, target.engine.info.as_dict())
    await BridgeServer(Verifier(target, config), config).serve_forever()
