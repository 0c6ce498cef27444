"""The OpenAI-compatible endpoint (agent/app/openai_api.py) against a real verifier, driven by the official
`openai` client and by raw HTTP: its ids are `edge-agent generate`'s, streams in order, schemas and tool calls
hold, offline both ways, and bad requests get OpenAI's error shape."""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from protocol import structured

pytestmark = pytest.mark.real

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

KEY = "test-key-0123456789abcdef"
ASK = [{"role": "user", "content": "Name three colours."}]
ROOT = Path(__file__).resolve().parents[3]


class Endpoint:
    """An OpenAiApi on 127.0.0.1:0, its event loop in a daemon thread."""

    def __init__(self, client, **kw):
        from agent.app.openai_api import OpenAiApi

        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="test-openai", daemon=True)
        self.thread.start()
        self.api = OpenAiApi(client, "127.0.0.1:0", **kw)
        asyncio.run_coroutine_threadsafe(self.api.start(), self.loop).result(10)
        self.port = self.api.server.sockets[0].getsockname()[1]

    def openai(self, key=KEY):
        return openai.OpenAI(base_url=self.api.address + "/v1", api_key=key, max_retries=0, timeout=120)

    def close(self):
        asyncio.run_coroutine_threadsafe(self.api.close(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture(scope="module")
def client(verifier, drafter):
    from agent import Client

    with Client(verifier.url, drafter=drafter) as c:
        yield c


@pytest.fixture(scope="module")
def endpoint(client):
    e = Endpoint(client, api_key=KEY)
    yield e
    e.close()


@pytest.fixture(scope="module")
def offline_endpoint(drafter):
    """An endpoint whose verifier refuses every connection (nothing listens on port 9)."""
    from agent import Client

    with Client("ws://127.0.0.1:9", drafter=drafter) as c:
        e = Endpoint(c, offline="refuse")
        yield e
        e.close()


def raw(port: int, data: bytes, read: bool = True) -> bytes:
    """Send `data` as it is and read the whole answer: its status line and headers as sent, its body as
    http.client reads it (de-chunked: a stream comes in chunks)."""
    with socket.create_connection(("127.0.0.1", port), timeout=120) as s:
        s.sendall(data)
        if not read:
            return b""
        r = http.client.HTTPResponse(s)
        r.begin()
        head = f"HTTP/{r.version // 10}.{r.version % 10} {r.status} {r.reason}\r\n"
        head += "".join(f"{name}: {value}\r\n" for name, value in r.getheaders())
        return head.encode("latin-1") + b"\r\n" + r.read()


def post(port: int, body: bytes, key: str = KEY, extra: str = "") -> bytes:
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {key}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n{extra}\r\n"
    )
    return raw(port, head.encode() + body)


def status_and_json(answer: bytes) -> tuple[int, dict]:
    head, _, body = answer.partition(b"\r\n\r\n")
    return int(head.split(b" ")[1]), json.loads(body)


def test_models_and_the_key(endpoint):
    models = endpoint.openai().models.list()
    assert [m.id for m in models.data] == [endpoint.api.model]
    with pytest.raises(openai.AuthenticationError) as e:
        endpoint.openai("wrong-key-0123456789").models.list()
    assert e.value.status_code == 401 and e.value.body["code"] == "invalid_api_key"
    status, body = status_and_json(raw(endpoint.port, b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"))
    assert status == 401 and body["error"]["type"] == "invalid_request_error"


def test_the_answer_is_edge_agent_generates(endpoint, verifier, client, capsys):
    from agent.app import cli

    prompt = ASK[0]["content"]
    rc = cli.main(
        ["generate", "--verifier", verifier.url, "--prompt", prompt, "--chat", "--max-tokens", "12"]
        + ["--threads", "1", "--json"]
    )
    assert rc == 0
    cli_ids = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["token_ids"]
    r = endpoint.openai().chat.completions.create(model="edge", messages=ASK, max_tokens=12)
    extra = r.model_extra
    assert extra["verified"] is True and extra["edge"]["verified"] is True
    assert extra["edge"]["token_ids"] == cli_ids == client.generate(messages=ASK, max_tokens=12).token_ids
    assert r.choices[0].message.content == client.drafter.detokenize(cli_ids)
    assert r.usage.completion_tokens == 12 and r.usage.total_tokens == r.usage.prompt_tokens + 12
    assert r.choices[0].finish_reason == "length" and extra["edge"]["rounds"] >= 1
    assert extra["edge"]["bytes_up"] > 0 and extra["edge"]["tau"] > 0


def test_top_p_samples_the_targets_nucleus(endpoint, client, target):
    """top_p reaches the verifier: at T 1, top_p 0.5 every committed token lies in the target's own nucleus,
    and the endpoint's seeded answer is the Client's (the same request through the same sampler)."""
    from tests.agent.decoding.test_top_p import _mass_above

    ask = dict(messages=ASK, max_tokens=16, temperature=1.0, top_p=0.5, seed=4)
    r = endpoint.openai().chat.completions.create(model="edge", **ask)
    ids = r.model_extra["edge"]["token_ids"]
    assert ids == client.generate(**ask).token_ids and len(ids) > 4
    prompt = client.drafter.tokenize(client.drafter.apply_chat_template(ASK))
    assert (_mass_above(target, prompt, ids) < 0.5 + 1e-3).all()


def test_streaming_order(endpoint):
    oc = endpoint.openai()
    whole = oc.chat.completions.create(model="edge", messages=ASK, max_tokens=16)
    chunks = list(
        oc.chat.completions.create(
            model="edge", messages=ASK, max_tokens=16, stream=True, stream_options={"include_usage": True}
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert len([c for c in chunks if c.choices and c.choices[0].delta.content]) > 3  # piece by piece
    assert all(c.model_extra["verified"] is True for c in chunks)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length" and not any(finishes[:-1])
    assert chunks[-1].usage.completion_tokens == 16 and not chunks[-1].choices
    assert [c for c in chunks if c.choices][-1].model_extra["edge"]["token_ids"] == whole.model_extra["edge"][
        "token_ids"
    ]


def test_raw_server_sent_events(endpoint):
    body = json.dumps({"model": "edge", "messages": ASK, "max_tokens": 8, "stream": True}).encode()
    head, _, stream = post(endpoint.port, body).partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200") and b"Content-Type: text/event-stream" in head
    events = [e for e in stream.decode().split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"
    objs = [json.loads(e[6:]) for e in events[:-1]]
    assert all(o["object"] == "chat.completion.chunk" and o["verified"] is True for o in objs)
    assert len({o["id"] for o in objs}) == 1 and objs[-1]["choices"][0]["finish_reason"] == "length"
    assert len(objs[-1]["edge"]["token_ids"]) == 8


SCHEMA = {
    "type": "object",
    "properties": {
        "colour": {"type": "string", "enum": ["red", "green", "blue"]},
        "count": {"type": "integer", "minimum": 0},
    },
    "required": ["colour", "count"],
    "additionalProperties": False,
}


def test_structured_output_validates(endpoint):
    r = endpoint.openai().chat.completions.create(
        model="edge",
        messages=[{"role": "user", "content": "How many red boxes are there? Answer in JSON."}],
        max_tokens=48,
        response_format={"type": "json_schema", "json_schema": {"name": "boxes", "schema": SCHEMA}},
    )
    jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)
    assert r.choices[0].finish_reason == "stop" and r.model_extra["verified"] is True
    r = endpoint.openai().chat.completions.create(
        model="edge", messages=ASK, max_tokens=48, response_format={"type": "json_object"}
    )
    assert isinstance(json.loads(r.choices[0].message.content), dict)


def test_a_schema_bound_answer_that_cannot_end_in_time_is_cut_at_length_never_called_complete(endpoint):
    """30,000,000 items at least (LLGuidance counts lazily: it compiles at once): the answer runs into max_tokens
    and says so; the text so far is a prefix of a valid instance, not JSON to trust."""
    schema = {"type": "array", "items": {"type": "integer"}, "minItems": 30_000_000}
    r = endpoint.openai().chat.completions.create(
        model="edge", messages=ASK, max_tokens=12, response_format=_format(schema)
    )
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 12
    assert r.choices[0].message.content.lstrip().startswith("[")
    with pytest.raises(ValueError):
        json.loads(r.choices[0].message.content)


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "move",
            "description": "Move the robot forward.",
            "parameters": {
                "type": "object",
                "properties": {"distance_m": {"type": "number"}},
                "required": ["distance_m"],
            },
        },
    },
    {"type": "function", "function": {"name": "stop", "description": "Stop the robot."}},
]


def test_tool_calls(endpoint):
    oc = endpoint.openai()
    ask = [{"role": "user", "content": "Move forward 2 metres."}]
    r = oc.chat.completions.create(model="edge", messages=ask, max_tokens=40, tools=TOOLS, tool_choice="required")
    call = r.choices[0].message.tool_calls[0]
    assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.content is None
    assert call.function.name in ("move", "stop") and isinstance(json.loads(call.function.arguments), dict)
    named = {"type": "function", "function": {"name": "move"}}
    chunks = list(
        oc.chat.completions.create(
            model="edge", messages=ask, max_tokens=40, tools=TOOLS, tool_choice=named, stream=True
        )
    )
    deltas = [d for c in chunks for d in (c.choices[0].delta.tool_calls or [])]
    assert deltas[0].function.name == "move" and chunks[-1].choices[0].finish_reason == "tool_calls"
    jsonschema.validate(json.loads(deltas[0].function.arguments), TOOLS[0]["function"]["parameters"])
    r = oc.chat.completions.create(model="edge", messages=ASK, max_tokens=8, tools=TOOLS, tool_choice="none")
    assert r.choices[0].message.tool_calls is None and r.choices[0].message.content


def test_offline_refused_or_answered_by_the_draft(offline_endpoint):
    oc = offline_endpoint.openai()
    with pytest.raises(openai.InternalServerError) as e:
        oc.chat.completions.create(model="edge", messages=ASK, max_tokens=8)
    assert e.value.status_code == 503 and e.value.body["code"] == "verifier_unavailable"
    r = oc.chat.completions.create(model="edge", messages=ASK, max_tokens=8, extra_body={"offline": "local"})
    assert r.model_extra["verified"] is False and r.model_extra["edge"]["mode"] == "local"
    assert r.choices[0].message.content and r.model_extra["edge"]["verified_tokens"] == 0
    chunks = list(
        oc.chat.completions.create(
            model="edge", messages=ASK, max_tokens=8, stream=True, extra_body={"offline": "local"}
        )
    )
    assert chunks and all(c.model_extra["verified"] is False for c in chunks)


def test_bad_requests_get_openai_errors(endpoint):
    oc = endpoint.openai()
    for kw, param in (
        ({"top_p": 0.0}, "top_p"),
        ({"n": 2}, "n"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"messages": []}, "messages"),
        ({"max_tokens": 50_000}, "max_tokens"),
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"tools": [{"type": "function"}]}, "tools"),
    ):
        with pytest.raises(openai.BadRequestError) as e:
            oc.chat.completions.create(**{"model": "edge", "messages": ASK, **kw})
        assert e.value.status_code == 400 and e.value.body["param"] == param, kw
        assert e.value.body["type"] == "invalid_request_error"
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]
    with pytest.raises(openai.BadRequestError):
        oc.chat.completions.create(model="edge", messages=image)
    with pytest.raises(openai.NotFoundError) as e:
        oc.get("/nowhere", cast_to=object)
    assert e.value.body["type"] == "invalid_request_error"
    for body in (b"{not json", b"[" * 100 + b"]" * 100, b'{"model": "edge", "messages": NaN}'):
        status, err = status_and_json(post(endpoint.port, body))
        assert status == 400 and set(err["error"]) == {"message", "type", "param", "code"}, body


