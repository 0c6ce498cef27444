"""The robot's websocket link to server-bridge: connect, handshake, send and receive messages.

Synchronous (websockets.sync.client) because the decode loop is sequential;
the receiver thread of later modes wraps the same `recv`. Not thread-safe.

TLS: a wss:// verifier is checked against `ca_file` (the CA that signed
server-bridge's certificate, e.g. a self-made one) or the system's CAs. The
token is never sent in clear to another machine: a ws:// URL with a token is
refused unless its host is loopback or `allow_insecure` is set.

Fleets: the handshake carries `X-Robot-Id` (link.robot_id), on which a load
balancer in front of several replicas hashes, so the robot's reconnects find the
replica that holds its session. A replica that drains closes with 1012 (service
restart): that LinkLost is marked `restart`, and the decoder reconnects at once,
through the balancer, instead of backing off.
"""

from __future__ import annotations

import contextlib
import hashlib
import ipaddress
import logging
import re
import socket
import ssl
import time
import uuid
from pathlib import Path
from typing import Callable
from urllib.parse import urlsplit

from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidStatus, InvalidURI
from websockets.sync.client import ClientConnection, connect

from protocol import wire

log = logging.getLogger(__name__)

# A server error that re-opening the session with the committed prefix repairs.
# unknown_image: a re-open sent an image's sha256 alone and this server no longer holds it: send the bytes.
RECOVERABLE = {"unknown_session", "desync", "unknown_image"}
# The session id is held by another connection and our prompt does not carry its committed prefix
# (a named session re-opened with a new prompt after the link dropped between two generations):
# re-opening the same id cannot help, a fresh id does (agent/decoding/session.py switches once per open).
TAKEN = "session_taken"
# The verifier shed the request (its queue full, or the request waited past its limit): nothing of it ran;
# backing off and re-opening helps (agent/decoding/session.py retries it a bounded number of times).
SHED = "overloaded"
# Close codes after which the server is gone on purpose (1012 a replica draining, 1001 a server going
# away): reconnect at once, the balancer sends the robot to a replica that serves.
RESTART_CODES = {1001, 1012}
ROBOT_ID = re.compile(r"[A-Za-z0-9_.:-]{1,64}")
MACHINE_ID_FILES = ("/etc/machine-id", "/var/lib/dbus/machine-id")


class LinkLost(ConnectionError):
    """The connection dropped, timed out or could not be made; reconnecting may help."""

    token_ids: list[int] = []  # raised out of EdgeDecoder.generate: the ids committed before the failure

    def __init__(self, message: str, restart: bool = False):
        super().__init__(message)
        self.restart = restart  # the server closed on purpose (draining): reconnect now, no backoff


class ProtocolViolation(LinkLost):
    """A verifier reply that breaks the protocol or what the handshake agreed: a token id outside the
    vocabulary, more accepted tokens than were drafted, a round that was not asked, an unusable residual
    (agent/decoding/replies.py checks them). The robot trusts nothing it receives: such a reply is dropped with its
    link, uncommitted, and the decoder goes on as for a lost link (reconnect, re-open with the committed
    prefix; in the end the robot's offline mode)."""


def default_robot_id() -> str:
    """A stable id for this machine: a hash of systemd's machine-id (the same across reboots and
    reinstalls of the agent, and not the id itself, which is meant to stay private), else of the
    hostname and MAC address."""
    for path in MACHINE_ID_FILES:
        try:
            seed = Path(path).read_text().strip()
        except OSError:
            continue
        if seed:
            break
    else:
        seed = f"{socket.gethostname()}/{uuid.getnode():012x}"
    return "robot-" + hashlib.sha256(f"edgespec/{seed}".encode()).hexdigest()[:12]


def _closed(e: ConnectionClosed) -> tuple[str, bool]:
    """Why the server closed, and whether it closed to be replaced (reconnect at once)."""
    if e.rcvd is None:
        return str(e), False
    return f"closed by the verifier ({e.rcvd.code} {e.rcvd.reason})", e.rcvd.code in RESTART_CODES


class ServerError(RuntimeError):
    """The server answered with `error`."""

    token_ids: list[int] = []  # raised out of EdgeDecoder.generate: the ids committed before the failure

    def __init__(self, code: str, message: str, sid: str | None = None, retry_after_ms: int | None = None):
        super().__init__(f"server error {code}: {message}")
        self.code = code
        self.message = message
        self.sid = sid
        self.retry_after_ms = retry_after_ms  # `overloaded`: the server's hint (wire.Error.retry_after_ms)

    @property
    def recoverable(self) -> bool:
        return self.code in RECOVERABLE


