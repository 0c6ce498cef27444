"""The robot's websocket link to server-bridge: connect, handshake, send and receive messages.

Synchronous (websockets.sync.client) because the decode loop is sequential;
the receiver thread of later modes wraps the same `recv`. Not thread-safe.
"""
from __future__ import annotations

import contextlib
import logging
import time

from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidStatus, InvalidURI
from websockets.sync.client import connect

from protocol import wire

log = logging.getLogger(__name__)

# A server error that re-opening the session with the committed prefix repairs.
RECOVERABLE = {"unknown_session", "desync"}
# The session id is held by another connection and our prompt does not carry its committed prefix
# (a named session re-opened with a new prompt after the link dropped between two generations):
# re-opening the same id cannot help, a fresh id does (agent/decoder.py switches once per open).
TAKEN = "session_taken"


class LinkLost(ConnectionError):
    """The connection dropped, timed out or could not be made; reconnecting may help."""
    token_ids: list[int] = []       # raised out of EdgeDecoder.generate: the ids committed before the failure


class ServerError(RuntimeError):
    """The server answered with `error`."""

    token_ids: list[int] = []       # raised out of EdgeDecoder.generate: the ids committed before the failure

    def __init__(self, code: str, message: str, sid: str | None = None):
        super().__init__(f"server error {code}: {message}")
        self.code = code
        self.message = message
        self.sid = sid

    @property
    def recoverable(self) -> bool:
        return self.code in RECOVERABLE


class VerifierLink:
    def __init__(self, url: str, *, token: str = "", client: str = "edge-agent", vocab_hash: str,
                 vocab_size: int, open_timeout_s: float = 5.0, recv_timeout_s: float = 30.0,
                 keepalive_s: float = 2.0):
        self.url = url
        self.token = token
        self.client = client
        self.vocab_hash = vocab_hash
        self.vocab_size = vocab_size
        self.open_timeout_s = open_timeout_s
        self.recv_timeout_s = recv_timeout_s
        self.keepalive_s = keepalive_s          # a dead link shows within ~2 keepalives, not websockets' 20 s
        self.ws = None
        self._stack = contextlib.ExitStack()   # owns the connection (websockets wants a context manager)
        self.welcome: wire.Welcome | None = None
        self.bytes_up = 0
        self.bytes_down = 0
        self.stale = 0                          # late messages for sessions no longer current

    def connect(self) -> wire.Welcome:
        """Open the connection and do the handshake; raises LinkLost or ServerError (e.g. vocab_mismatch)."""
        self.close()
        try:
            self.ws = self._stack.enter_context(connect(
                self.url, open_timeout=self.open_timeout_s, max_size=2 * wire.DEFAULT_MAX_FRAME_BYTES,
                ping_interval=self.keepalive_s, ping_timeout=self.keepalive_s, close_timeout=1.0,
                compression=None))
        except InvalidStatus as e:
            status = e.response.status_code
            body = e.response.body.decode("utf-8", "replace").strip() if e.response.body else ""
            if status == 403:                   # not for us: retrying will not help
                raise ServerError("forbidden", body or "HTTP 403") from None
            # 503 (full) and anything else: transient, the decoder backs off and retries
            raise LinkLost(f"verifier at {self.url} refused the connection: HTTP {status} {body}") from None
        except (OSError, InvalidHandshake, TimeoutError, ConnectionClosed) as e:   # closed mid-handshake too
            raise LinkLost(f"cannot reach verifier at {self.url}: {e}") from None
        except InvalidURI as e:
            raise ValueError(f"bad verifier URL {self.url!r}: {e}") from None
        self.send(wire.Hello(token=self.token, client=self.client, draft_vocab_hash=self.vocab_hash,
                             vocab_size=self.vocab_size))
        reply = self.recv()
        if not isinstance(reply, wire.Welcome):
            raise LinkLost(f"expected welcome, got {reply.TYPE}")
        self.welcome = reply
        return reply

    def send(self, msg: wire.Message) -> None:
        if self.ws is None:
            raise LinkLost("not connected")
        frame = wire.encode(msg)
        try:
            self.ws.send(frame)
        except (ConnectionClosed, OSError) as e:
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
            except (ConnectionClosed, OSError) as e:
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
                raise ServerError(msg.code, msg.message, msg.sid)
            return msg

    def request(self, msg: wire.Message, timeout_s: float | None = None) -> tuple[wire.Message, float]:
        """Send and wait for the reply to it; returns the reply with the round-trip time in ms."""
        t0 = time.perf_counter()
        self.send(msg)
        while True:
            reply = self.recv(sid=getattr(msg, "sid", None), timeout_s=timeout_s)
            if not isinstance(reply, wire.Exit):      # a late early-exit hint: no use outside FSD's loop
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
            except Exception:           # closing a broken socket may raise anything; it is gone either way
                pass