def _format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


def test_what_ended_in_a_500_or_seconds_under_the_lock_is_a_400_at_once(endpoint):
    """A schema over the bounds or one LLGuidance cannot enforce (each named by its keyword and the request's
    parameter), a malformed tool_choice (an AttributeError or TypeError once) and an image sent to a text-only
    pair (a TypeError in the chat template): each is a 400 in OpenAI's shape, within a second."""
    from tests.protocol.test_images import png

    image = "data:image/png;base64," + __import__("base64").b64encode(png()).decode()
    one_of = {"type": "object", "oneOf": [{"required": ["a"]}, {"required": ["b"]}]}
    cases = [
        ({"response_format": _format({"type": "string", "pattern": "^a{100000000}$"})}, "pattern", "response_format"),
        (
            {"response_format": _format({"properties": {f"p{i}": {"type": "integer"} for i in range(600)}})},
            "properties",
            "response_format",
        ),
        ({"response_format": _format(one_of)}, "oneOf", "response_format"),
        ({"response_format": _format({"allOf": [{"type": "object"}, {"not": {}}]})}, "not", "response_format"),
        ({"response_format": _format({"type": "string", "pattern": "^(?=a)b$"})}, "pattern", "response_format"),
        ({"response_format": _format({"$ref": "#/$defs/missing"})}, "missing", "response_format"),
        ({"tools": [{**TOOLS[0], "function": {**TOOLS[0]["function"], "parameters": one_of}}]}, "oneOf", "tools"),
        (
            {
                "tools": [{**TOOLS[0], "function": {**TOOLS[0]["function"], "parameters": one_of}}],
                "tool_choice": "required",
            },
            "oneOf",
            "tools",
        ),
        ({"tools": TOOLS, "tool_choice": {"function": "move"}}, "tool_choice", "tool_choice"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": None}}, "tool_choice", "tool_choice"),
        ({"tools": TOOLS, "tool_choice": {"type": "function"}}, "tool_choice", "tool_choice"),
        ({"tools": TOOLS, "tool_choice": {"function": {"name": 7}}}, "tool_choice", "tool_choice"),
        ({"tools": TOOLS, "tool_choice": {"function": {"name": ["move"]}}}, "tool_choice", "tool_choice"),
        ({"tools": TOOLS, "tool_choice": {"function": {"name": "fly"}}}, "tool_choice", "tool_choice"),
        ({"tools": TOOLS, "tool_choice": 5}, "tool_choice", "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice", "tool_choice"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": image}}]}]},
            "text only",
            "messages",
        ),
    ]
    oc = endpoint.openai()
    for kw, word, param in cases:
        t0 = time.monotonic()
        with pytest.raises(openai.BadRequestError) as e:
            oc.chat.completions.create(**{"model": "edge", "messages": ASK, "max_tokens": 8, **kw})
        assert e.value.status_code == 400 and e.value.body["type"] == "invalid_request_error", kw
        assert word in e.value.body["message"] and time.monotonic() - t0 < 1.0, (kw, e.value.body)
        assert e.value.body["param"] == param, (kw, e.value.body)
    r = oc.chat.completions.create(model="edge", messages=ASK, max_tokens=4)  # and the endpoint still answers
    assert r.usage.completion_tokens == 4


def test_an_oversized_body_is_refused_before_it_is_read(endpoint):
    from agent.app.openai_api import MAX_BODY

    with pytest.raises(openai.APIStatusError) as e:  # the client sees the answer, not a reset connection
        endpoint.openai().chat.completions.create(model="edge", messages=[{"role": "user", "content": "a" * MAX_BODY}])
    assert e.value.status_code == 413 and e.value.body["code"] == "request_too_large"

    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {KEY}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {MAX_BODY + 1}\r\n\r\n"
    )
    status, err = status_and_json(raw(endpoint.port, head.encode()))
    assert status == 413 and err["error"]["code"] == "request_too_large"
    status, err = status_and_json(raw(endpoint.port, b"GET /" + b"a" * 10_000 + b" HTTP/1.1\r\n\r\n"))
    assert status == 400
    status, err = status_and_json(
        raw(
            endpoint.port,
            b"POST /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer " + KEY.encode() + b"\r\n\r\n",
        )
    )
    assert status == 405


