"""The OpenAI endpoint (agent/app/openai_api.py) as a hostile local peer meets it: a web page in a browser on
the robot's machine (DNS rebinding, a cross-site POST, an Origin), sockets that never send a byte, a head sent
one byte at a time, and malformed HTTP. Each case here was a break on the hand-written server (issue 42): a
rebinding Host answered 200, a text/plain POST ran a generation, 32 silent sockets locked a key holder out,
a Content-Length of non-ASCII digits answered 500. A stub client: nothing here needs a model."""

from __future__ import annotations

import http.client
import json
import socket
import time

import pytest

from agent.client import VerifierUnavailable
from tests.agent.app.test_openai_api import KEY, Endpoint

CHAT = json.dumps({"model": "stub", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}).encode()


class StubClient:
    """What the endpoint needs of a Client; every generation is counted and refused (503)."""

    offline = "refuse"
    model = "stub"

    def __init__(self) -> None:
        self.generations = 0

    def generate(self, **kw):
        self.generations += 1
        raise VerifierUnavailable("the stub has no verifier")

    def stream(self, **kw):
        self.generations += 1
        raise VerifierUnavailable("the stub has no verifier")


@pytest.fixture
def make():
    made = []

    def make(**kw) -> tuple[Endpoint, StubClient]:
        client = StubClient()
        e = Endpoint(client, **kw)
        made.append(e)
        return e, client

    yield make
    for e in made:
        e.close()


def ask(port: int, method: str, path: str, headers: dict[str, str], body: bytes = b"", source: str = "127.0.0.1"):
    """One request through http.client (a well-formed one: the library's own framing) -> (status, JSON)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30, source_address=(source, 0))
    try:
        conn.putrequest(method, path, skip_host=True, skip_accept_encoding=True)
        for name, value in headers.items():
            conn.putheader(name, value)
        if body:
            conn.putheader("Content-Length", str(len(body)))
        conn.endheaders(body or None)
        r = conn.getresponse()
        return r.status, json.loads(r.read())
    finally:
        conn.close()


def raw_answer(port: int, data: bytes) -> tuple[int, dict]:
    """Send bytes as they are; the answer's status and JSON body."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(data)
        r = http.client.HTTPResponse(s)
        r.begin()
        return r.status, json.loads(r.read())


def openai_error(status: int, body: dict) -> bool:
    return 400 <= status < 500 and set(body.get("error", {})) == {"message", "type", "param", "code"}


def closed_by_server(s: socket.socket, within: float) -> bool:
    s.settimeout(within)
    try:
        while s.recv(4096):
            pass
        return True
    except (ConnectionResetError, BrokenPipeError):
        return True
    except socket.timeout:
        return False


@pytest.mark.parametrize("key", [None, KEY])
def test_a_host_that_is_not_the_endpoints_is_refused(make, key):
    """DNS rebinding: a page's request to the endpoint's port carries the page's own name as its Host."""
    e, _ = make(api_key=key or "")
    auth = {"Authorization": f"Bearer {KEY}"} if key else {}
    for host in ("evil.example", f"evil.example:{e.port}", "127.0.0.2", "0.0.0.0", "localhost.evil.example", "a b"):
        status, body = ask(e.port, "GET", "/v1/models", {"Host": host, **auth})
        assert status == 421 and body["error"]["code"] == "host_not_allowed", host
        status, body = ask(e.port, "POST", "/v1/chat/completions", {"Host": host, **auth}, CHAT)
        assert status == 421, host
    for host in (f"127.0.0.1:{e.port}", "127.0.0.1", f"localhost:{e.port}", "LOCALHOST"):
        status, body = ask(e.port, "GET", "/v1/models", {"Host": host, **auth})
        assert status == 200 and body["data"][0]["id"] == "stub", host


def test_a_host_name_the_operator_lists_is_answered(make):
    e, _ = make(allowed_hosts=["robot.lan"])
    for host in ("robot.lan", f"ROBOT.LAN:{e.port}", "robot.lan."):
        assert ask(e.port, "GET", "/v1/models", {"Host": host})[0] == 200, host
    assert ask(e.port, "GET", "/v1/models", {"Host": "robot.lan.evil.example"})[0] == 421


