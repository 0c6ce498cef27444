"""An OpenAI-compatible endpoint on the robot: POST /v1/chat/completions and GET /v1/models, served by
`edge-agent serve` and, behind the local API's token, by the daemon (api.openai_listen).

aiohttp parses the HTTP (request line, headers, Content-Length or chunks, keep-alive), each part bounded
before it is read: the request line and each header at most MAX_LINE bytes, MAX_HEADERS of them, a body at
most MAX_BODY (413 from its Content-Length before a byte of it is read). This module keeps what is the
endpoint's own: who may ask, the routes, the schema of a request (agent/app/openai_chat.py) and the
server-sent events of a stream.

Who may ask (agent/app/http_guard.py), with or without a key: a request whose Host is neither the address
the endpoint was reached on nor a listed name (allowed_hosts) gets 421 (DNS rebinding), one with an Origin
not listed (allowed_origins) 403 (a web page), a POST whose body is not application/json 415 (a page's form
or text/plain); then `Authorization: Bearer KEY`, compared in constant time (401). A connection sends each
request's head within HEAD_TIMEOUT_S (of its opening, or of its last answer) and its body within
BODY_TIMEOUT_S; at most MAX_CONNECTIONS are open, MAX_PER_PEER from one address, and a new one pushes out
the oldest that has not sent a head, so silent sockets never keep a client with the key from its answer.
`max_pending` requests run or wait for the model at once (503 beyond, before their bodies are read).
Every error, the library's own included (a malformed request line, a bad Content-Length), is OpenAI's
shape, {"error": {"message", "type", "param", "code"}}: a 4xx for anything a client sent, a 5xx only for
the verifier or a bug. The answer's tokens are the verifier's; without it a request is refused (503
verifier_unavailable) or answered by the draft alone with "verified": false, as the request's `offline` or
the config says. docs/guide/openai.md is the page.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any, NoReturn

from aiohttp import web

from agent.client import Client, RequestError, VerifierUnavailable
from agent.decoding.link import ServerError

from . import openai_chat as chat
from .config import parse_listen
from .http_guard import Admission, HostCheck, origin_allowed

log = logging.getLogger(__name__)

MAX_LINE = 8190  # the request line and each header, in bytes (aiohttp's own default)
MAX_HEADERS = 64
MAX_BODY = 8 << 20  # four images' data URIs and the rest
MAX_BRACKETS = 100_000  # '[' and '{' characters in one body (~6 MB of Python objects at most)
MAX_DEPTH = 64  # nesting of the body's JSON
HEAD_TIMEOUT_S = 5.0  # a request's line and headers, from the connection's opening or its last answer
BODY_TIMEOUT_S = 30.0  # a request's body, once its head is in
MAX_CONNECTIONS = 128  # open at once: one that has not sent its head holds at most MAX_HEADERS lines
MAX_PER_PEER = 32  # open at once from one address (every local client, hostile ones too, is 127.0.0.1)
LINGER_S = 3.0  # a refused body is read and dropped this long, so that the client sees the refusal, not a reset
SHUTDOWN_S = 2.0  # close(): how long a request being answered may go on
LIBRARY_CODES = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large", 408: "timeout"}
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class HttpError(Exception):
    """An answer in OpenAI's error shape: HTTP status, message, type, param, code."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", **kw: Any) -> None:
        super().__init__(message)
        self.status, self.type, self.param, self.code = status, type_, kw.get("param"), kw.get("code")

    def body(self) -> dict[str, Any]:
        return {"error": {"message": str(self), "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> web.Response:
        """The answer, and the connection's end (what a client sent after a refused request is not read)."""
        headers = {"WWW-Authenticate": "Bearer"} if self.status == 401 else None
        resp = web.json_response(self.body(), status=self.status, headers=headers)
        resp.force_close()
        return resp


def fail(status: int, message: str, type_: str = "invalid_request_error", **kw: Any) -> NoReturn:
    raise HttpError(status, message, type_, **kw)


def parse_body(raw: bytes) -> Any:
    """The body's JSON, bounded: its bracket characters counted before it is parsed (inside strings too: an
    over-count, linear, never fooled by a string left open), its nesting walked after (json's own parser
    refuses deep nesting with RecursionError)."""
    if raw.count(b"[") + raw.count(b"{") > MAX_BRACKETS:
        fail(400, f"the body has over {MAX_BRACKETS} '[' and '{{' characters")
    try:
        body = json.loads(raw.decode("utf-8"), parse_constant=_no_constant)
    except UnicodeDecodeError:
        fail(400, "the body is not UTF-8")
    except (ValueError, RecursionError) as e:
        fail(400, f"the body is not valid JSON: {str(e)[:200]}")
    level, depth = ([body] if isinstance(body, (dict, list)) else []), 0
    while level:  # breadth first, one level at a time
        depth += 1
        if depth > MAX_DEPTH:
            fail(400, f"the body's JSON nests deeper than {MAX_DEPTH}")
        level = [c for v in level for c in (v.values() if isinstance(v, dict) else v) if isinstance(c, (dict, list))]
    return body


def _no_constant(name: str) -> NoReturn:
    raise ValueError(f"{name} is not a JSON number")


class OpenAiApi:
    """The endpoint over one Client (its lock: one generation at a time, shared with whatever else uses it)."""

    def __init__(
        self,
        client: Client,
        listen: str,
        *,
        api_key: str = "",
        offline: str | None = None,
        max_pending: int = 4,
        model: str | None = None,
        allowed_hosts: Iterable[str] = (),
        allowed_origins: Iterable[str] = (),
    ) -> None:
        kind, host, port = parse_listen(listen)
        if kind != "tcp":
            raise ValueError(f"the OpenAI endpoint listens on HOST:PORT, not {listen!r}")
        self.client, self.host, self.port = client, host, port
        self.api_key, self.max_pending = api_key, max_pending
        self.offline = offline or client.offline  # a request's own "offline" wins
        self.model = model or client.model
        self.hosts = HostCheck(host, allowed_hosts)
        self.origins = frozenset(allowed_origins)
        self.admission: Admission[_Connection] = Admission(MAX_CONNECTIONS, MAX_PER_PEER)
        self.pending = 0  # requests running or waiting for the model
        self.server: asyncio.Server | None = None
        self._runner: web.AppRunner | None = None

    async def start(self) -> OpenAiApi:
        app = web.Application(client_max_size=MAX_BODY, middlewares=[self._guard])
        app.router.add_get("/v1/models{slash:/?}", self._models, allow_head=False)
        app.router.add_get("/v1/models/{model:.+}", self._model, allow_head=False)
        app.router.add_post("/v1/chat/completions{slash:/?}", self._chat)
        self._runner = web.AppRunner(app, handle_signals=False, access_log=None, shutdown_timeout=SHUTDOWN_S)
        await self._runner.setup()
        manager, loop = self._runner.server, asyncio.get_running_loop()
        assert manager is not None
        # aiohttp's protocol, one per connection, under this endpoint's admission (_Connection)
        self.server = await loop.create_server(lambda: _Connection(self, manager), self.host, self.port)
        log.info("OpenAI endpoint on %s (%s)", self.address, "API key required" if self.api_key else "no API key")
        return self

    @property
    def address(self) -> str:
        if self.server is None:
            raise RuntimeError("the endpoint has no address before start()")
        host, port = self.server.sockets[0].getsockname()[:2]
        return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"

    @property
    def connections(self) -> int:
        """Connections open now, the silent ones included."""
        return len(self.admission)

    async def close(self) -> None:
        server, runner, self.server, self._runner = self.server, self._runner, None, None
        if server is not None:
            server.close()  # no new connections
        if runner is not None:
            await runner.cleanup()  # the open ones: a request being answered gets SHUTDOWN_S
        if server is not None:
            await server.wait_closed()

    # -------------------------------------------------------------- who may ask

    @web.middleware
    async def _guard(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """Every request: who may ask (Host, Origin, key), then its route; every error in OpenAI's shape."""
        conn = request.protocol if isinstance(request.protocol, _Connection) else None
        if conn is not None:
            conn.begin()
        try:
            self._check_peer(request)
            return await handler(request)
        except HttpError as e:
            return e.response()
        except web.HTTPException as e:  # aiohttp's own: no route, another method, a body over MAX_BODY
            return _library_error(request, e).response()
        except ConnectionError:
            raise  # the client left: aiohttp closes the connection
        except Exception:
            if request.writer.output_size:  # a stream has begun: aiohttp cuts the connection
                raise
            log.exception("OpenAI endpoint: request failed")  # a bug: 500, and the server stays up
            return HttpError(500, "internal error", "server_error").response()
        finally:
            if conn is not None:
                conn.end()

    def _check_peer(self, request: web.Request) -> None:
        """Host (421), Origin (403) and key (401), from the request's head alone."""
        if not request.raw_path.startswith("/"):  # absolute-form (a proxy's) names its own host; `*`: no route
            fail(400, "the request target is a path: this endpoint is not a proxy", code="malformed_request")
        hosts = request.headers.getall("Host", [])
        sock = request.transport.get_extra_info("sockname") if request.transport is not None else None
        if len(hosts) > 1 or not self.hosts.allows(hosts[0] if hosts else None, str(sock[0]) if sock else None):
            log.warning("OpenAI endpoint: refused %s: Host %s", request.remote, hosts[:2])
            fail(
                421,
                "the Host header names another site (DNS rebinding?): name the address the endpoint listens "
                "on, or list the name in allowed_hosts",
                code="host_not_allowed",
            )
        if not origin_allowed(request.headers.getall("Origin", []), self.origins):
            log.warning("OpenAI endpoint: refused %s: Origin %s", request.remote, request.headers.getall("Origin")[:2])
            fail(403, "a browser Origin is not allowed here unless allowed_origins lists it", code="origin_not_allowed")
        self._check_key(request.headers)

    def _check_key(self, headers: Mapping[str, str]) -> None:
        if not self.api_key:
            return
        scheme, _, given = headers.get("Authorization", "").partition(" ")
        given_bytes = given.strip().encode("utf-8", "surrogateescape")  # aiohttp keeps non-UTF-8 bytes as surrogates
        if scheme.lower() != "bearer" or not hmac.compare_digest(given_bytes, self.api_key.encode()):
            fail(401, "incorrect or missing API key (Authorization: Bearer KEY)", code="invalid_api_key")

    # -------------------------------------------------------------- routes

    def _card(self) -> dict[str, Any]:
        return {"id": self.model, "object": "model", "created": 0, "owned_by": "edgespec"}

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [self._card()]})

    async def _model(self, request: web.Request) -> web.Response:
        if request.match_info["model"].rstrip("/") != self.model:
            fail(404, f"no model {request.match_info['model'][:100]!r}: GET /v1/models lists it", code="not_found")
        return web.json_response(self._card())

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        if request.content_type != "application/json":
            fail(415, "the body is JSON: send it with Content-Type: application/json", code="unsupported_media_type")
        if request.headers.get("Content-Encoding", "identity").lower() != "identity":
            fail(415, "send the body uncompressed (no Content-Encoding)", code="unsupported_media_type")
        if (request.content_length or 0) > MAX_BODY:
            fail(413, f"the body is over {MAX_BODY} bytes", code="request_too_large")
        if self.pending >= self.max_pending:  # before the body is read: at most max_pending bodies in memory
            fail(503, f"{self.pending} requests are running or waiting; try again", "server_error", code="overloaded")
        self.pending += 1
        try:
            try:
                body = await asyncio.wait_for(request.read(), BODY_TIMEOUT_S)
            except asyncio.TimeoutError:
                fail(408, f"the body was not sent within {BODY_TIMEOUT_S:.0f} s", code="timeout")
            except web.RequestPayloadError as e:  # a chunk aiohttp could not parse
                fail(400, f"malformed body: {str(e)[:200]}", code="malformed_request")
            req = await self._parse(body)
            req.kwargs["peer"] = f"endpoint {request.remote or 'socket'}"  # grammar compiles take turns by caller
            return await (self._stream(req, request) if req.stream else self._complete(req))
        finally:
            self.pending -= 1

    async def _parse(self, body: bytes) -> chat.ChatRequest:
        """The request, parsed off the event loop: a schema's bounds are checked there (one linear walk; the Client
        compiles it, off the model's lock, within protocol/structured.py's 1 s deadline), and the loop keeps
        answering other clients meanwhile."""
        try:
            return await asyncio.to_thread(lambda: chat.parse_chat(parse_body(body), self.offline))
        except RequestError as e:
            fail(400, str(e), param=e.param)

    # -------------------------------------------------------------- answers

    async def _complete(self, req: chat.ChatRequest) -> web.Response:
        try:
            c = await asyncio.to_thread(self.client.generate, **req.kwargs)
        except Exception as e:
            raise _answer_error(e, req.structure) from None
        return web.json_response(chat.completion_body(req, c, chat.new_id()))

    async def _stream(self, req: chat.ChatRequest, request: web.Request) -> web.StreamResponse:
        """Server-sent events: a chunk per piece of text as the verifier commits it, then `data: [DONE]`."""
        try:
            stream = self.client.stream(**req.kwargs)
        except Exception as e:
            raise _answer_error(e, req.structure) from None
        cid, sse, held = chat.new_id(), None, ""
        pieces = iter(stream)
        try:
            while (piece := await asyncio.to_thread(next, pieces, None)) is not None:
                verified = getattr(piece, "verified", True)
                if sse is None:
                    sse = await _sse(request)
                    await _event(sse, chat.chunk(req, cid, {"role": "assistant", "content": ""}, verified))
                if req.tools:  # a call is known only once whole
                    held += piece
                else:
                    await _event(sse, chat.chunk(req, cid, {"content": str(piece)}, verified))
        except ConnectionError:
            raise  # the client left
        except Exception as e:
            err = _answer_error(e, req.structure)
            if sse is None:
                raise err from None
            await _event(sse, err.body())  # the status line is out: the error rides in the stream
            await sse.write_eof()
            return sse
        finally:
            stream.cancel()  # a client that left (or a loop shutting down) ends the generation at its next token
        await asyncio.to_thread(stream.close)  # over already: the worker thread's end
        c = stream.completion
        assert c is not None
        if sse is None:
            sse = await _sse(request)
            await _event(sse, chat.chunk(req, cid, {"role": "assistant", "content": ""}, c.verified))
        for part in chat.last_chunks(req, c, cid, held):
            await _event(sse, part)
        await sse.write(b"data: [DONE]\n\n")
        await sse.write_eof()
        return sse


class _Connection(web.RequestHandler):
    """aiohttp's protocol for one connection (it parses the requests), under the endpoint's admission: taken
    or refused as it opens, pushed out by a newer one while it has not sent a head, closed when a head is not
    in within HEAD_TIMEOUT_S; aiohttp's own answers to what it cannot parse in OpenAI's shape."""

    def __init__(self, endpoint: OpenAiApi, manager: web.Server) -> None:
        super().__init__(
            manager,
            loop=asyncio.get_running_loop(),
            keepalive_timeout=HEAD_TIMEOUT_S,
            access_log=None,  # type: ignore[arg-type]  # (None: no access log; aiohttp's annotation omits it)
            max_line_size=MAX_LINE,
            max_field_size=MAX_LINE,
            max_headers=MAX_HEADERS,
            lingering_time=LINGER_S,
            auto_decompress=False,  # a compressed body is refused (415), never inflated
        )
        self.endpoint = endpoint
        self._late: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        peer = transport.get_extra_info("peername")
        evicted = self.endpoint.admission.admit(self, str(peer[0]) if peer else "")
        if evicted is None:  # every connection that could go is answering a request
            log.debug("OpenAI endpoint: refused a connection from %s: %d open", peer, self.endpoint.connections)
            self.force_close()
            return
        for conn in evicted:
            conn.force_close()
        self._wait_head()

    def connection_lost(self, exc: BaseException | None) -> None:
        self.endpoint.admission.gone(self)
        if self._late is not None:
            self._late.cancel()
        super().connection_lost(exc)

    def begin(self) -> None:
        """A request's head is in: it is being answered."""
        self.endpoint.admission.start(self)
        if self._late is not None:
            self._late.cancel()

    def end(self) -> None:
        """Answered: the next head is due within HEAD_TIMEOUT_S."""
        self.endpoint.admission.done(self)
        self._wait_head()

    def _wait_head(self) -> None:
        if self._late is not None:
            self._late.cancel()
        self._late = asyncio.get_running_loop().call_later(HEAD_TIMEOUT_S, self._head_late)

    def _head_late(self) -> None:
        if self.endpoint.admission.is_idle(self):
            self.force_close()

    def handle_error(
        self, request: Any, status: int = 500, exc: BaseException | None = None, message: str | None = None
    ) -> web.StreamResponse:
        """What aiohttp answers a request it could not parse (400, 413, 431, ...) or a handler that failed:
        OpenAI's error shape. A failure after a stream began cuts the connection."""
        if request.writer.output_size > 0:
            raise ConnectionError("the answer had begun; the connection is cut")
        if status < 500:
            log.debug("OpenAI endpoint: malformed request from %s: %s", request.remote, message)
            err = HttpError(status, f"malformed request: {message or status}"[:300], code="malformed_request")
        else:
            if not isinstance(exc, ConnectionError):
                log.error("OpenAI endpoint: request failed", exc_info=exc)
            err = HttpError(status, "internal error", "server_error")
        return err.response()


def _answer_error(e: Exception, structure: str | None = None) -> HttpError:
    """What the Client raised -> the OpenAI error answered. A schema or grammar the Client refused (LLGuidance
    cannot enforce it) names the request's parameter it came from (`structure`: response_format or tools)."""
    if isinstance(e, RequestError):
        param = structure if structure is not None and e.param in ("schema", "grammar") else e.param
        return HttpError(400, str(e), param=param)
    if isinstance(e, VerifierUnavailable):
        return HttpError(503, str(e), "server_error", code="verifier_unavailable")
    if isinstance(e, ServerError):  # the verifier refused the request (no grammar, a bad image, ...)
        status = 400 if e.code in ("bad_image", "no_vision", "no_grammar", "too_long") else 502
        return HttpError(status, f"the verifier: {e}", "server_error" if status == 502 else "invalid_request_error")
    log.exception("OpenAI endpoint: generation failed", exc_info=e)
    return HttpError(500, f"internal error ({type(e).__name__})", "server_error")


def _library_error(request: web.Request, e: web.HTTPException) -> HttpError:
    """One of aiohttp's own refusals in OpenAI's shape."""
    path = request.path[:100]
    if e.status == 404:
        message = f"no route {path!r}: POST /v1/chat/completions, GET /v1/models"
    elif isinstance(e, web.HTTPMethodNotAllowed):
        message = f"{path} takes {', '.join(sorted(e.allowed_methods))}"
    elif e.status == 413:
        message = f"the body is over {MAX_BODY} bytes"
    else:
        message = e.reason
    return HttpError(e.status, message, code=LIBRARY_CODES.get(e.status))


async def _sse(request: web.Request) -> web.StreamResponse:
    sse = web.StreamResponse(headers={"Cache-Control": "no-cache"})
    sse.content_type = "text/event-stream"
    sse.force_close()  # a stream ends with its connection
    await sse.prepare(request)
    return sse


async def _event(sse: web.StreamResponse, obj: dict) -> None:
    await sse.write(b"data: " + json.dumps(obj).encode() + b"\n\n")