class InsecureLink(ValueError):
    """The token would cross the network in clear."""


def is_loopback_host(host: str | None) -> bool:
    """localhost or a loopback address; a name is not resolved (a name may point anywhere tomorrow)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host or "").is_loopback
    except ValueError:
        return False


def tls_context(url: str, token: str, ca_file: str = "", allow_insecure: bool = False) -> ssl.SSLContext | None:
    """The client TLS context for a wss:// URL (None for ws://); raises InsecureLink for a token in clear."""
    parts = urlsplit(url)
    if parts.scheme == "wss":
        try:
            return ssl.create_default_context(cafile=ca_file or None)
        except (OSError, ssl.SSLError) as e:
            raise ValueError(f"link.ca_file {ca_file!r}: {e}") from None
    if token and not allow_insecure and not is_loopback_host(parts.hostname):
        raise InsecureLink(
            f"refusing to send the verifier token in clear over ws:// to {parts.hostname}: use "
            f"wss:// (server-bridge serve --tls-cert/--tls-key; link.ca_file here) or set "
            f"link.allow_insecure = true on a network you trust"
        )
    return None


class VerifierLink:
    def __init__(
        self,
        url: str,
        *,
        token: str = "",
        client: str = "edge-agent",
        vocab_hash: str,
        vocab_size: int,
        open_timeout_s: float = 5.0,
        recv_timeout_s: float = 30.0,
        keepalive_s: float = 2.0,
        ca_file: str = "",
        allow_insecure: bool = False,
        robot_id: str = "",
    ):
        self.ssl = tls_context(url, token, ca_file, allow_insecure)
        if robot_id and not ROBOT_ID.fullmatch(robot_id):
            raise ValueError(f"robot id must be 1-64 of [A-Za-z0-9_.:-], got {robot_id!r}")
        self.robot_id = robot_id  # X-Robot-Id: what a balancer hashes to pick the replica
        self.url = url
        self.token = token
        self.client = client
        self.vocab_hash = vocab_hash
        self.vocab_size = vocab_size
        self.open_timeout_s = open_timeout_s
        self.recv_timeout_s = recv_timeout_s
        self.keepalive_s = keepalive_s  # a dead link shows within ~2 keepalives, not websockets' 20 s
        self.ws: ClientConnection | None = None
        self._stack = contextlib.ExitStack()  # owns the connection (websockets wants a context manager)
        self.welcome: wire.Welcome | None = None
        self.bytes_up = 0
        self.bytes_down = 0
        self.stale = 0  # late messages for sessions no longer current

    def connect(self) -> wire.Welcome:
        """Open the connection and do the handshake; raises LinkLost or ServerError (e.g. vocab_mismatch)."""
        self.close()
        try:
            self.ws = self._stack.enter_context(
                connect(
                    self.url,
                    open_timeout=self.open_timeout_s,
                    max_size=2 * wire.DEFAULT_MAX_FRAME_BYTES,
                    ping_interval=self.keepalive_s,
                    ping_timeout=self.keepalive_s,
                    close_timeout=1.0,
                    compression=None,
                    additional_headers={"X-Robot-Id": self.robot_id} if self.robot_id else None,
                    ssl=self.ssl,  # None for ws://
                )
            )
        except InvalidStatus as e:
            status = e.response.status_code
            body = e.response.body.decode("utf-8", "replace").strip() if e.response.body else ""
            if status == 403:  # not for us: retrying will not help
                raise ServerError("forbidden", body or "HTTP 403") from None
            # 503 (full) and anything else: transient, the decoder backs off and retries
            raise LinkLost(f"verifier at {self.url} refused the connection: HTTP {status} {body}") from None
        except ssl.SSLCertVerificationError as e:  # not for us (or someone in between): retrying will not help
            raise ServerError(
                "tls", f"the verifier at {self.url} failed TLS verification: {e.verify_message}; check link.ca_file"
            ) from None
        except (OSError, InvalidHandshake, TimeoutError, ConnectionClosed) as e:  # closed mid-handshake too
            raise LinkLost(f"cannot reach verifier at {self.url}: {e}") from None
        except InvalidURI as e:
            raise ValueError(f"bad verifier URL {self.url!r}: {e}") from None
        self.send(
            wire.Hello(
                token=self.token, client=self.client, draft_vocab_hash=self.vocab_hash, vocab_size=self.vocab_size
            )
        )
        reply = self.recv()
        if not isinstance(reply, wire.Welcome):
            raise ProtocolViolation(f"expected welcome, got {reply.TYPE}")
        if reply.vocab_size > self.vocab_size or reply.vocab_hash != self.vocab_hash:
            # the server refuses a draft of another vocabulary; one that welcomes it anyway is not agreeing.
            # Welcome names the agreed vocabulary: the real part both hashes cover (modelfiles.vocab_hash),
            # which is the draft's own less any tail of padding ids it has, so never more than the draft's.
            raise ProtocolViolation(
                f"the verifier welcomed a vocabulary of {reply.vocab_size} tokens (hash {reply.vocab_hash[:12]}), "
                f"the draft's has {self.vocab_size} (hash {self.vocab_hash[:12]})"
            )
        bad = next((t for t in reply.eos_ids if t >= reply.vocab_size), None)
        if bad is not None:
            raise ProtocolViolation(f"welcome names stop id {bad}, outside the vocabulary of {reply.vocab_size}")
        self.welcome = reply
        return reply

    def send(self, msg: wire.Message) -> None:
        if self.ws is None:
            raise LinkLost("not connected")
        frame = wire.encode(msg)
        try:
            self.ws.send(frame)
        except ConnectionClosed as e:
            why, restart = _closed(e)
            raise LinkLost(f"send failed: {why}", restart) from None
        except OSError as e:
            raise LinkLost(f"send failed: {e}") from None
        self.bytes_up += len(frame)

    def recv(self, sid: str | None = None, timeout_s: float | None = None) -> wire.Message:
        """Next message (for session `sid`, if given); an `error` message is raised as ServerError.

        Messages about another session are late answers for a generation that
        already ended (a `close` racing an eviction, say): they are counted in
        `stale` and skipped, never taken as the reply to the current request.
        """
        if self.ws is None:
            raise LinkLost("not connected")
        timeout = self.recv_timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout
        while True:
            try:
                frame = self.ws.recv(timeout=max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                raise LinkLost(f"no answer from the verifier in {timeout:.1f}s") from None
            except ConnectionClosed as e:
                why, restart = _closed(e)
                raise LinkLost(f"connection lost: {why}", restart) from None
            except OSError as e:
                raise LinkLost(f"connection lost: {e}") from None
            self.bytes_down += len(frame)
            try:
                msg = wire.decode(frame, max_bytes=2 * wire.DEFAULT_MAX_FRAME_BYTES)
            except wire.WireError as e:
                raise LinkLost(f"undecodable message from the verifier: {e}") from None
            msg_sid = getattr(msg, "sid", None)
            if sid is not None and msg_sid is not None and msg_sid != sid:
                self.stale += 1
                log.debug("skipping a late %s for session %s", msg.TYPE, msg_sid)
                continue
            if isinstance(msg, wire.Error):
                raise ServerError(msg.code, msg.message, msg.sid, msg.retry_after_ms)
            return msg

    def request(
        self, msg: wire.Message, timeout_s: float | None = None, meanwhile: Callable[[], object] | None = None
    ) -> tuple[wire.Message, float]:
        """Send and wait for the reply to it; returns the reply with the round-trip time in ms.

        `meanwhile`: the caller's own work, done once the message is sent and before the reply is read (the
        robot's draft prefills its prompt while the server prefills its own); the reply's deadline counts it."""
        t0 = time.perf_counter()
        # one deadline for the reply, however many late hints come first (a flood of them cannot stall it)
        deadline = time.monotonic() + (self.recv_timeout_s if timeout_s is None else timeout_s)
        self.send(msg)
        if meanwhile is not None:
            meanwhile()
        while True:
            reply = self.recv(sid=getattr(msg, "sid", None), timeout_s=max(0.0, deadline - time.monotonic()))
            if not isinstance(reply, wire.Exit):  # a late early-exit hint: no use outside FSD's loop
                break
            self.stale += 1
        return reply, (time.perf_counter() - t0) * 1e3

    def ping(self) -> None:
        """Send a ping; `latency_ms` updates when its pong comes back (keepalive pings update it too)."""
        if self.ws is None:
            raise LinkLost("not connected")
        try:
            self.ws.ping()
        except (ConnectionClosed, OSError) as e:
            raise LinkLost(f"ping failed: {e}") from None

    @property
    def latency_ms(self) -> float:
        """The last measured round trip of a ping (0.0 before the first)."""
        return 0.0 if self.ws is None else self.ws.latency * 1e3

    def close(self) -> None:
        if self.ws is not None:
            self.ws = None
            try:
                self._stack.close()
            except Exception:  # closing a broken socket may raise anything; it is gone either way
                pass
