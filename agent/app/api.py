"""The local API other robot processes use: JSON over a websocket on a Unix socket (the default) or TCP.

Closed by default (agent/app/config.py ApiSection; docs/guide/telemetry.md):
- it listens on a Unix socket of mode 0600 (0660 and api.socket_group when one is named), at
  default_socket() unless api.listen names another; TCP only with a token, and on an address other than
  loopback only with api.allow_remote = true as well;
- with api.token (or api.token_file) configured, every connection presents it on the websocket upgrade as
  `Authorization: Bearer TOKEN` (401 otherwise); `connect()` below is the client that does;
- an upgrade with an `Origin` header (a web page in a browser) is refused with 403 unless
  api.allowed_origins lists it: robot processes send none; over TCP, one whose `Host` is neither the address
  it reached nor a name api.allowed_hosts lists is refused with 421 (a page that rebinds its own name to
  this address; agent/app/http_guard.py). websockets parses the HTTP, and closes a connection whose upgrade
  is not done within OPEN_TIMEOUT_S;
- `reset` releases the e-stop, so it carries a credential of its own, `"reset_token"` (api.reset_token or
  api.reset_token_file); without one configured, reset over the API is refused. Every estop and reset is
  logged at WARNING with its peer (address, or the Unix socket's pid and uid).

Requests (one JSON object per message) and their answers:

    {"op": "submit", "instruction": "go to the red box", "image": "<base64 JPEG/PNG>", "max_steps": 20}
                                    -> {"ok": true, "task": 3}      (image and max_steps optional)
    {"op": "cancel"}                -> {"ok": true, "dropped": 0}   the robot halts
    {"op": "status"}                -> {"ok": true, "status": {...}}
    {"op": "estop"}                 -> {"ok": true, "latched": true, "delivered": true|false}
                                       no model in the path; latched before the reply; "delivered": the
                                       robot's own e-stop (Go2 Damp) returned within 20 ms, else it is
                                       still on its way (status "driver_calls" shows it)
    {"op": "reset", "reset_token": "..."}
                                    -> {"ok": true}                 stands the robot up (Go2), then clears the
                                       e-stop latch; {"ok": false, ...} when the robot did not get ready
                                       or the reset credential is missing or wrong
    {"op": "subscribe"}             -> {"ok": true}, then events: {"event": "observation" | "reasoning" |
                                       "action" | "mode" | "task" | "estop" | "reset", ...}

With api.openai_listen the daemon also serves an OpenAI-compatible endpoint (agent/app/openai_api.py) on
its draft model, behind the same token; its answers and the navigation steps take turns on the model.

Errors are {"ok": false, "error": "..."}; a bad request never closes the connection. A request is bounded
before it is parsed: at most MAX_MESSAGE bytes (websockets refuses a larger frame), one flat JSON object (at
most MAX_CONTAINERS brackets), no NaN or Infinity; an image is bounded by its base64 length, its byte size
and its header's width and height (protocol.images.check_bytes) before any decoder runs, and only once the
robot has room for the task.
A subscriber's queue holds 256 events; when it is full the oldest are dropped and
counted in the next event's "dropped" field. The e-stop is handled inline in the
connection's coroutine, never behind a queue, and nothing on this event loop
waits for a driver: the e-stop latches and hands Damp to its own thread; a reset
(seconds of standing up) runs in a worker thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import grp
import hmac
import json
import logging
import os
import socket
import stat
import struct
from http import HTTPStatus
from typing import TYPE_CHECKING, Any, Callable, NoReturn

from websockets.asyncio.server import Server, ServerConnection, serve, unix_serve
from websockets.exceptions import ConnectionClosed
from websockets.http11 import Request, Response

from agent.robot.controllers.base import ControllerError

from .config import ConfigError, parse_listen
from .daemon import MAX_IMAGE_B64, Busy, Daemon
from .http_guard import HostCheck, origin_allowed

if TYPE_CHECKING:
    from websockets.sync.client import ClientConnection

    from .openai_api import OpenAiApi

log = logging.getLogger(__name__)

SUBSCRIBER_QUEUE = 256
MAX_MESSAGE = MAX_IMAGE_B64 + 16_384  # one request: an image's base64 (protocol.images.MAX_IMAGE_BYTES) and the rest
MAX_CONTAINERS = 32  # '[' and '{' in one request: it is one flat object, so deep nesting never reaches json
ESTOP_CONFIRM_S = 0.02  # how long an e-stop reply waits to say the driver's e-stop returned
OPEN_TIMEOUT_S = 5.0  # a connection's upgrade request and its answer, from its opening (websockets closes it)


class Refused(Exception):
    """A request the API will not carry out (a missing credential); answered {"ok": false}."""


def default_socket() -> str:
    """Where api.listen = "" listens: systemd's RuntimeDirectory (the unit's /run/edge-agent), else the user's
    $XDG_RUNTIME_DIR/edge-agent, else /tmp/edge-agent-UID (both created 0700)."""
    run = os.environ.get("RUNTIME_DIRECTORY", "").split(":")[0]
    if run:
        return os.path.join(run, "api.sock")
    base = os.environ.get("XDG_RUNTIME_DIR")
    return os.path.join(os.path.join(base, "edge-agent") if base else f"/tmp/edge-agent-{os.getuid()}", "api.sock")


def parse_request(raw: str | bytes) -> dict[str, Any]:
    """One message -> its request object; ValueError says what is wrong. Bounded before json.loads: a request
    is one flat object, so more than MAX_CONTAINERS brackets (100k-deep nesting) is refused unparsed."""
    if isinstance(raw, bytes):
        raw = raw.decode("utf-8")  # UnicodeDecodeError is a ValueError
    if raw.count("[") + raw.count("{") > MAX_CONTAINERS:
        raise ValueError(f"a request is one flat JSON object (at most {MAX_CONTAINERS} '[' or '{{')")
    try:
        req = json.loads(raw, parse_constant=_no_constant)
    except RecursionError:
        raise ValueError("a request is one flat JSON object, not a deeply nested one") from None
    if not isinstance(req, dict):
        raise ValueError("a request is a JSON object")
    if not isinstance(req.get("op"), str):
        raise ValueError('a request names its op: {"op": "status"}')
    return req


def _no_constant(name: str) -> NoReturn:
    raise ValueError(f"{name} is not a JSON number")


def connect(address: str, token: str = "", **kw: Any) -> ClientConnection:
    """A websockets.sync client of the local API at `address` (LocalApi.address: unix:PATH or ws://HOST:PORT),
    presenting `token` (api.token) as `Authorization: Bearer TOKEN`. Use it as a context manager."""
    from websockets.sync.client import connect as ws_connect
    from websockets.sync.client import unix_connect

    kw.setdefault("max_size", MAX_MESSAGE)
    if token:
        kw["additional_headers"] = {**kw.get("additional_headers", {}), "Authorization": f"Bearer {token}"}
    if address.startswith("unix:"):
        return unix_connect(address[5:], **kw)
    return ws_connect(address, **kw)


class LocalApi:
    def __init__(self, daemon: Daemon, listen: str | None = None):
        """Serve `daemon` under its config's [api] section (`listen` replaces api.listen: tests). Raises
        ConfigError for an address the section refuses and for an unreadable token file."""
        self.daemon = daemon
        self.cfg = daemon.cfg.api if listen is None else dataclasses.replace(daemon.cfg.api, listen=listen)
        self.token, self.reset_token = self.cfg.secrets()
        self.origins = frozenset(self.cfg.allowed_origins)
        where = parse_listen(self.cfg.listen)
        self.path = (where[1] or default_socket()) if where[0] == "unix" else None
        # over TCP a request names this listener in its Host (a page that rebinds its own name cannot)
        self.hosts = HostCheck(where[1], self.cfg.allowed_hosts) if where[0] == "tcp" else None
        self.server: Server | None = None
        self.openai: OpenAiApi | None = None  # api.openai_listen's endpoint, behind the same token
        # the inode of the socket file this API made: removed on close only if still ours
        self._sock_ino: int | None = None

    async def start(self) -> LocalApi:
        kw: dict[str, Any] = dict(
            max_size=MAX_MESSAGE,
            ping_interval=5,
            ping_timeout=5,
            open_timeout=OPEN_TIMEOUT_S,
            compression=None,
            process_request=self._process_request,
        )
        if self.path is not None:
            sock = self._bind_unix(self.path)
            self.server = await unix_serve(self._handle, sock=sock, **kw)
        else:
            _, host, port = parse_listen(self.cfg.listen)
            self.server = await serve(self._handle, host, port, **kw)
        if self.cfg.openai_listen:
            self.openai = await self._start_openai()
        log.info(
            "local API on %s (%s; reset %s; browser origins %s)",
            self.address,
            "token required" if self.token else "no token",
            "with its reset token" if self.reset_token else "refused: no api.reset_token_file",
            sorted(self.origins) or "refused",
        )
        return self

    @property
    def address(self) -> str:
        if self.path is not None:
            return f"unix:{self.path}"
        if self.server is None:
            raise RuntimeError("the local API has no address before start()")
        host, port = self.server.sockets[0].getsockname()[:2]
        return f"ws://[{host}]:{port}" if ":" in host else f"ws://{host}:{port}"

    async def _start_openai(self) -> OpenAiApi:
        """The OpenAI-compatible endpoint (agent/app/openai_api.py) on the daemon's draft model, its key the
        local API's token."""
        from .daemon import chat_client
        from .openai_api import OpenAiApi

        client = chat_client(self.daemon)
        endpoint = OpenAiApi(
            client,
            self.cfg.openai_listen,
            api_key=self.token,
            offline=client.offline,
            allowed_hosts=self.cfg.allowed_hosts,
            allowed_origins=self.cfg.allowed_origins,
        )
        try:
            return await endpoint.start()
        except BaseException:
            client.close()
            raise

    async def close(self) -> None:
        if self.openai is not None:
            await self.openai.close()
            await asyncio.to_thread(self.openai.client.close)  # waits for a navigation step to end
            self.openai = None
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()
        if self._sock_ino is not None and self.path is not None:
            with contextlib.suppress(OSError):
                if os.lstat(self.path).st_ino == self._sock_ino:
                    os.unlink(self.path)
            self._sock_ino = None

    # -------------------------------------------------------------- who may connect

    def _bind_unix(self, path: str) -> socket.socket:
        """A listening Unix socket at `path` (self.path), mode 0600 (0660 with api.socket_group) before anyone can
        reach it: bound under a temporary name, chmod-ed, then renamed into place (atomic)."""
        group = self.cfg.socket_group
        parent = os.path.dirname(path)
        if path == default_socket() and not os.environ.get("RUNTIME_DIRECTORY"):
            _private_dir(parent)
        if not os.path.isdir(parent):
            raise ConfigError(f"api.listen: the socket's folder {parent} does not exist")
        if os.path.lexists(path) and not stat.S_ISSOCK(os.lstat(path).st_mode):
            raise ConfigError(f"api.listen: {path} exists and is not a socket")
        if _answers(path):
            raise ConfigError(f"api.listen: another process already listens on {path}")
        gid = -1
        if group:
            try:
                gid = grp.getgrnam(group).gr_gid
            except KeyError:
                raise ConfigError(f"api.socket_group: no group {group!r} on this machine") from None
        tmp = f"{path}.{os.getpid()}.tmp"
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(tmp)
            if group:
                try:
                    os.chown(tmp, -1, gid)
                except PermissionError:
                    raise ConfigError(
                        f"api.socket_group: this user is not in group {group!r} (systemd: SupplementaryGroups=)"
                    ) from None
            os.chmod(tmp, 0o660 if group else 0o600)
            sock.listen(100)
            os.rename(tmp, path)
            self._sock_ino = os.lstat(path).st_ino
        except BaseException:
            sock.close()
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        return sock

    def _process_request(self, connection: ServerConnection, request: Request) -> Response | None:
        """Before the websocket opens: over TCP a Host that is not this listener's gets 421, a browser's Origin
        403, a missing or wrong token 401."""
        if self.hosts is not None:
            hosts = request.headers.get_all("Host")
            local = connection.local_address
            if len(hosts) > 1 or not self.hosts.allows(hosts[0] if hosts else None, str(local[0]) if local else None):
                log.warning("local API: refused %s: Host %s (not in api.allowed_hosts)", _peer(connection, None), hosts)
                return connection.respond(
                    HTTPStatus.MISDIRECTED_REQUEST, "the Host header names another site (api.allowed_hosts)\n"
                )
        origins = request.headers.get_all("Origin")
        if not origin_allowed(origins, self.origins):
            log.warning(
                "local API: refused %s: Origin %s (not in api.allowed_origins)", _peer(connection, self.path), origins
            )
            return connection.respond(HTTPStatus.FORBIDDEN, "a browser Origin is not allowed on the local API\n")
        if self.token:
            scheme, _, given = request.headers.get("Authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), self.token.encode()):
                log.warning("local API: refused %s: missing or wrong token", _peer(connection, self.path))
                response = connection.respond(
                    HTTPStatus.UNAUTHORIZED, "the local API wants 'Authorization: Bearer TOKEN' (api.token)\n"
                )
                response.headers["WWW-Authenticate"] = "Bearer"
                return response
        return None

    # -------------------------------------------------------------- requests

    async def _handle(self, ws: ServerConnection) -> None:
        peer = _peer(ws, self.path)
        unlisten = None
        sender = None
        try:
            async for raw in ws:
                req = None
                reply: dict[str, Any]
                try:
                    req = parse_request(raw)
                    op = req["op"]
                    if op == "estop":  # first, and inline
                        reply = {"ok": True, "latched": True, "delivered": await self._estop(peer)}
                    elif op == "subscribe":
                        if unlisten is None:
                            events: asyncio.Queue[dict] = asyncio.Queue(SUBSCRIBER_QUEUE)
                            unlisten = self.daemon.listen(self._forwarder(events))
                            sender = asyncio.create_task(self._send_events(ws, events))
                        reply = {"ok": True}
                    else:
                        reply = await self._call(op, req, peer)
                except (ValueError, TypeError, Busy, ControllerError, Refused) as e:
                    reply = {"ok": False, "error": str(e)}
                except Exception as e:  # a bug must not close the connection (1011) of an e-stop client
                    log.exception("local API: request from %s failed", peer)
                    reply = {"ok": False, "error": f"internal error ({type(e).__name__}); see the daemon's log"}
                op = req.get("op") if isinstance(req, dict) else None
                reply["op"] = op if isinstance(op, str) and len(op) <= 32 else None
                await ws.send(json.dumps(reply, default=str))
        except ConnectionClosed:
            pass
        finally:
            if unlisten is not None:
                unlisten()
            if sender is not None:
                sender.cancel()

    async def _estop(self, peer: str) -> bool:
        """Latch (before the first await) and wait briefly, without blocking the loop, for the driver's e-stop."""
        delivery = asyncio.wrap_future(self.daemon.estop(by=peer))
        delivery.add_done_callback(lambda f: f.cancelled() or f.exception())  # a late failure is the lane's to log
        try:
            await asyncio.wait_for(asyncio.shield(delivery), ESTOP_CONFIRM_S)  # shield: never cancel the Damp
            return True
        except asyncio.TimeoutError:
            return False
        except Exception:  # the driver's e-stop failed: logged by its lane; the latch holds anyway
            return False

    async def _call(self, op: str, req: dict[str, Any], peer: str) -> dict[str, Any]:
        d = self.daemon
        if op == "submit":
            task = await asyncio.to_thread(d.submit, req.get("instruction", ""), req.get("image"), req.get("max_steps"))
            return {"ok": True, "task": task}
        if op == "cancel":
            return {"ok": True, "dropped": d.cancel()}
        if op == "status":
            return {"ok": True, "status": d.status()}
        if op == "reset":
            self._check_reset(req, peer)
            await asyncio.to_thread(d.reset, by=peer)
            return {"ok": True}
        raise ValueError(f"unknown op {op[:32]!r}; use submit, cancel, status, estop, reset or subscribe")

    def _check_reset(self, req: dict[str, Any], peer: str) -> None:
        if not self.reset_token:
            log.warning("reset from %s refused: no reset credential configured (the e-stop stays latched)", peer)
            raise Refused(
                "reset releases the e-stop, so over the local API it needs a credential of its own: set "
                'api.reset_token_file (or api.reset_token) and send {"op": "reset", "reset_token": ...}; '
                "the e-stop stays latched"
            )
        given = req.get("reset_token")
        if not isinstance(given, str) or not hmac.compare_digest(given.encode(), self.reset_token.encode()):
            log.warning("reset from %s refused: missing or wrong reset_token (the e-stop stays latched)", peer)
            raise Refused("reset refused: missing or wrong reset_token (api.reset_token); the e-stop stays latched")

    def _forwarder(self, events: asyncio.Queue[dict]) -> Callable[[dict], None]:
        """The daemon's listener for one subscriber: onto its bounded queue from any thread; when the queue is
        full the oldest event goes, and the next event says how many went (`dropped`)."""
        loop = asyncio.get_running_loop()
        dropped = [0]

        def put(event: dict) -> None:
            if events.full():
                try:
                    events.get_nowait()
                    dropped[0] += 1
                except asyncio.QueueEmpty:
                    pass
            if dropped[0]:
                event = {**event, "dropped": dropped[0]}
            events.put_nowait(event)

        def forward(event: dict) -> None:
            loop.call_soon_threadsafe(put, event)

        return forward

    @staticmethod
    async def _send_events(ws: ServerConnection, events: asyncio.Queue[dict]) -> None:
        try:
            while True:
                await ws.send(json.dumps(await events.get(), default=str))
        except ConnectionClosed:
            pass


def _peer(connection: ServerConnection, path: str | None) -> str:
    """Who is on the other end, for the log: HOST:PORT over TCP; over the Unix socket at `path` the peer's pid
    and uid (SO_PEERCRED)."""
    addr = connection.remote_address
    if addr:
        return f"{addr[0]}:{addr[1]}"
    sock = connection.transport.get_extra_info("socket")
    try:
        pid, uid, _ = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
        return f"pid {pid} uid {uid} on unix:{path}"
    except (AttributeError, OSError):  # no SO_PEERCRED (not Linux)
        return f"unix:{path}"


def _private_dir(path: str) -> None:
    """The default socket's folder: created 0700, and refused unless this user owns it and nobody else can
    write it (a folder in /tmp someone else made first could swap the socket)."""
    os.makedirs(path, 0o700, exist_ok=True)
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o022:
        raise ConfigError(
            f"api.listen: the default socket's folder {path} is not a folder of this user's that only it can "
            'write; remove it, or set api.listen = "unix:/PATH"'
        )


def _answers(path: str) -> bool:
    """Whether something listens on the Unix socket at `path` already (a stale file does not)."""
    if not os.path.exists(path):
        return False
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(1.0)
        try:
            s.connect(path)
            return True
        except OSError:
            return False