def test_an_origin_the_operator_did_not_list_is_refused(make):
    e, client = make()
    here = {"Host": f"127.0.0.1:{e.port}", "Content-Type": "application/json"}
    for origin in ("http://evil.example", "null", f"http://127.0.0.1:{e.port}", "https://ui.robot.lan"):
        status, body = ask(e.port, "GET", "/v1/models", {**here, "Origin": origin})
        assert status == 403 and body["error"]["code"] == "origin_not_allowed", origin
        status, body = ask(e.port, "POST", "/v1/chat/completions", {**here, "Origin": origin}, CHAT)
        assert status == 403, origin
    assert client.generations == 0


def test_an_origin_the_operator_lists_is_let_in(make):
    e, _ = make(allowed_origins=["https://ui.robot.lan"])
    here = {"Host": f"127.0.0.1:{e.port}"}
    assert ask(e.port, "GET", "/v1/models", {**here, "Origin": "https://ui.robot.lan"})[0] == 200
    assert ask(e.port, "GET", "/v1/models", {**here, "Origin": "https://ui.robot.lan.evil.example"})[0] == 403


@pytest.mark.parametrize("key", [None, KEY])
def test_a_body_that_is_not_json_runs_nothing(make, key):
    """A cross-site form or text/plain POST needs no preflight: it must not reach the model, key or none."""
    e, client = make(api_key=key or "")
    head = {"Host": f"127.0.0.1:{e.port}", **({"Authorization": f"Bearer {KEY}"} if key else {})}
    for kind in ("text/plain", "text/plain;charset=UTF-8", "application/x-www-form-urlencoded", "multipart/form-data"):
        status, body = ask(e.port, "POST", "/v1/chat/completions", {**head, "Content-Type": kind}, CHAT)
        assert status == 415 and body["error"]["code"] == "unsupported_media_type", kind
    status, body = ask(e.port, "POST", "/v1/chat/completions", head, CHAT)  # no Content-Type at all
    assert status == 415 and client.generations == 0
    for kind in ("application/json", "application/json; charset=utf-8"):
        status, body = ask(e.port, "POST", "/v1/chat/completions", {**head, "Content-Type": kind}, CHAT)
        assert status == 503 and body["error"]["code"] == "verifier_unavailable"  # the stub's refusal
    assert client.generations == 2


MALFORMED = [
    "POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
    "Content-Length: \u0661\u0662\r\n\r\n{}",  # Arabic-Indic digits: str.isdigit() says yes
    "POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
    "Content-Length: \u00b2\r\n\r\n{}",  # superscript two
    "POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
    "Content-Length: -1\r\n\r\n",
    "POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
    "Content-Length: 2\r\nContent-Length: 3\r\n\r\n{}",
    "POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
    "Transfer-Encoding: chunked\r\n\r\nzz\r\n{}\r\n0\r\n\r\n",
    "GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nHost: evil.example\r\n\r\n",
    "GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\n" + "X: y\r\n" * 200 + "\r\n",
    "GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nX: " + "y" * 20_000 + "\r\n\r\n",
    "GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nno colon here\r\n\r\n",
    "GET /v1/models HTTP/9.9\r\nHost: 127.0.0.1\r\n\r\n",
    "\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03\r\n\r\n",  # a TLS hello on the plain port
    "G\u00c9T /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n",
    "GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer \u00ff\u00fe\r\n\r\n",
    "GET http://evil.example/v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n",  # absolute-form: a proxy's
    "CONNECT evil.example:443 HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n",
    "POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
    "Content-Encoding: gzip\r\nContent-Length: 4\r\n\r\nabcd",
]
# bytes that are not UTF-8 where a header's value is read
MALFORMED_BYTES = [
    # latin-1's superscript two: str.isdigit() said yes, int() said no (the hand-written server's 500)
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
    b"Content-Length: \xb2\r\n\r\n{}",
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
    b"Content-Length: 1\xb9\r\n\r\n{}",
    b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer \xff\xfe\r\n\r\n",
    b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\xff\r\n\r\n",
    b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nOrigin: \xff\r\n\r\n",
    b"GET /v1/models/\xff\xfe HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n",
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json; charset=\xff\r\n"
    b"Content-Length: 2\r\n\r\n\xff\xfe",
]


