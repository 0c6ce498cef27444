"""The robot's listeners at the worst case their bounds allow (docs/guide/trust.md): JSON at the OpenAI
endpoint's body cap nested as deep as its bracket count allows (json's C scanner: a RecursionError, a 400), the
local API's and the live view's frames at and past websockets' max_size, and prompts into llama.cpp's tokenizer
at the longest the draft's context can hold (special tokens: its split is quadratic in their count)."""

from __future__ import annotations

import json
import random
import time

import pytest
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

from agent.app import api as local_api
from agent.app import openai_api
from agent.app.live import MAX_CLIENT_MESSAGE, LiveServer, Subscriptions
from tests.agent.app.test_api import make  # noqa: F401  (the local API's fixture, used by name)
from tests.agent.app.test_openai_api import KEY, Endpoint
from tests.agent.app.test_openai_http import StubClient, ask, openai_error

HEAD = {"Host": "127.0.0.1", "Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}


def padded(text: str, size: int) -> bytes:
    """`text` (a JSON document) with trailing spaces to exactly `size` bytes."""
    raw = text.encode()
    assert len(raw) <= size
    return raw + b" " * (size - len(raw))


def nested(brackets: int) -> str:
    """A request whose messages are `brackets` - 1 lists one inside the other: `brackets` '[' and '{' in all."""
    return '{"model": "m", "messages": ' + "[" * (brackets - 1) + "]" * (brackets - 1) + "}"


# --------------------------------------------------------------------------- the OpenAI endpoint's JSON


@pytest.mark.parametrize(
    "body, says",
    [
        (padded(nested(openai_api.MAX_BRACKETS), openai_api.MAX_BODY), "maximum recursion depth"),  # 100,000 deep
        (padded(nested(openai_api.MAX_BRACKETS + 1), openai_api.MAX_BODY), "'[' and '{'"),
        (padded('{"a": ' + "[" * 64 + "]" * 64 + "}", openai_api.MAX_BODY), "nests deeper than 64"),
        (padded('{"max_tokens": ' + "9" * (openai_api.MAX_BODY - 20) + "}", openai_api.MAX_BODY), "digits"),
        (padded('{"model": "' + "\\ud800" * ((openai_api.MAX_BODY - 20) // 6) + '"}', openai_api.MAX_BODY), "model"),
    ],
    ids=["100k deep", "brackets + 1", "depth 65", "8 MiB integer", "lone surrogates"],
)
def test_a_body_at_the_cap_that_json_cannot_or_may_not_read_is_a_400_and_the_next_request_is_served(body, says):
    """Each body is exactly MAX_BODY bytes. json's C scanner recurses once per bracket and raises RecursionError
    past ~1,000 (the bracket count lets 100,000 through); Python refuses an integer of over 4,300 digits; lone
    surrogates are valid JSON and reach the Client's checks as text."""
    assert len(body) == openai_api.MAX_BODY
    client = StubClient()
    e = Endpoint(client, api_key=KEY)
    try:
        status, err = ask(e.port, "POST", "/v1/chat/completions", HEAD, body)
        assert status == 400 and openai_error(status, err) and says in err["error"]["message"], err
        assert client.generations == 0
        assert ask(e.port, "GET", "/v1/models", HEAD)[0] == 200
    finally:
        e.close()


def test_the_deepest_body_the_bounds_let_json_read_parses():
    deepest = '{"a": ' + "[" * (openai_api.MAX_DEPTH - 1) + "]" * (openai_api.MAX_DEPTH - 1) + "}"
    assert openai_api.parse_body(padded(deepest, openai_api.MAX_BODY))["a"]


# --------------------------------------------------------------------------- the local API's frames


def test_a_local_api_request_at_max_message_is_answered_and_one_byte_more_is_closed_1009(make):  # noqa: F811
    """websockets refuses a frame over MAX_MESSAGE from its header (1009) before reading it; one of exactly
    MAX_MESSAGE with MAX_CONTAINERS brackets reaches json and is answered; the daemon serves a new connection."""
    d, api = make()
    flat = '{"op": "status", "x": ' + "[" * (local_api.MAX_CONTAINERS - 1) + "]" * (local_api.MAX_CONTAINERS - 1)
    flat += ', "pad": "' + "a" * local_api.MAX_MESSAGE
    request = flat[: local_api.MAX_MESSAGE - 2] + '"}'
    assert len(request.encode()) == local_api.MAX_MESSAGE
    api.ws.send(request)
    assert json.loads(api.ws.recv(10))["ok"] is True
    api.ws.send("{" + " " * local_api.MAX_MESSAGE + "}")
    with pytest.raises(ConnectionClosed) as e:
        api.ws.recv(10)
    assert e.value.rcvd is not None and e.value.rcvd.code == 1009
    with api.connect() as ws:
        ws.send(json.dumps({"op": "status"}))
        assert json.loads(ws.recv(10))["ok"] is True


# --------------------------------------------------------------------------- the live view (Foxglove)

TOKEN = "live-view-credential-0123456789"


def test_a_viewer_message_at_the_cap_nested_as_deep_as_it_allows_is_ignored_and_one_byte_more_is_closed_1009():
    """A viewer's text goes to json.loads: 64 KiB is 32,768 brackets deep (a RecursionError, ignored) or a
    65,000-digit integer (a ValueError, ignored); the viewer stays and its subscription then works. One byte
    past MAX_CLIENT_MESSAGE closes it with 1009, and another viewer is let in."""
    deep = "[" * (MAX_CLIENT_MESSAGE // 2) + "]" * (MAX_CLIENT_MESSAGE // 2)
    digits = '{"op": "subscribe", "subscriptions": [{"id": ' + "9" * (MAX_CLIENT_MESSAGE - 60) + "}]}"
    assert len(deep) == MAX_CLIENT_MESSAGE and len(digits) <= MAX_CLIENT_MESSAGE
    subs = Subscriptions(frozenset({1}))
    assert subs.apply(deep) == "not JSON" and subs.apply(digits) == "not JSON" and not subs.by_id
    live = LiveServer("127.0.0.1", 0, {"/instruction": ("std_msgs/msg/String", "string data")}, credential=TOKEN)
    url = f"ws://127.0.0.1:{live.port}/?token={TOKEN}"
    try:
        with connect(url, subprotocols=["foxglove.sdk.v1"], open_timeout=5) as ws:
            assert json.loads(ws.recv(5))["op"] == "serverInfo" and json.loads(ws.recv(5))["op"] == "advertise"
            ws.send(deep)
            ws.send(digits)
            ws.send(json.dumps({"op": "subscribe", "subscriptions": [{"id": 3, "channelId": 1}]}))
            deadline, frame = time.monotonic() + 5, b""
            while time.monotonic() < deadline:  # published until the subscription is in
                live.publish([("/instruction", b"cdr")], 42)
                try:
                    frame = ws.recv(0.1)
                    break
                except TimeoutError:
                    continue
            assert frame[:1] == b"\x01" and frame.endswith(b"cdr")
            ws.send("x" * (MAX_CLIENT_MESSAGE + 1))
            with pytest.raises(ConnectionClosed) as e:
                while True:
                    ws.recv(5)
            assert e.value.rcvd is not None and e.value.rcvd.code == 1009
        with connect(url, subprotocols=["foxglove.sdk.v1"], open_timeout=5) as ws:
            assert json.loads(ws.recv(5))["op"] == "serverInfo"
    finally:
        live.close()


# --------------------------------------------------------------------------- prompts into llama.cpp's tokenizer

SHAPES = {  # text of n bytes that tokenizes worst: special tokens (quadratic), one byte, spaces, random UTF-8
    "<|im_end|> run": lambda n: ("<|im_end|>" * (n // 10 + 1))[:n],
    "one byte": lambda n: "a" * n,
    "spaces": lambda n: " " * n,
    "random UTF-8": lambda n: (
        random.Random(0).randbytes(n).decode("utf-8", "replace").encode()[:n].decode("utf-8", "ignore")
    ),
}


@pytest.mark.real
@pytest.mark.parametrize("shape", list(SHAPES))
def test_the_longest_prompt_the_context_allows_tokenizes_in_seconds_and_one_byte_more_is_refused_unread(drafter, shape):
    """Drafter.tokenize's bound: n_ctx x the longest token's bytes (what n_ctx ids can spell). At it, llama.cpp's
    tokenizer ends within seconds whatever the text (a run of `<|im_end|>`, the slowest: 4 s here; 1 MiB of
    it took 42 s); one byte over is a ValueError before llama.cpp reads anything."""
    bound = drafter.llm.n_ctx() * drafter.longest_token
    text = SHAPES[shape](bound)
    assert len(text.encode()) <= bound
    t0 = time.perf_counter()
    ids = drafter.tokenize(text)
    assert ids and time.perf_counter() - t0 < 30.0
    over = text + "a" * (bound + 1 - len(text.encode()))
    t0 = time.perf_counter()
    with pytest.raises(ValueError, match="cannot fit the draft's context"):
        drafter.tokenize(over)
    assert time.perf_counter() - t0 < 0.5


@pytest.mark.real
def test_an_endpoint_prompt_is_bounded_before_the_tokenizer_and_every_refusal_is_a_400(drafter):
    """Through the OpenAI endpoint (a Client on the draft, no verifier: nothing here generates): 8 MiB of
    `<|im_end|>` is a 400 at once (it held the model's lock ~45 min before the bound: quadratic, 1 MiB took
    42 s); the longest prompt the bound lets through is tokenized, then a 400 for the context; a lone surrogate
    (valid JSON, no UTF-8) a 400. The endpoint answers the next request."""
    from agent import Client

    overhead = len(drafter.apply_chat_template([{"role": "user", "content": ""}]).encode())
    at_bound = drafter.llm.n_ctx() * drafter.longest_token - overhead
    cases = [
        ("<|im_end|>" * ((openai_api.MAX_BODY - 200) // 10), "messages", 5.0),
        (("<|im_end|>" * (at_bound // 10 + 1))[:at_bound], "max_tokens", 30.0),
        ("go to the \ud800 box", "messages", 5.0),
    ]
    assert len(drafter.apply_chat_template([{"role": "user", "content": cases[1][0]}]).encode()) == at_bound + overhead
    with Client("ws://127.0.0.1:9", drafter=drafter) as client:
        e = Endpoint(client, api_key=KEY, offline="refuse")
        try:
            for content, param, within in cases:
                body = json.dumps({"model": "m", "messages": [{"role": "user", "content": content}], "max_tokens": 8})
                t0 = time.perf_counter()
                status, err = ask(e.port, "POST", "/v1/chat/completions", HEAD, body.encode())
                assert status == 400 and err["error"]["param"] == param, (param, err)
                assert time.perf_counter() - t0 < within, (param, time.perf_counter() - t0)
            assert ask(e.port, "GET", "/v1/models", HEAD)[0] == 200
        finally:
            e.close()


@pytest.mark.real
def test_the_longest_instruction_the_local_api_takes_is_a_short_prompt_whatever_it_spells(drafter):
    """daemon.submit takes at most 500 characters; all of them `<|im_end|>` (parsed as special tokens: the
    instruction can spell the template's own markers) is 50 ids of the navigator's prompt, tokenized at once."""
    from agent.app.prompt import messages

    instruction = "<|im_end|>" * 50
    assert len(instruction) == 500
    t0 = time.perf_counter()
    ids = drafter.tokenize(drafter.apply_chat_template(messages(instruction, "nothing in view")))
    assert time.perf_counter() - t0 < 1.0 and len(ids) < drafter.llm.n_ctx()
    assert ids.count(drafter.tokenize("<|im_end|>")[0]) >= 50
