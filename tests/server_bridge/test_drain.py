"""A replica's drain and its name: SIGTERM's path, in process on the real target."""

import asyncio
import json
import re
import time
import urllib.error
import urllib.request

import pytest
from websockets.exceptions import ConnectionClosed, InvalidStatus
from websockets.sync.client import connect

from protocol import wire
from server_bridge.sessions import DETACHED

pytestmark = pytest.mark.real

GREEDY = {"temperature": 0.0, "top_k": 0, "seed": 0}


def _client(server, target):
    ws = connect(server.url, max_size=None, additional_headers={"X-Robot-Id": "robot-test"}, legacy=True)
    ws.send(
        wire.encode(
            wire.Hello(token="", client="test", draft_vocab_hash=target.vocab_hash, vocab_size=target.vocab_size)
        )
    )
    welcome = wire.decode(ws.recv(timeout=10))
    assert isinstance(welcome, wire.Welcome)
    return ws, welcome


def _healthz(server) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/healthz", timeout=5) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_the_replica_names_itself_in_welcome_opened_healthz_and_metrics(make_server, target, drafter):
    server = make_server(replica_id="gpu-7")
    ws, welcome = _client(server, target)
    assert welcome.replica == "gpu-7"
    ws.send(wire.encode(wire.Open("s", drafter.tokenize("Turn left."), GREEDY)))
    opened = wire.decode(ws.recv(timeout=30))
    assert isinstance(opened, wire.Opened) and opened.replica == "gpu-7"
    status, health = _healthz(server)
    assert status == 200
    assert health["replica"] == "gpu-7" and health["draining"] is False and health["sessions"] == 1
    assert health["connections"] == 1 and health["engine"] == "llamacpp"
    metrics = urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=5).read().decode()
    assert re.search(r'^bridge_sessions_active\{replica="gpu-7"\} 1(\.0)?$', metrics, re.M), metrics
    ws.close()


def test_drain_answers_the_round_in_flight_then_closes_with_1012(make_server, target, drafter):
    """A connection busy with a round gets its result before the close; an idle one is closed at once;
    /healthz turns 503 and a new robot is refused with 503 (HAProxy retries it on another replica);
    the sessions stay, detached, for a robot that comes back after a blip."""
    server = make_server(replica_id="r-drain", drain_timeout_s=20)
    busy, _ = _client(server, target)
    idle, _ = _client(server, target)
    prompt = drafter.tokenize("Go to the red box and stop there.", chat=True)
    busy.send(wire.encode(wire.Open("busy", prompt, GREEDY)))
    assert isinstance(wire.decode(busy.recv(timeout=30)), wire.Opened)
    # a long prefill in flight: the open of a long prompt on a fresh session
    long_prompt = prompt * 12
    busy.send(wire.encode(wire.Open("long", long_prompt, GREEDY)))
    time.sleep(0.05)  # the open is being served
    drained = asyncio.run_coroutine_threadsafe(server.server.drain(), server.loop)
    time.sleep(0.2)
    status, health = _healthz(server)
    assert status == 503 and health["status"] == "draining" and health["draining"] is True
    with pytest.raises(InvalidStatus) as refused:
        connect(server.url, open_timeout=5)
    assert refused.value.response.status_code == 503

    with pytest.raises(ConnectionClosed) as idle_closed:  # the idle one went first
        idle.recv(timeout=10)
    assert idle_closed.value.rcvd.code == 1012
    reply = wire.decode(busy.recv(timeout=60))  # the open in flight is answered ...
    assert isinstance(reply, wire.Opened) and reply.n_committed == len(long_prompt)
    with pytest.raises(ConnectionClosed) as busy_closed:  # ... and only then is the link closed
        busy.recv(timeout=10)
    assert busy_closed.value.rcvd.code == 1012
    assert drained.result(30) == 2
    sessions = server.server.sessions
    assert {sid: sessions.peek(sid).conn_id for sid in ("busy", "long")} == {"busy": DETACHED, "long": DETACHED}


def test_detached_sessions_keep_their_kv_for_the_grace_period_only(make_server, target, drafter):
    server = make_server(detached_grace_s=0.5, idle_timeout_s=300)
    ws, _ = _client(server, target)
    ws.send(wire.encode(wire.Open("blip", drafter.tokenize("Turn right."), GREEDY)))
    assert isinstance(wire.decode(ws.recv(timeout=30)), wire.Opened)
    ws.close()
    deadline = time.monotonic() + 5
    while server.server.sessions.peek("blip") is not None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.server.sessions.peek("blip") is None  # evicted past the grace, not after 300 s