def test_silent_connections_cannot_lock_the_endpoint_out(endpoint):
    """As many silent clients as the endpoint holds from one address: a client with the key is still answered
    (a new connection pushes out the oldest silent one), and the silent ones are closed after HEAD_TIMEOUT_S.
    (tests/agent/app/test_openai_http.py: 32 and 256 of them, per peer, a head sent a byte at a time.)"""
    from agent.app.openai_api import HEAD_TIMEOUT_S, MAX_PER_PEER

    silent = [socket.create_connection(("127.0.0.1", endpoint.port), timeout=10) for _ in range(MAX_PER_PEER)]
    try:
        deadline = time.monotonic() + 10
        while endpoint.api.connections < MAX_PER_PEER and time.monotonic() < deadline:
            time.sleep(0.02)
        assert [m.id for m in endpoint.openai().models.list()] == [endpoint.api.model]
        deadline = time.monotonic() + HEAD_TIMEOUT_S + 5
        while endpoint.api.connections and time.monotonic() < deadline:  # closed by the endpoint, not by us
            time.sleep(0.05)
        assert endpoint.api.connections == 0
    finally:
        for s in silent:
            s.close()
    assert [m.id for m in endpoint.openai().models.list()] == [endpoint.api.model]


def test_edge_agent_serve(verifier, tmp_path):
    """The CLI: a key from a file, an endpoint on a free port, SIGTERM ends it."""
    key_file = tmp_path / "key"
    key_file.write_text(KEY + "\n")
    key_file.chmod(0o600)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "agent.app.cli", "serve", "--verifier", verifier.url, "--listen", "127.0.0.1:0"]
    cmd += ["--api-key-file", str(key_file), "--threads", "1", "--offline", "local"]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    try:
        deadline = time.monotonic() + 60
        line = ""
        while "OpenAI endpoint at" not in line and time.monotonic() < deadline:
            line = proc.stderr.readline()
            assert line or proc.poll() is None, "edge-agent serve exited"
        base = line.split("OpenAI endpoint at ")[1].split()[0]
        oc = openai.OpenAI(base_url=base, api_key=KEY, max_retries=0, timeout=60)
        r = oc.chat.completions.create(model="edge", messages=ASK, max_tokens=4)
        assert r.model_extra["verified"] is True and r.usage.completion_tokens == 4
        # issue 50's schema, which killed this daemon with SIGSEGV: a 400, and the daemon serves on
        from tools.schemas.hostile import schema_chain

        port = int(base.rsplit(":", 1)[1].split("/")[0])
        status, body = status_and_json(post(port, _attack(schema_chain(4000))))
        assert status == 400 and "chain" in body["error"]["message"] and proc.poll() is None
        _served(port)
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    bad = subprocess.run(
        [sys.executable, "-m", "agent.app.cli", "serve", "--listen", "0.0.0.0:0"],
        capture_output=True,
        text=True,
        env=env,
    )
    assert bad.returncode == 2 and "api-key-file" in bad.stderr