@pytest.mark.parametrize("data", [m.encode() for m in MALFORMED] + MALFORMED_BYTES)
def test_a_malformed_request_is_a_4xx_in_openai_shape(make, data):
    e, client = make(api_key=KEY)
    data = data.replace(b"\r\n\r\n", f"\r\nAuthorization: Bearer {KEY}\r\n\r\n".encode(), 1)
    status, body = raw_answer(e.port, data)
    assert openai_error(status, body), (status, body)
    assert client.generations == 0
    assert ask(e.port, "GET", "/v1/models", {"Host": "127.0.0.1", "Authorization": f"Bearer {KEY}"})[0] == 200


@pytest.mark.parametrize("silent", [32, 256])
def test_a_key_holder_is_answered_while_silent_sockets_are_open(make, silent):
    """Sockets that never send a byte (a page can open hundreds) keep nobody out: a new connection pushes out
    the oldest one that has not sent its head."""
    e, _ = make(api_key=KEY)
    socks = [socket.create_connection(("127.0.0.1", e.port), timeout=10) for _ in range(silent)]
    try:
        for _ in range(3):
            status, body = ask(e.port, "GET", "/v1/models", {"Host": "127.0.0.1", "Authorization": f"Bearer {KEY}"})
            assert status == 200 and body["data"][0]["id"] == "stub"
        assert e.api.connections <= 32
    finally:
        for s in socks:
            s.close()


def test_one_peers_sockets_do_not_take_anothers_place(make):
    """Connections are bounded per peer: 127.0.0.1's flood holds at most MAX_PER_PEER of them, and what
    127.0.0.2 opened meanwhile stays open and is answered."""
    from agent.app.openai_api import MAX_CONNECTIONS, MAX_PER_PEER

    e, _ = make(api_key=KEY)
    other = [socket.create_connection(("127.0.0.1", e.port), timeout=10, source_address=("127.0.0.2", 0))]
    flood = [socket.create_connection(("127.0.0.1", e.port), timeout=10) for _ in range(MAX_CONNECTIONS)]
    try:
        time.sleep(0.2)
        assert e.api.admission.count["127.0.0.1"] <= MAX_PER_PEER
        assert not closed_by_server(other[0], 0.1)  # not pushed out by another peer's sockets
        other[0].sendall(f"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {KEY}\r\n\r\n".encode())
        r = http.client.HTTPResponse(other[0])
        r.begin()
        assert r.status == 200 and json.loads(r.read())["data"][0]["id"] == "stub"
        assert sum(closed_by_server(s, 0.01) for s in flood) >= MAX_CONNECTIONS - MAX_PER_PEER
    finally:
        for s in other + flood:
            s.close()


def test_a_head_must_arrive_within_a_few_seconds(make):
    """A socket that sends nothing, and one that sends its head a byte at a time, are closed once
    HEAD_TIMEOUT_S has passed (the hand-written server waited 30 s)."""
    from agent.app.openai_api import HEAD_TIMEOUT_S

    e, _ = make(api_key=KEY)
    silent = socket.create_connection(("127.0.0.1", e.port), timeout=10)
    drip = socket.create_connection(("127.0.0.1", e.port), timeout=10)
    start = time.monotonic()
    try:
        head = b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: " + b"y" * 1000
        for i in range(len(head)):  # a byte every 0.25 s, until the server closes
            try:
                drip.sendall(head[i : i + 1])
            except (BrokenPipeError, ConnectionResetError):
                break
            if closed_by_server(drip, 0.25) or time.monotonic() - start > HEAD_TIMEOUT_S + 3:
                break
        assert closed_by_server(drip, 0.1) and time.monotonic() - start < HEAD_TIMEOUT_S + 3
        assert closed_by_server(silent, 1.0)
    finally:
        silent.close()
        drip.close()
