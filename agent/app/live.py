"""The live view: the recorded channels served to Foxglove (its WebSocket protocol, v1), readable only by whom the
operator names.

    admit(origins, host, token, allowed, listen_host, credential)  the upgrade's verdict            (pure)
    Subscriptions.apply(text)                                       a client's subscribe/unsubscribe (pure)
    LiveServer(host, port, credential=..., origins=...)             .publish(messages, t_ns), .close()

Foxglove's SDK serves anyone who reaches its port: it has no credential and reads no Origin. So the live view
runs on websockets' server (which parses the HTTP upgrade and the frames, bounded) and speaks the part of
Foxglove's protocol a viewer needs: `serverInfo`, `advertise`, the client's `subscribe` / `unsubscribe`, and
binary message data (opcode 1, subscription id u32, log time u64, the CDR bytes). No client publish,
parameters or services. Before the websocket opens (process_request):

- an `Origin` header (a browser page) must be one the operator lists (record.foxglove_origins; none by
  default; Foxglove's web app is "https://app.foxglove.dev"), else 403;
- on a loopback address, `Host` must be a loopback name (a DNS-rebound page names its own), else 403;
- the credential (record.foxglove_token_file) must come as `?token=TOKEN` in the URL (Foxglove's
  "Open connection" takes ws://HOST:PORT/?token=TOKEN) or `Authorization: Bearer TOKEN`, compared in
  constant time, else 401: another local user, who can reach any loopback port, sees nothing;
- at most MAX_CLIENTS viewers at once, else 503.

An upgrade must finish within OPEN_TIMEOUT_S. Each viewer has a queue of QUEUE messages; a slow viewer loses
the oldest (counted in `dropped`), never the robot's time.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import json
import logging
import struct
import threading
from collections import deque
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any
from urllib.parse import parse_qs, urlsplit

from websockets.asyncio.server import serve
from websockets.exceptions import ConnectionClosed

log = logging.getLogger(__name__)

SUBPROTOCOLS = ("foxglove.sdk.v1", "foxglove.websocket.v1")  # the SDK's, then the older bridges'; same messages
MAX_CLIENTS = 8  # viewers at once
QUEUE = 256  # messages waiting per viewer (a step is about a dozen); past it the oldest go
MAX_CLIENT_MESSAGE = 64 * 1024  # a viewer sends only subscribe / unsubscribe
MAX_SUBSCRIPTIONS = 256  # per viewer
OPEN_TIMEOUT_S = 5.0  # an upgrade's whole handshake
MESSAGE_DATA = 1  # the binary opcode of a message


def _loopback_name(host: str) -> bool:
    if host.lower() in ("localhost", "localhost."):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _host_name(header: str) -> str:
    """The name part of a Host header ("127.0.0.1:8765" -> "127.0.0.1", "[::1]:8765" -> "::1")."""
    if header.startswith("["):
        return header[1 : header.find("]")] if "]" in header else header
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


def admit(
    origins: list[str],
    host: str | None,
    token: str | None,
    allowed: frozenset[str],
    listen_host: str,
    credential: str,
) -> tuple[HTTPStatus, str] | None:
    """None to let an upgrade in, else (status, why). origins: its Origin headers; host: its Host header; token:
    the credential it presents (None: none); allowed: the Origins the operator lists."""
    if origins and not (len(origins) == 1 and origins[0] in allowed):
        return HTTPStatus.FORBIDDEN, f"Origin {origins[0][:100]!r} is not in record.foxglove_origins"
    if _loopback_name(listen_host) and not (host and _loopback_name(_host_name(host))):
        return HTTPStatus.FORBIDDEN, f"Host {str(host)[:100]!r} is not this loopback server"
    if token is None or not hmac.compare_digest(token.encode(), credential.encode()):
        return HTTPStatus.UNAUTHORIZED, "missing or wrong credential (ws://HOST:PORT/?token=TOKEN)"
    return None


def presented_token(path: str, authorization: str | None) -> str | None:
    """The credential an upgrade presents: `?token=` in its URL, else `Authorization: Bearer`."""
    values = parse_qs(urlsplit(path).query).get("token")
    if values:
        return values[0] if len(values) == 1 else None
    scheme, _, given = (authorization or "").partition(" ")
    return given.strip() if scheme.lower() == "bearer" else None


@dataclass
class Subscriptions:
    """A viewer's subscriptions: subscription id -> channel id, from its subscribe / unsubscribe messages."""

    channel_ids: frozenset[int]
    by_id: dict[int, int] = field(default_factory=dict)

    def apply(self, text: str | bytes) -> str | None:
        """Apply one client message; returns why it was ignored (None when applied). Anything but a
        subscribe or unsubscribe of known channels within MAX_SUBSCRIPTIONS is ignored."""
        if not isinstance(text, str):
            return "a binary message (client publish is not offered)"
        try:
            msg = json.loads(text)
        except (ValueError, RecursionError):  # RecursionError: nested past json's depth
            return "not JSON"
        op = msg.get("op") if isinstance(msg, dict) else None
        if op == "subscribe" and isinstance(msg.get("subscriptions"), list):
            for sub in msg["subscriptions"]:
                sid = sub.get("id") if isinstance(sub, dict) else None
                cid = sub.get("channelId") if isinstance(sub, dict) else None
                if not (isinstance(sid, int) and _u32(sid) and type(cid) is int and cid in self.channel_ids):
                    return "a subscription of an unknown channel"
                if sid not in self.by_id and len(self.by_id) >= MAX_SUBSCRIPTIONS:
                    return "too many subscriptions"
                self.by_id[sid] = cid
            return None
        if op == "unsubscribe" and isinstance(msg.get("subscriptionIds"), list):
            for sid in msg["subscriptionIds"]:
                if _u32(sid):
                    self.by_id.pop(sid, None)
            return None
        return f"op {str(op)[:32]!r} is not offered"

    def frames(self, channel_id: int, t_ns: int, data: bytes) -> list[bytes]:
        """The message-data frames of one message, one per subscription to its channel."""
        return [
            struct.pack("<BIQ", MESSAGE_DATA, sid, t_ns) + data for sid, cid in self.by_id.items() if cid == channel_id
        ]


