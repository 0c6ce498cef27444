"""An OpenAI-compatible endpoint on the robot: POST /v1/chat/completions and GET /v1/models over HTTP/1.1,
served by `edge-agent serve` and, behind the local API's token, by the daemon (api.openai_listen).

A small asyncio server, one request per connection (`Connection: close`), every input bounded before it is
parsed: the request line and each header line (MAX_LINE), the header count, Content-Length against MAX_BODY
(413 before a byte of the body is read), the JSON's brackets and depth, images by protocol.images; a client
that sends too slowly is dropped after READ_TIMEOUT_S. `Authorization: Bearer KEY` is compared in constant
time. At most MAX_CONNECTIONS connections are open and `max_pending` requests run or wait for the model at
once (503 beyond either). Errors are OpenAI's
shape, {"error": {"message", "type", "param", "code"}}. The answer's tokens are the verifier's; without it a
request is refused (503 verifier_unavailable) or answered by the draft alone with "verified": false, as the
request's `offline` or the config says. docs/guide/openai.md is the page.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import time
from typing import Any, NoReturn

from agent.client import Client, RequestError, VerifierUnavailable
from agent.spec.link import ServerError

from . import openai_chat as chat
from .config import parse_listen

log = logging.getLogger(__name__)

MAX_LINE = 8192  # the request line and each header line
MAX_HEADERS = 64
MAX_BODY = 8 << 20  # four images' data URIs and the rest
MAX_DISCARD = 64 << 20  # what is read and dropped of a refused body, so that the client sees the refusal
MAX_BRACKETS = 100_000  # '[' and '{' characters in one body (~6 MB of Python objects at most)
MAX_DEPTH = 64  # nesting of the body's JSON
READ_TIMEOUT_S = 30.0  # the whole request (line, headers, body)
MAX_CONNECTIONS = 32  # open at once: each may buffer a body of MAX_BODY; beyond, 503 at once and closed
REASONS = {200: "OK", 400: "Bad Request", 401: "Unauthorized", 404: "Not Found", 405: "Method Not Allowed"}
REASONS.update({411: "Length Required", 413: "Payload Too Large", 500: "Internal Server Error"})
REASONS.update({502: "Bad Gateway", 503: "Service Unavailable", 408: "Request Timeout"})


class HttpError(Exception):
    """An answer in OpenAI's error shape: HTTP status, message, type, param, code."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", **kw: Any) -> None:
        super().__init__(message)
        self.status, self.type, self.param, self.code = status, type_, kw.get("param"), kw.get("code")

    def body(self) -> dict[str, Any]:
        return {"error": {"message": str(self), "type": self.type, "param": self.param, "code": self.code}}


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
    ) -> None:
        kind, host, port = parse_listen(listen)
        if kind != "tcp":
            raise ValueError(f"the OpenAI endpoint listens on HOST:PORT, not {listen!r}")
        self.client, self.host, self.port = client, host, port
        self.api_key, self.max_pending = api_key, max_pending
        self.offline = offline or client.offline  # a request's own "offline" wins
        self.model = model or client.model
        self.pending = 0  # requests running or waiting for the model
        self.connections = 0  # open connections, the silent ones included
        self.server: asyncio.Server | None = None

    async def start(self) -> OpenAiApi:
        self.server = await asyncio.start_server(self._handle, self.host, self.port, limit=MAX_LINE)
        log.info("OpenAI endpoint on %s (%s)", self.address, "API key required" if self.api_key else "no API key")
        return self

    @property
    def address(self) -> str:
        if self.server is None:
            raise RuntimeError("the endpoint has no address before start()")
        host, port = self.server.sockets[0].getsockname()[:2]
        return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()

    # -------------------------------------------------------------- one connection

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.connections >= MAX_CONNECTIONS:  # silent or slow clients cannot hold more memory than this
            busy = HttpError(503, "too many connections; try again", "server_error", code="overloaded")
            with contextlib.suppress(Exception):
                await _send_json(writer, 503, busy.body())
                writer.write_eof()  # the answer, then the end: the client closes, and its request is dropped
                await _discard(reader, MAX_LINE)  # (read, not left unread: that would reset the connection)
            writer.close()
            return
        self.connections += 1
        try:
            await self._serve(reader, writer)
        finally:
            self.connections -= 1

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        unread = 0  # the body's bytes still on the wire: after an early error they are drained, else the close resets
        try:
            try:
                deadline = time.monotonic() + READ_TIMEOUT_S
                method, path, headers = await asyncio.wait_for(_head(reader), READ_TIMEOUT_S)
                declared = headers.get("content-length", "0")
                unread = int(declared) if declared.isdigit() and len(declared) <= 12 else 0
                path = self._check(method, path, headers)  # 404, 401, 405, 411, 413 before the body is read
                if headers.get("expect", "").lower() == "100-continue":
                    writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
                length = int(headers.get("content-length", "0"))
                body = await asyncio.wait_for(reader.readexactly(length), max(0.1, deadline - time.monotonic()))
                unread = 0
                await self._answer(path, body, writer)
            except asyncio.TimeoutError:
                await _send_json(writer, 408, HttpError(408, "the request was not sent in time").body())
            except HttpError as e:
                await _send_json(writer, e.status, e.body())
                if unread:
                    await _discard(reader, unread)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass  # the client went away
        except Exception:  # a bug answers 500 and leaves the server up
            log.exception("OpenAI endpoint: request failed")
            with contextlib.suppress(Exception):
                await _send_json(writer, 500, HttpError(500, "internal error", "server_error").body())
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    def _check(self, method: str, path: str, headers: dict[str, str]) -> str:
        """The route of a request, checked from its head alone: path, key, method and the body's size."""
        path = path.split("?", 1)[0].rstrip("/")
        routes = {"/v1/models": "GET", "/v1/chat/completions": "POST", f"/v1/models/{self.model}": "GET"}
        if path not in routes:
            fail(404, f"no route {path[:100]!r}: POST /v1/chat/completions, GET /v1/models", code="not_found")
        self._check_key(headers)
        if method != routes[path]:
            fail(405, f"{path} takes {routes[path]}", code="method_not_allowed")
        if "transfer-encoding" in headers:
            fail(411, "send the body with a Content-Length, not chunked")
        length = headers.get("content-length", "0")
        if not length.isdigit() or len(length) > 12:
            fail(400, "Content-Length is a number")
        if int(length) > MAX_BODY:
            fail(413, f"the body is over {MAX_BODY} bytes", code="request_too_large")
        return path

    async def _answer(self, path: str, body: bytes, writer: asyncio.StreamWriter) -> None:
        if path != "/v1/chat/completions":
            card = {"id": self.model, "object": "model", "created": 0, "owned_by": "edgespec"}
            await _send_json(writer, 200, card if path != "/v1/models" else {"object": "list", "data": [card]})
            return
        req = self._parse(body)
        if self.pending >= self.max_pending:
            fail(503, f"{self.pending} requests are running or waiting; try again", "server_error", code="overloaded")
        self.pending += 1
        try:
            if req.stream:
                await self._stream(req, writer)
            else:
                await self._complete(req, writer)
        finally:
            self.pending -= 1

    def _check_key(self, headers: dict[str, str]) -> None:
        if not self.api_key:
            return
        scheme, _, given = headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), self.api_key.encode()):
            fail(401, "incorrect or missing API key (Authorization: Bearer KEY)", code="invalid_api_key")

    def _parse(self, body: bytes) -> chat.ChatRequest:
        try:
            return chat.parse_chat(parse_body(body), self.offline)
        except RequestError as e:
            fail(400, str(e), param=e.param)

    # -------------------------------------------------------------- answers

    async def _complete(self, req: chat.ChatRequest, writer: asyncio.StreamWriter) -> None:
        try:
            c = await asyncio.to_thread(self.client.generate, **req.kwargs)
        except Exception as e:
            raise _answer_error(e) from None
        await _send_json(writer, 200, chat.completion_body(req, c, chat.new_id()))

    async def _stream(self, req: chat.ChatRequest, writer: asyncio.StreamWriter) -> None:
        """Server-sent events: a chunk per piece of text as the verifier commits it, then `data: [DONE]`."""
        try:
            stream = self.client.stream(**req.kwargs)
        except Exception as e:
            raise _answer_error(e) from None
        cid, started, held = chat.new_id(), False, ""
        pieces = iter(stream)
        try:
            while (piece := await asyncio.to_thread(next, pieces, None)) is not None:
                verified = getattr(piece, "verified", True)
                if not started:
                    await _sse_head(writer)
                    await _event(writer, chat.chunk(req, cid, {"role": "assistant", "content": ""}, verified))
                    started = True
                if req.tools:  # a call is known only once whole
                    held += piece
                else:
                    await _event(writer, chat.chunk(req, cid, {"content": str(piece)}, verified))
        except Exception as e:
            err = _answer_error(e)
            if not started:
                raise err from None
            await _event(writer, err.body())  # the status line is out: the error rides in the stream
            return
        finally:
            stream.cancel()  # a client that left (or a loop shutting down) ends the generation at its next token
        await asyncio.to_thread(stream.close)  # over already: the worker thread's end
        c = stream.completion
        assert c is not None
        if not started:
            await _sse_head(writer)
            await _event(writer, chat.chunk(req, cid, {"role": "assistant", "content": ""}, c.verified))
        for part in chat.last_chunks(req, c, cid, held):
            await _event(writer, part)
        writer.write(b"data: [DONE]\n\n")
        await writer.drain()