def test_the_daemons_endpoint_behind_its_token(verifier, drafter, monkeypatch):
    """api.openai_listen: the same endpoint on the daemon's draft model, its key the local API's token."""
    from agent.app import config
    from agent.app.daemon import Daemon
    from agent.app.navigator import Navigator
    from tests.agent.app.test_go2_daemon import Api, RecordingNotifier

    monkeypatch.setattr(Navigator, "warm_up", lambda self: None)  # the navigation prompt's prefill: ~10 s here

    sets = ['telemetry.path=""', 'perception.kind="color"', f'link.verifier="{verifier.url}"']
    sets += [f'api.token="{KEY}"', 'api.openai_listen="127.0.0.1:0"']
    with pytest.raises(config.ConfigError, match="token"):
        config.load(None, ['api.openai_listen="127.0.0.1:0"'])
    d = Daemon(config.load(None, sets), drafter=drafter, notifier=RecordingNotifier()).start()
    api = None
    try:
        api = Api(d, token=KEY)
        base = api.api.openai.address + "/v1"
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=base, api_key="not-the-token-0123", max_retries=0).models.list()
        oc = openai.OpenAI(base_url=base, api_key=KEY, max_retries=0, timeout=120)
        r = oc.chat.completions.create(model="edge", messages=ASK, max_tokens=6)
        assert r.model_extra["verified"] is True and r.usage.completion_tokens == 6
        from tools.schemas.hostile import schema_chain  # issue 50's schema: a 400; with its bound lifted, a

        monkeypatch.setattr(structured, "MAX_REFERENCE_CHAIN", 10**6)  # worker's crash, and a 400 all the same
        with pytest.raises(openai.BadRequestError, match="crashed the compiler"):
            oc.chat.completions.create(
                model="edge", messages=ASK, max_tokens=4, response_format=_format(json.loads(schema_chain(4000)))
            )
        r = oc.chat.completions.create(model="edge", messages=ASK, max_tokens=6)
        assert r.usage.completion_tokens == 6
        assert api.call(op="status")["ok"]  # the local API answers beside it
        assert api.api.openai.client.lock is d.model_lock  # chat answers and navigation steps take turns
    finally:
        if api is not None:
            api.close()
        d.close()