def _u32(v: Any) -> bool:
    return type(v) is int and 0 <= v < 2**32


class _Viewer:
    def __init__(self, channel_ids: frozenset[int]) -> None:
        self.subs = Subscriptions(channel_ids)
        self.queue: deque[bytes] = deque(maxlen=QUEUE)  # the oldest dropped when full
        self.ready = asyncio.Event()
        self.dropped = 0


class LiveServer:
    """Foxglove's live source on HOST:PORT (port 0: a free one), in a thread of its own with its own event
    loop. channels: topic -> (ROS 2 type, its message definition), advertised as channels 1, 2, ... in order.
    OSError when it cannot listen there."""

    def __init__(
        self,
        host: str,
        port: int,
        channels: dict[str, tuple[str, str]],
        *,
        credential: str,
        origins: frozenset[str] = frozenset(),
        name: str = "edge-agent",
    ) -> None:
        if not credential:
            raise ValueError("the live view needs a credential")
        self.host, self.credential, self.origins = host, credential, origins
        self.channel_ids = {topic: i for i, topic in enumerate(channels, start=1)}
        self._info = json.dumps({"op": "serverInfo", "name": name, "capabilities": [], "supportedEncodings": []})
        self._advertise = json.dumps(
            {
                "op": "advertise",
                "channels": [
                    {
                        "id": self.channel_ids[topic],
                        "topic": topic,
                        "encoding": "cdr",
                        "schemaName": kind,
                        "schemaEncoding": "ros2msg",
                        "schema": text,
                    }
                    for topic, (kind, text) in channels.items()
                ],
            }
        )
        self._viewers: set[_Viewer] = set()
        self._loop = asyncio.new_event_loop()
        self._server: Any = None
        started: dict[str, Any] = {}
        ready = threading.Event()
        self._thread = threading.Thread(
            target=self._run, args=(port, started, ready), name="foxglove-live", daemon=True
        )
        self._thread.start()
        ready.wait(10.0)
        if "error" in started or self._server is None:
            self._thread.join(5.0)
            err = started.get("error")
            raise err if isinstance(err, OSError) else OSError(f"cannot serve Foxglove on {host}:{port}: {err}")
        self.port: int = started["port"]

    def _run(self, port: int, started: dict, ready: threading.Event) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._server = self._loop.run_until_complete(self._serve(port))
            started["port"] = self._server.sockets[0].getsockname()[1]
        except Exception as e:
            started["error"] = e
            ready.set()
            self._loop.close()
            return
        ready.set()
        try:
            self._loop.run_forever()
        finally:
            self._loop.close()

    async def _serve(self, port: int) -> Any:
        return await serve(
            self._handle,
            self.host,
            port,
            subprotocols=list(SUBPROTOCOLS),  # type: ignore[arg-type]
            process_request=self._process_request,
            max_size=MAX_CLIENT_MESSAGE,
            max_queue=16,
            open_timeout=OPEN_TIMEOUT_S,
            compression=None,
        )

    def _process_request(self, connection: Any, request: Any) -> Any:
        token = presented_token(request.path, request.headers.get("Authorization"))
        verdict = admit(
            request.headers.get_all("Origin"),
            request.headers.get("Host"),
            token,
            self.origins,
            self.host,
            self.credential,
        )
        if verdict is None and len(self._viewers) >= MAX_CLIENTS:
            verdict = HTTPStatus.SERVICE_UNAVAILABLE, f"{MAX_CLIENTS} viewers already watch"
        if verdict is None:
            return None
        status, why = verdict
        peer = connection.remote_address
        log.warning("live view: refused %s: %s", peer[0] if peer else "?", why)
        return connection.respond(status, why + "\n")

    async def _handle(self, ws: Any) -> None:
        viewer = _Viewer(frozenset(self.channel_ids.values()))
        self._viewers.add(viewer)
        sender = asyncio.create_task(self._send(ws, viewer))
        try:
            await ws.send(self._info)
            await ws.send(self._advertise)
            async for text in ws:
                why = viewer.subs.apply(text)
                if why is not None:
                    log.debug("live view: ignored a message: %s", why)
        except ConnectionClosed:  # the viewer went away
            pass
        finally:
            self._viewers.discard(viewer)
            sender.cancel()

    async def _send(self, ws: Any, viewer: _Viewer) -> None:
        try:
            while True:
                await viewer.ready.wait()
                viewer.ready.clear()
                while viewer.queue:
                    await ws.send(viewer.queue.popleft())
        except ConnectionClosed:  # the handler sees it too, and ends the viewer
            pass

    def _fan_out(self, messages: list[tuple[str, bytes]], t_ns: int) -> None:
        for viewer in self._viewers:
            for topic, data in messages:
                for frame in viewer.subs.frames(self.channel_ids[topic], t_ns, data):
                    if len(viewer.queue) == viewer.queue.maxlen:
                        viewer.dropped += 1
                    viewer.queue.append(frame)
            if viewer.queue:
                viewer.ready.set()

    def publish(self, messages: list[tuple[str, bytes]], t_ns: int) -> None:
        """One step's messages (topic, CDR bytes) to every viewer subscribed to their channels; never blocks."""
        try:
            self._loop.call_soon_threadsafe(self._fan_out, messages, t_ns)
        except RuntimeError:  # closed
            pass

    def close(self) -> None:
        async def stop() -> None:
            self._server.close()
            await asyncio.wait_for(self._server.wait_closed(), 5.0)

        if self._loop.is_closed():
            return
        try:
            asyncio.run_coroutine_threadsafe(stop(), self._loop).result(10.0)
        except Exception:
            log.exception("closing the live view failed")
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(5.0)