def _answer_error(e: Exception) -> HttpError:
    """What the Client raised -> the OpenAI error answered."""
    if isinstance(e, RequestError):
        return HttpError(400, str(e), param=e.param)
    if isinstance(e, VerifierUnavailable):
        return HttpError(503, str(e), "server_error", code="verifier_unavailable")
    if isinstance(e, ServerError):  # the verifier refused the request (no grammar, a bad image, ...)
        status = 400 if e.code in ("bad_image", "no_vision", "no_grammar", "too_long") else 502
        return HttpError(status, f"the verifier: {e}", "server_error" if status == 502 else "invalid_request_error")
    log.exception("OpenAI endpoint: generation failed", exc_info=e)
    return HttpError(500, f"internal error ({type(e).__name__})", "server_error")


async def _head(reader: asyncio.StreamReader) -> tuple[str, str, dict[str, str]]:
    """The request line and headers, each line bounded before it is read (MAX_LINE), MAX_HEADERS of them."""
    parts = (await _line(reader)).split(" ")
    if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
        fail(400, "a request line is METHOD PATH HTTP/1.1")
    headers: dict[str, str] = {}
    while (h := await _line(reader)) != "":
        name, colon, value = h.partition(":")
        if not colon or len(headers) >= MAX_HEADERS:
            fail(400, f"a header is NAME: VALUE, at most {MAX_HEADERS} of them")
        headers[name.strip().lower()] = value.strip()
    return parts[0], parts[1], headers


