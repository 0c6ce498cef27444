"""Who gets in: the TCP accept, the plain-HTTP answers before the websocket upgrade (/healthz, /metrics) and
the strangers' caps (DESIGN.md, Trust; server_bridge/peers.py).

A peer counts from its TCP accept (`_Connection`), capped over all strangers and per client address, until
its hello passes (handshake.py). The client's address is the TCP peer's, or the one a proxy in
`trusted_proxies` names (X-Forwarded-For, Forwarded's for=, X-Real-IP; naming none, a remote client of
unknown address); loopback clients skip the token only where `trust_loopback` says so (by default only on a
tokenless server). With a token set, /metrics and the full /healthz want it as a Bearer credential (or are
served without one on `metrics_listen`); without it /healthz says only ok or draining. Log lines about
strangers are budgeted for all of them together.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any, cast

from websockets.asyncio.server import ServerConnection
from websockets.http11 import Request, Response

from protocol import wire

from .config import ServerConfig
from .metrics import ServerMetrics
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

log = logging.getLogger(__name__)


@dataclass
class Replica:
    """This replica as every piece of the server sees it; the server writes it."""

    id: str  # "" until start() knows the port
    connections: int = 0  # past hello: what max_connections caps
    draining: bool = False


def is_loopback(remote: Any) -> bool:
    try:
        return ipaddress.ip_address(remote[0]).is_loopback
    except (TypeError, ValueError, IndexError):
        return False


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
    """websockets' connection, reported to its Admission when TCP opens and closes (serve's
    `create_connection`), so a peer counts from its accept, before it has sent a byte."""

    admission: Admission
    accepted_at: float = 0.0  # time.monotonic() of the TCP accept (after TLS): hello's deadline counts from it
    exempt: bool = False  # a trusted loopback peer: not in the strangers' table
    client: Client | None = None  # who it is, from its request (process_request)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self.accepted_at = time.monotonic()
        self.admission.accepted(self)

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        self.admission.gate.release(self)


class Admission:
    """The server's door: the strangers' table, the answers before the upgrade and the budget of log lines about
    strangers. `health(full)` and `metrics_text()` are the server's, for /healthz and /metrics."""

    def __init__(
        self,
        config: ServerConfig,
        metrics: ServerMetrics,
        replica: Replica,
        health: Callable[[bool], dict],
        metrics_text: Callable[[], str],
    ):
        self.config = config
        self.metrics = metrics
        self.replica = replica
        self.health = health
        self.metrics_text = metrics_text
        self.gate = Gate(config.max_unauthenticated, config.max_unauthenticated_per_address)  # before hello
        self._proxies = parse_networks(config.trusted_proxies)
        self._strangers_log = LogBudget(config.log_lines_per_10s, name="unauthenticated peers")

    def new_connection(self, *args, **kwargs) -> _Connection:
        """serve's create_connection: websockets' connection, told who admits it."""
        conn = _Connection(*args, **kwargs)
        conn.admission = self
        return conn

    def _from_proxy(self, remote: Any) -> bool:
        return client_address(peer_ip(remote), [], False, self._proxies).via_proxy

    def accepted(self, conn: _Connection) -> None:
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
            self.log_stranger(
                logging.INFO,
                "%s: evicted before hello (%d unauthenticated connections)",
                peer_ip(old.remote_address),
                self.config.max_unauthenticated,
            )
            old.transport.abort()
        if not admitted:
            self.metrics.refused["address_cap"] += 1
            self.log_stranger(
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

    def log_stranger(self, level: int, fmt: str, *args: object, exc_info: bool | None = None) -> None:
        self.log(self._strangers_log, level, fmt, *args, exc_info=exc_info)

    def log(self, budget: LogBudget, level: int, fmt: str, *args: object, exc_info: bool | None = None) -> None:
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
        connection = cast(_Connection, ws)  # serve makes every connection with new_connection
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
        if self.replica.draining:  # HAProxy's retry-on 503 sends it to another replica
            self.metrics.errors["draining"] += 1
            return connection.respond(HTTPStatus.SERVICE_UNAVAILABLE, "this replica is draining; reconnect\n")
        if self.replica.connections >= self.config.max_connections:
            self.metrics.errors["busy"] += 1
            return connection.respond(HTTPStatus.SERVICE_UNAVAILABLE, "too many connections; retry later\n")
        if not trusted and getattr(connection, "exempt", False):  # loopback, forwarded by an undeclared proxy
            connection.exempt = False
            admitted = self._admit(connection, client.address, abort=False)
        else:
            admitted = trusted or self.gate.identify(connection, client.address)  # behind a trusted proxy
            if not admitted:
                self.metrics.refused["address_cap"] += 1
                self.log_stranger(logging.INFO, "%s: refused (429): over its share of strangers", client.address)
        if not admitted:
            return connection.respond(
                HTTPStatus.TOO_MANY_REQUESTS, "too many unauthenticated connections from your address; retry later\n"
            )
        return None  # everything else is a websocket upgrade

    def process_metrics_request(self, connection: ServerConnection, request: Request) -> Response:
        """metrics_listen: /healthz (in full) and /metrics without a token; never a websocket."""
        if request.path == "/healthz":
            return self._healthz(connection, full=True)
        if request.path == "/metrics":
            return self._metrics_page(connection)
        return connection.respond(HTTPStatus.NOT_FOUND, "only /healthz and /metrics here\n")

    def _healthz(self, connection: ServerConnection, full: bool) -> Response:
        status = HTTPStatus.SERVICE_UNAVAILABLE if self.replica.draining else HTTPStatus.OK
        resp = connection.respond(status, json.dumps(self.health(full)) + "\n")
        del resp.headers["Content-Type"]
        resp.headers["Content-Type"] = "application/json"
        return resp

    def _metrics_page(self, connection: ServerConnection) -> Response:
        resp = connection.respond(HTTPStatus.OK, self.metrics_text())
        del resp.headers["Content-Type"]  # Headers is a multidict: replace, not append
        resp.headers["Content-Type"] = "text/plain; version=0.0.4; charset=utf-8"
        return resp