def test_a_link_lost_midway(verifier, drafter, client):
    """The link drops after a few rounds and cannot come back: offline "local" keeps what the verifier
    committed and the draft goes on (chunks say which); "refuse" ends the stream with an error event."""
    from agent import Client
    from agent.decoding import DecoderSettings
    from tools.cluster.netem import LinkProfile, NetemProxy

    full = client.generate(messages=ASK, max_tokens=40).token_ids
    for offline in ("local", "refuse"):
        with NetemProxy("127.0.0.1", verifier.port, LinkProfile.from_rtt(5)) as proxy:
            settings = DecoderSettings(verifier=proxy.url(), reconnect_attempts=1, reconnect_backoff_s=0.01)
            with Client(settings, drafter=drafter, offline=offline) as cut:
                assert cut.connect()
                proxy.refuse_new(True)
                proxy.schedule_disconnect(after_bytes_down=400)  # the open's reply and a few rounds
                e = Endpoint(cut)
                try:
                    body = json.dumps({"model": "edge", "messages": ASK, "max_tokens": 40, "stream": True})
                    events = post(e.port, body.encode()).partition(b"\r\n\r\n")[2].decode().split("\n\n")
                finally:
                    e.close()
        objs = [json.loads(x[6:]) for x in events if x.startswith("data: {")]
        if offline == "refuse":
            assert objs[-1]["error"]["code"] == "verifier_unavailable" and events[-1] != "data: [DONE]"
            continue
        edge = objs[-1]["edge"]
        flags = [o["verified"] for o in objs if o.get("choices") and o["choices"][0]["delta"].get("content")]
        assert True in flags and flags[-1] is False and flags == sorted(flags, reverse=True)
        assert 0 < edge["verified_tokens"] < len(edge["token_ids"]) and edge["verified"] is False
        assert edge["token_ids"][: edge["verified_tokens"]] == full[: edge["verified_tokens"]]