async def _discard(reader: asyncio.StreamReader, declared: int) -> None:
    """Read and drop the body a client still sends after an early error (its Content-Length, at most MAX_DISCARD
    bytes, 3 s): a socket closed with unread data resets the connection, and the client would see the reset,
    not the error."""

    async def drain() -> None:
        left = min(declared, MAX_DISCARD)
        while left > 0 and (chunk := await reader.read(min(left, 65536))):
            left -= len(chunk)

    with contextlib.suppress(Exception):
        await asyncio.wait_for(drain(), 3.0)


async def _line(reader: asyncio.StreamReader) -> str:
    """One CRLF-ended line of at most MAX_LINE bytes (the reader's limit), as latin-1."""
    try:
        raw = await reader.readuntil(b"\n")
    except asyncio.LimitOverrunError:
        fail(400, f"a request or header line is over {MAX_LINE} bytes")
    except asyncio.IncompleteReadError:
        raise ConnectionError("closed mid-request") from None
    return raw.decode("latin-1").rstrip("\r\n")


async def _send_json(writer: asyncio.StreamWriter, status: int, obj: Any) -> None:
    body = json.dumps(obj).encode()
    head = (
        f"HTTP/1.1 {status} {REASONS.get(status, 'Error')}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n"
    )
    if status == 401:
        head += "WWW-Authenticate: Bearer\r\n"
    writer.write(head.encode() + b"\r\n" + body)
    await writer.drain()


async def _sse_head(writer: asyncio.StreamWriter) -> None:
    writer.write(
        b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\nConnection: close\r\n\r\n"
    )
    await writer.drain()


async def _event(writer: asyncio.StreamWriter, obj: dict) -> None:
    writer.write(b"data: " + json.dumps(obj).encode() + b"\n\n")
    await writer.drain()