def test_a_client_that_leaves_mid_stream_ends_the_generation(endpoint):
    body = json.dumps({"model": "edge", "messages": ASK, "max_tokens": 1000, "stream": True}).encode()
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {KEY}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    with socket.create_connection(("127.0.0.1", endpoint.port), timeout=60) as s:
        s.sendall(head.encode() + body)
        assert s.recv(65536).startswith(b"HTTP/1.1 200")  # the stream has begun
    deadline = time.monotonic() + 20  # 1000 tokens would take a minute here
    while endpoint.api.pending and time.monotonic() < deadline:
        time.sleep(0.1)
    assert endpoint.api.pending == 0
    r = endpoint.openai().chat.completions.create(model="edge", messages=ASK, max_tokens=4)
    assert r.usage.completion_tokens == 4


# ------------------------------------------------------------------ hostile schemas (issue 50)


def _attack(schema_text: str) -> bytes:
    return json.dumps(
        {"model": "edge", "messages": ASK, "max_tokens": 4, "response_format": _format(json.loads(schema_text))}
    ).encode()


def _served(port: int) -> None:
    """A normal request right after: answered in full."""
    status, body = status_and_json(post(port, json.dumps({"model": "edge", "messages": ASK, "max_tokens": 3}).encode()))
    assert status == 200 and body["usage"]["completion_tokens"] == 3


def test_a_schema_that_crashed_the_daemon_is_a_400_and_the_next_request_is_served(endpoint, monkeypatch):
    """Issue 50's schema (a $defs chain of 4,000 anyOfs, 270 KB): a 400 naming the chain, in a response_format or a
    tool's parameters; with the chain bound lifted it reaches a compile worker, which dies of it (SIGSEGV) and the
    request is a 400 saying so. This process, which serves the endpoint, goes on."""
    from tools.schemas.hostile import schema_chain

    chain = schema_chain(4000)
    status, body = status_and_json(post(endpoint.port, _attack(chain)))
    assert status == 400 and "chain" in body["error"]["message"] and body["error"]["param"] == "response_format"
    tool = {"type": "function", "function": {"name": "deep", "parameters": json.loads(chain)}}
    body_tools = json.dumps({"model": "edge", "messages": ASK, "max_tokens": 4, "tools": [tool]}).encode()
    status, body = status_and_json(post(endpoint.port, body_tools))
    assert status == 400 and "chain" in body["error"]["message"]
    _served(endpoint.port)
    monkeypatch.setattr(structured, "MAX_REFERENCE_CHAIN", 10**6)
    status, body = status_and_json(post(endpoint.port, _attack(chain)))
    assert status == 400 and "crashed the compiler (killed by SIGSEGV" in body["error"]["message"], body
    _served(endpoint.port)
