"""What an unauthenticated peer can hold (DESIGN.md, Trust): a deadline for hello, caps on connections before
hello that never lock a robot out, one chance before hello, loopback trusted only when the operator says so,
X-Forwarded-For only from a trusted proxy, /metrics behind the token, and a log budget per connection.

The flood comes from many loopback addresses (127.0.0.2 and up: Linux routes all of 127/8 to lo), as
attackers behind many hosts would; the robot is the real VerifierLink with its token."""

from __future__ import annotations

import base64
import json
import logging
import os
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import msgpack
import numpy as np
import pytest
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidStatus
from websockets.sync.client import connect

from agent.decoding.link import ServerError, VerifierLink
from protocol import wire
from server_bridge.config import ServerConfig
from server_bridge.peers import Gate, LogBudget, client_address, parse_networks, share_key

TOKEN = "s3cret"
GREEDY = {"temperature": 0.0, "top_k": 0, "seed": 0}
LOOPBACK_PROXY = parse_networks(["127.0.0.1/32"])


# --------------------------------------------------------------------------- no model


@pytest.mark.parametrize(
    "peer, xff, proxied, trusted, expect",
    [
        # an untrusted peer: its own address, X-Forwarded-For ignored; a forwarding header makes loopback not loopback
        ("10.1.2.3", ["127.0.0.1"], True, (), ("10.1.2.3", False, False)),
        ("127.0.0.1", ["203.0.113.7"], True, (), ("127.0.0.1", False, False)),  # the undeclared same-host proxy
        ("127.0.0.1", [], False, (), ("127.0.0.1", True, False)),
        # a trusted proxy: the right-most address it does not vouch for; what the client wrote itself is left of it
        ("127.0.0.1", ["203.0.113.7"], True, LOOPBACK_PROXY, ("203.0.113.7", False, True)),
        ("127.0.0.1", ["127.0.0.1, 203.0.113.7"], True, LOOPBACK_PROXY, ("203.0.113.7", False, True)),
        ("127.0.0.1", ["127.0.0.1", "203.0.113.7"], True, LOOPBACK_PROXY, ("203.0.113.7", False, True)),
        ("127.0.0.1", ["127.0.0.1"], True, LOOPBACK_PROXY, ("127.0.0.1", True, True)),  # a client on the proxy's host
        # the proxy's own health check, or a proxy that forwards no address: a remote client of unknown address
        ("127.0.0.1", [], False, LOOPBACK_PROXY, ("unknown", False, True)),
        ("127.0.0.1", ["unknown"], True, LOOPBACK_PROXY, ("unknown", False, True)),
        ("::ffff:127.0.0.1", ["2001:db8::5"], True, LOOPBACK_PROXY, ("2001:db8::5", False, True)),
    ],
)
def test_the_client_is_the_peer_unless_a_trusted_proxy_names_it(peer, xff, proxied, trusted, expect):
    c = client_address(peer, xff, proxied, trusted)
    assert (c.address, c.loopback, c.via_proxy) == expect


@pytest.mark.parametrize(
    "headers, expect",
    [
        # RFC 7239 Forwarded (HAProxy's `option forwarded`): for= of the right-most element it does not vouch for
        ({"Forwarded": ["for=203.0.113.7;proto=http;by=127.0.0.1"]}, ("203.0.113.7", False)),
        ({"Forwarded": ['for=127.0.0.1, for="203.0.113.7:4711"']}, ("203.0.113.7", False)),
        ({"Forwarded": ["for=198.51.100.1", 'For="[2001:db8:cafe::17]:4711"']}, ("2001:db8:cafe::17", False)),
        ({"Forwarded": ["for=127.0.0.1"]}, ("127.0.0.1", True)),  # a client on the proxy's host
        ({"Forwarded": ["for=_hidden"]}, ("_hidden", False)),  # obfuscated: its own bucket, never loopback
        ({"Forwarded": ["proto=https"]}, ("unknown", False)),  # no for=: named nobody
        ({"X-Real-IP": ["198.51.100.9"]}, ("198.51.100.9", False)),  # nginx's proxy_set_header X-Real-IP
        ({"X-Real-IP": ["127.0.0.1"]}, ("127.0.0.1", True)),
        # kinds that agree are one client; kinds that disagree (the proxy passed a client's forged other kind on)
        # are a client of unknown address, whichever the forger chose
        ({"X-Forwarded-For": ["203.0.113.7"], "X-Real-IP": ["203.0.113.7"]}, ("203.0.113.7", False)),
        ({"X-Forwarded-For": ["203.0.113.7"], "Forwarded": ["for=127.0.0.1"]}, ("unknown", False)),
        ({"Forwarded": ["for=203.0.113.7"], "X-Forwarded-For": ["127.0.0.1"]}, ("unknown", False)),
    ],
)
def test_a_trusted_proxy_names_its_client_in_any_forwarding_header(headers, expect):
    """The bypass: a same-host proxy that forwards no X-Forwarded-For made every client it forwarded loopback."""
    c = client_address(
        "127.0.0.1",
        headers.get("X-Forwarded-For", []),
        True,
        LOOPBACK_PROXY,
        forwarded=headers.get("Forwarded", []),
        real_ip=headers.get("X-Real-IP", []),
    )
    assert (c.address, c.loopback, c.via_proxy) == (*expect, True)
    assert c.unnamed == (expect[0] in ("unknown", "_hidden"))
    untrusted = client_address("127.0.0.1", [], True, (), forwarded=headers.get("Forwarded", []))
    assert (untrusted.address, untrusted.loopback) == ("127.0.0.1", False)  # read from a trusted proxy only


def test_robots_behind_one_address_each_hold_their_own_share():
    """Once its token is checked, the robot's name splits its address's share; it never merges two addresses."""
    keys = {share_key("203.0.113.7", f"robot-{i:02d}", "edge-agent") for i in range(64)}
    assert len(keys) == 64
    assert share_key("203.0.113.7", "r", "a") != share_key("203.0.113.8", "r", "a")
    assert share_key("2001:db8::1", "r", "a") == share_key("2001:db8::2", "r", "a")  # one host's /64
    hostile = share_key("203.0.113.7", "x" * 10_000, "evil\nINFO forged log line")
    assert len(hostile) < 3 * 64 and "\n" not in hostile


def test_the_gate_caps_per_address_and_evicts_the_oldest_when_full():
    gate = Gate(max_total=4, max_per_address=2)
    assert gate.admit("a1", "10.0.0.1") == (True, [])
    assert gate.admit("a2", "10.0.0.1") == (True, [])
    assert gate.admit("a3", "10.0.0.1") == (True, [])  # past its address's share: it borrows free room
    assert gate.admit("p1", None) == (True, [])  # behind a proxy: counted once its request names the client
    assert gate.admit("a4", "10.0.0.1") == (False, [])  # past its share, and no room left: refused
    assert gate.admit("b1", "10.0.0.2") == (True, ["a3"])  # within its share: the borrowed one goes first
    assert gate.admit("b2", "10.0.0.2") == (True, ["a1"])  # then the oldest stranger
    assert not gate.identify("p1", "10.0.0.2")  # its client's share is spent and the table is full
    gate.release("p1")
    gate.release("p1")  # idempotent
    gate.release("a2")
    assert gate.admit("p2", None) == (True, [])
    assert gate.identify("p2", "10.0.0.2")  # with room left it borrows too ...
    assert gate.admit("v6", "2001:db8::2") == (True, [])
    assert gate.admit("v6b", "2001:db8::3") == (True, ["p2"])  # ... and goes first
    assert gate.admit("v6c", "2001:db8::4") == (False, [])  # an IPv6 host's share is its /64's
    gate.release("b1")
    assert gate.admit("v6c", "2001:db8::4") == (True, [])  # borrowed
    assert len(gate) == 4 and all(c in gate for c in ("b2", "v6", "v6b", "v6c"))


def test_a_flood_from_one_address_never_pushes_out_another_addresss_share():
    """The share's point, with borrowing: one address (a NAT, or an attacker claiming to be many robots) may fill
    free room, but whatever it holds past its share goes before anyone else's connection within theirs."""
    gate = Gate(max_total=64, max_per_address=8)
    for n in range(8):
        assert gate.admit(f"robot{n}", "203.0.113.1") == (True, [])
    flood = [gate.admit(f"flood{n}", "198.51.100.9") for n in range(200)]
    assert sum(ok for ok, _ in flood) == 56 and all(not evicted for _, evicted in flood)  # the free room, no more
    for n in range(8):  # another address's newcomers take the flood's borrowed room, never the robots'
        assert gate.admit(f"late{n}", "192.0.2.1") == (True, [f"flood{8 + n}"])
    assert all(f"robot{n}" in gate for n in range(8))


def test_the_log_budget_counts_what_it_holds_back_and_reports_it_once_the_window_turns():
    now = [0.0]
    budget = LogBudget(3, window_s=10.0, clock=lambda: now[0])
    assert [budget.take() for _ in range(5)] == [(True, 0)] * 3 + [(False, 0)] * 2
    now[0] = 10.5
    assert budget.take() == (True, 2)
    budget.take(), budget.take(), budget.take()
    assert budget.flush() == 1 and budget.flush() == 0


def test_loopback_is_trusted_only_without_a_token_unless_the_operator_says_so():
    assert ServerConfig().loopback_trusted is True  # tokenless: this host only, as before
    assert ServerConfig(token=TOKEN).loopback_trusted is False  # a token binds everyone, loopback included
    assert ServerConfig(token=TOKEN, trust_loopback=True).loopback_trusted is True
    for bad in (
        {"trust_loopback": False},  # no token and no loopback: nobody could connect
        {"trusted_proxies": ["10.0.0.0/33"]},
        {"trusted_proxies": "127.0.0.1"},
        {"metrics_listen": "9100"},
        {"hello_timeout_s": 0},
        {"max_unauthenticated": 0},
        {"max_unauthenticated_per_address": 0},
        {"log_lines_per_10s": 0},
    ):
        with pytest.raises(ValueError):
            ServerConfig(**bad)


def test_cli_flags_set_the_peer_rules(monkeypatch):
    from server_bridge import cli, server

    seen = []

    async def fake_run(config):
        seen.append(config)

    monkeypatch.setattr(server, "run", fake_run)
    argv = [
        "serve",
        "--token",
        TOKEN,
        "--trust-loopback",
        "--trusted-proxies",
        "127.0.0.1/32, 10.0.0.0/8",
        "--metrics-listen",
        "127.0.0.1:9100",
        "--hello-timeout-s",
        "2.5",
        "--max-unauthenticated",
        "32",
        "--max-unauthenticated-per-address",
        "4",
        "--log-lines-per-10s",
        "5",
    ]
    assert cli.main(argv) == 0
    c = seen[0]
    assert (c.trust_loopback, c.trusted_proxies, c.metrics_address) == (
        True,
        ["127.0.0.1/32", "10.0.0.0/8"],
        ("127.0.0.1", 9100),
    )
    assert (c.hello_timeout_s, c.max_unauthenticated, c.max_unauthenticated_per_address, c.log_lines_per_10s) == (
        2.5,
        32,
        4,
        5,
    )
    assert cli.main(["serve", "--no-trust-loopback"]) == 2  # refused by the config: nobody could connect


# --------------------------------------------------------------------------- helpers

UPGRADE = (
    "GET / HTTP/1.1\r\nHost: edgespec\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
    "Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n{extra}\r\n"
)


def _tcp(port: int, source: str = "127.0.0.1") -> socket.socket:
    s = socket.socket()
    try:
        s.bind((source, 0))
    except OSError:
        s.close()
        pytest.skip(f"cannot bind {source} (Linux routes all of 127/8 to lo)")
    s.settimeout(10)
    s.connect(("127.0.0.1", port))
    return s


def _upgrade(port: int, source: str = "127.0.0.1", **headers) -> tuple[socket.socket, int]:
    """A websocket upgrade by hand (no client thread per connection): the socket and the HTTP status."""
    s = _tcp(port, source)
    extra = "".join(f"{k.replace('_', '-')}: {v}\r\n" for k, v in headers.items())
    s.sendall(UPGRADE.format(key=base64.b64encode(os.urandom(16)).decode(), extra=extra).encode())
    reply = b""
    while b"\r\n\r\n" not in reply:
        chunk = s.recv(4096)
        if not chunk:
            break
        reply += chunk
    return s, int(reply.split(b" ", 2)[1]) if reply else 0


def _closed_how(s: socket.socket, within_s: float) -> str:
    """'1008' (a close frame with that code), 'eof' / 'reset' (TCP gone), or 'open' after within_s."""
    s.settimeout(within_s)
    try:
        data = s.recv(64)
    except socket.timeout:
        return "open"
    except ConnectionResetError:
        return "reset"
    if not data:
        return "eof"
    if data[0] == 0x88 and len(data) >= 4:  # FIN + close opcode, unmasked, code in the first two payload bytes
        return str(int.from_bytes(data[2:4], "big"))
    return f"data {data[:8]!r}"


def _robot(server, token: str = TOKEN) -> VerifierLink:
    target = server.server.verifier.target
    return VerifierLink(server.url, token=token, vocab_hash=target.vocab_hash, vocab_size=target.vocab_size)


def _robot_opens(server, sid: str = "robot", token: str = TOKEN) -> None:
    link = _robot(server, token)
    try:
        link.connect()
        reply, _ = link.request(wire.Open(sid, [1, 2, 3, 4], GREEDY))
        assert isinstance(reply, wire.Opened) and reply.n_committed == 4
    finally:
        link.close()


def _hello(target, token: str = "") -> bytes:
    return wire.encode(
        wire.Hello(token=token, client="test", draft_vocab_hash=target.vocab_hash, vocab_size=target.vocab_size)
    )


def _close_code(ws, timeout_s: float = 10.0) -> int:
    with pytest.raises(ConnectionClosed) as e:
        while True:
            ws.recv(timeout=timeout_s)  # an error message may come first
    return e.value.rcvd.code


def _get(url: str, **headers) -> tuple[int, dict, bytes]:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=5) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


# --------------------------------------------------------------------------- real server


@pytest.mark.real
def test_silent_connections_do_not_lock_a_robot_out_and_go_at_the_deadline(make_server):
    """The attacker's 256 upgraded websockets that never send a frame, from 32 addresses (8 each, the
    per-address share), against a server with max_connections 256: the strangers' table keeps 64 of them
    (the newest), the rest are evicted at once, the robot's hello and open go through, and the 64 are
    closed with 1008 at the deadline."""
    s = make_server(exits="", token=TOKEN, hello_timeout_s=3.0)
    gate = s.server.admission.gate
    t0 = time.monotonic()
    socks = []
    for n in range(256):
        sock, status = _upgrade(s.port, f"127.0.0.{2 + n // 8}")
        assert status == 101
        socks.append(sock)
        assert len(gate) <= 64
    assert time.monotonic() - t0 < 2.5, "the flood took too long to measure the deadline"
    _robot_opens(s)
    assert s.server.metrics.refused["evicted"] >= 256 - 64
    outcomes = [_closed_how(sock, 6.0) for sock in socks]
    elapsed = time.monotonic() - t0
    assert set(outcomes[:150]) <= {"eof", "reset"}, set(outcomes[:150])  # the oldest: evicted at once
    assert outcomes[-32:] == ["1008"] * 32  # the newest: closed at the deadline with a policy close
    assert "open" not in outcomes and 3.0 <= elapsed < 9.0
    assert s.server.metrics.refused["hello_timeout"] >= 32 and len(gate) == 0
    for sock in socks:
        sock.close()


@pytest.mark.real
def test_an_address_over_its_share_only_borrows_free_room_and_goes_first(make_server):
    """Past its share an address (robots behind one NAT reconnecting at once) borrows the room the table has
    free; with none left its newcomer is closed at once, and another address's newcomer takes the borrowed
    room, never a connection within its share."""
    cfg = {"max_unauthenticated": 3, "max_unauthenticated_per_address": 2, "hello_timeout_s": 5.0}
    s = make_server(exits="", token=TOKEN, **cfg)
    first, second = _tcp(s.port, "127.0.0.7"), _tcp(s.port, "127.0.0.7")
    time.sleep(0.2)  # accepted
    third = _tcp(s.port, "127.0.0.7")  # past its share: borrowed
    time.sleep(0.2)
    fourth = _tcp(s.port, "127.0.0.7")  # past its share, the table full
    assert _closed_how(fourth, 2.0) in ("eof", "reset")
    assert all(_closed_how(sock, 0.3) == "open" for sock in (first, second, third))
    assert s.server.metrics.refused["address_cap"] == 1
    _robot_opens(s)  # another address (127.0.0.1): the borrowed room is its
    assert _closed_how(third, 2.0) in ("eof", "reset") and s.server.metrics.refused["evicted"] == 1
    assert _closed_how(first, 0.3) == "open" and _closed_how(second, 0.3) == "open"
    for sock in (first, second, third, fourth):
        sock.close()


@pytest.mark.real
def test_no_hello_by_the_deadline_closes_with_a_policy_violation(make_server):
    s = make_server(exits="", token=TOKEN, hello_timeout_s=1.0)
    t0 = time.monotonic()
    with connect(s.url) as ws:  # the client's own pings would keep it alive for ever before
        assert _close_code(ws) == 1008
        assert 0.8 <= time.monotonic() - t0 < 4.0
        assert "no hello" in ws.close_reason
    assert s.server.metrics.refused["hello_timeout"] == 1


@pytest.mark.real
def test_any_error_before_hello_closes_and_a_shape_bomb_is_a_clean_refusal(make_server, target):
    s = make_server(exits="", token=TOKEN)
    verify = msgpack.unpackb(
        wire.encode(wire.Verify("x", 0, 3, [1], {"kind": "none"}, None, np.zeros((1, 1), np.int32)))
    )
    verify[-1] = {**verify[-1], "shape": [2**40, 2**30, 0, 5], "data": b""}  # numpy: ValueError, once
    for frame, code in (
        (b"\x93\x01garbage\xc1", "bad_frame"),  # not a FATAL code: the connection used to stay open
        (msgpack.packb(verify), "bad_field"),
        (wire.encode(wire.Open.make_dummy()), "not_authenticated"),
        (_hello(target, "wrong"), "bad_token"),
    ):
        with connect(s.url) as ws:
            ws.send(frame)
            error = wire.decode(ws.recv(timeout=10))
            assert isinstance(error, wire.Error) and error.code == code
            assert _close_code(ws) == 1008
    assert s.server.metrics.refused["error_before_hello"] == 4


@pytest.mark.real
def test_an_unexpected_exception_in_decoding_is_a_policy_close_not_a_traceback(
    make_server, target, monkeypatch, caplog
):
    """A decoder bug (anything but WireError) before hello: error + 1008, counted, no 'connection handler
    failed' traceback and no 1011; after hello: an error on that connection, which goes on."""
    decode = wire.decode

    def buggy(frame, *args, **kwargs):
        if frame == b"boom":
            raise ValueError("maximum supported dimension for an ndarray is 32")
        return decode(frame, *args, **kwargs)

    monkeypatch.setattr(wire, "decode", buggy)
    caplog.set_level(logging.INFO)
    s = make_server(exits="", token=TOKEN)
    with connect(s.url) as ws:
        ws.send(b"boom")
        assert decode(ws.recv(timeout=10)).code == "bad_frame"
        assert _close_code(ws) == 1008
    with connect(s.url) as ws:
        ws.send(_hello(target, TOKEN))
        assert decode(ws.recv(timeout=10)).TYPE == "welcome"
        ws.send(b"boom")
        assert decode(ws.recv(timeout=10)).code == "bad_frame"
        ws.send(wire.encode(wire.Open("after", [1, 2, 3], GREEDY)))
        assert decode(ws.recv(timeout=30)).TYPE == "opened"  # the connection lives on
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], [r.getMessage() for r in caplog.records]
    assert s.server.metrics.refused["error_before_hello"] == 1


@pytest.mark.real
def test_a_same_host_proxy_does_not_make_its_clients_loopback(make_server, target):
    """The bypass: a tokenless server ("loopback clients only") behind HAProxy on its own host saw every
    client as 127.0.0.1. A forwarded request from a proxy nobody declared is not loopback; from a declared
    one, the client it names decides."""
    remote = {"X-Forwarded-For": "203.0.113.7"}
    for config in ({}, {"trusted_proxies": ["127.0.0.1/32"]}):
        s = make_server(exits="", **config)
        with pytest.raises(InvalidStatus) as e:
            connect(s.url, additional_headers=remote)
        assert e.value.response.status_code == 403
        assert _get(f"http://127.0.0.1:{s.port}/healthz", **remote)[0] == 403
        if not config:
            _robot_opens(s, token="")  # this host's own tools, as before, where no proxy is declared
    with connect(s.url, additional_headers={"X-Forwarded-For": "127.0.0.1"}) as ws:  # a client on the proxy's host
        ws.send(_hello(target))
        assert wire.decode(ws.recv(timeout=10)).TYPE == "welcome"


@pytest.mark.real
def test_a_trusted_proxy_that_forwards_no_x_forwarded_for_does_not_make_its_clients_loopback(make_server, target):
    """The bypass: a same-host proxy speaking RFC 7239 Forwarded, or X-Real-IP, or forwarding no address at all,
    made its remote clients the proxy itself: loopback, on a server that serves loopback clients only (or
    trusts them without the token). Now Forwarded's for= and X-Real-IP name the client, and a request of the
    proxy's that names none is a remote client of unknown address: never loopback, its /healthz the status."""
    s = make_server(exits="", trusted_proxies=["127.0.0.1/32"])  # tokenless: loopback clients only
    for remote in ({"Forwarded": "for=203.0.113.7;proto=http"}, {"X-Real-IP": "203.0.113.7"}, {}):
        with pytest.raises(InvalidStatus) as e:
            connect(s.url, additional_headers=remote, open_timeout=5)
        assert e.value.response.status_code == 403, remote
    status, _, body = _get(f"http://127.0.0.1:{s.port}/healthz")  # the proxy's own check: up, and nothing else
    assert status == 200 and json.loads(body) == {"status": "ok"}
    for local in ({"Forwarded": 'for="127.0.0.1:50000"'}, {"X-Real-IP": "127.0.0.1"}):  # on the proxy's host
        with connect(s.url, additional_headers=local) as ws:
            ws.send(_hello(target))
            assert wire.decode(ws.recv(timeout=10)).TYPE == "welcome"
    lenient = make_server(exits="", token=TOKEN, trust_loopback=True, trusted_proxies=["127.0.0.1/32"])
    for remote in ({"Forwarded": "for=203.0.113.7"}, {"X-Real-IP": "203.0.113.7"}, {}):
        with connect(lenient.url, additional_headers=remote) as ws:  # no token: only loopback may do that
            assert len(lenient.server.admission.gate) == 1  # a stranger, capped as one
            ws.send(_hello(target))
            assert wire.decode(ws.recv(timeout=10)).code == "bad_token", remote
    caps = {"max_unauthenticated": 5, "max_unauthenticated_per_address": 2}  # full at the fifth: no borrowing
    capped = make_server(exits="", token=TOKEN, trusted_proxies=["127.0.0.1/32"], **caps)
    held = [_upgrade(capped.port, Forwarded=f"for=198.51.100.{n}") for n in (1, 1, 2)]
    held += [_upgrade(capped.port, X_Real_IP="198.51.100.3")]
    assert [status for _, status in held] == [101] * 4  # each its own client's share, not the proxy's
    held.append(_upgrade(capped.port, Forwarded="for=198.51.100.1"))
    assert held[-1][1] == 429
    for sock, _ in held:
        sock.close()


@pytest.mark.real
def test_with_a_token_loopback_presents_it_unless_the_operator_trusts_loopback(make_server, target):
    strict = make_server(exits="", token=TOKEN)
    with pytest.raises(ServerError) as e:
        _robot(strict, token="").connect()
    assert e.value.code == "bad_token"
    lenient = make_server(exits="", token=TOKEN, trust_loopback=True, trusted_proxies=["127.0.0.1/32"])
    with connect(lenient.url, additional_headers={"X-Forwarded-For": "127.0.0.1"}) as ws:  # said so deliberately
        ws.send(_hello(target))
        assert wire.decode(ws.recv(timeout=10)).TYPE == "welcome"
    undeclared = make_server(exits="", token=TOKEN, trust_loopback=True)  # a same-host proxy nobody listed
    for s in (lenient, undeclared):
        with connect(s.url, additional_headers={"X-Forwarded-For": "203.0.113.7"}) as ws:  # a remote client
            assert (
                len(s.server.admission.gate) == 1
            )  # a stranger, capped as one (a trusted loopback peer is not counted)
            ws.send(_hello(target))
            assert wire.decode(ws.recv(timeout=10)).code == "bad_token"
    with connect(undeclared.url) as ws:
        assert len(undeclared.server.admission.gate) == 0


@pytest.mark.real
def test_x_forwarded_for_counts_only_from_a_trusted_proxy(make_server):
    """Per-address shares by the forwarded client behind a trusted proxy (429 over it); from anyone else
    X-Forwarded-For changes nothing: three connections from 127.0.0.1 are three from 127.0.0.1."""
    caps = {"max_unauthenticated": 4, "max_unauthenticated_per_address": 2}  # full at the fourth: no borrowing
    proxied = make_server(exits="", token=TOKEN, trusted_proxies=["127.0.0.1/32"], **caps)
    held = [_upgrade(proxied.port, X_Forwarded_For=f"198.51.100.{n}") for n in (1, 1, 2)]
    assert [status for _, status in held] == [101, 101, 101]
    sock, status = _upgrade(proxied.port, X_Forwarded_For="198.51.100.1", X_Robot_Id="robot-new")
    assert status == 429  # a name claimed before hello is believed for nothing: the address's share is spent
    held.append((sock, status))
    direct = make_server(exits="", token=TOKEN, max_unauthenticated=2, max_unauthenticated_per_address=2)
    held += [_upgrade(direct.port, X_Forwarded_For=f"198.51.100.{n}") for n in (1, 2)]
    assert [status for _, status in held[-2:]] == [101, 101]
    time.sleep(0.2)
    with pytest.raises((OSError, InvalidHandshake, ConnectionClosed)):  # closed at once: 127.0.0.1 holds its share
        with connect(direct.url, additional_headers={"X-Forwarded-For": "198.51.100.3"}, open_timeout=3):
            pass
    assert direct.server.metrics.refused["address_cap"] == 1
    for sock, _ in held:
        sock.close()


@pytest.mark.real
def test_metrics_and_full_health_need_the_token_or_the_metrics_listener(make_server):
    s = make_server(exits="", token=TOKEN, metrics_listen="127.0.0.1:0")
    base = f"http://127.0.0.1:{s.port}"
    status, headers, body = _get(base + "/metrics")
    assert status == 401 and headers["WWW-Authenticate"].startswith("Bearer")
    assert _get(base + "/metrics", Authorization="Bearer wrong")[0] == 401
    status, _, body = _get(base + "/metrics", Authorization=f"Bearer {TOKEN}")
    assert status == 200 and b"bridge_connections_unauthenticated" in body
    status, _, body = _get(base + "/healthz")  # balancer checks and probes: the status and nothing else
    assert status == 200 and json.loads(body) == {"status": "ok"}
    status, _, body = _get(base + "/healthz", Authorization=f"Bearer {TOKEN}")
    assert status == 200 and json.loads(body)["target"] == s.server.verifier.target.name
    side = f"http://127.0.0.1:{s.server.metrics_port}"
    assert _get(side + "/metrics")[0] == 200 and "replica" in json.loads(_get(side + "/healthz")[2])
    assert _get(side + "/")[0] == 404


@pytest.mark.real
def test_a_peer_sending_bad_frames_gets_a_bounded_number_of_log_lines(make_server, target, caplog):
    caplog.set_level(logging.INFO, logger="server_bridge")
    s = make_server(exits="", token=TOKEN, log_lines_per_10s=20)
    with connect(s.url, max_size=None) as ws:
        ws.send(_hello(target, TOKEN))
        assert wire.decode(ws.recv(timeout=10)).TYPE == "welcome"
        for _ in range(1000):
            ws.send(b"\x93\x01garbage\xc1")
        for _ in range(1000):
            assert wire.decode(ws.recv(timeout=30)).code == "bad_frame"
    deadline = time.monotonic() + 5
    while not any("suppressed" in r.getMessage() for r in caplog.records) and time.monotonic() < deadline:
        time.sleep(0.05)  # the summary comes as the connection ends
    lines = [
        r.getMessage() for r in caplog.records if r.name.startswith("server_bridge.") and "conn " in r.getMessage()
    ]
    assert 20 <= len(lines) <= 22, len(lines)
    assert any("980 log lines suppressed" in line for line in lines), lines[-3:]
    assert s.server.metrics.log_lines_suppressed == 980


@pytest.mark.real
def test_the_shipped_haproxy_config_passes_the_client_on(make_server, target):
    """deploy/haproxy/haproxy.cfg for real in front of a token-protected server that trusts it: its health
    check gets the short /healthz, the server counts strangers by the address HAProxy saw, a client's forged
    X-Forwarded-For, Forwarded or X-Real-IP changes nothing, a robot with the token gets in."""
    from server_bridge.ops.fleet import HAPROXY_CFG, free_port, haproxy_binary, loopback_config, stop_process

    try:
        binary = haproxy_binary()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    s = make_server(token=TOKEN, exits="", trusted_proxies=["127.0.0.1/32"], max_unauthenticated_per_address=2)
    lb_port, work = free_port(), Path(tempfile.mkdtemp(prefix="haproxy-"))
    (work / "haproxy.cfg").write_text(
        loopback_config(HAPROXY_CFG.read_text(), lb_port, [("r0", s.port)], str(work / "admin.sock"))
    )
    log = (work / "haproxy.log").open("w")
    proc = subprocess.Popen([binary, "-db", "-f", str(work / "haproxy.cfg")], stdout=log, stderr=subprocess.STDOUT)
    held = []
    try:
        deadline = time.monotonic() + 20
        while True:  # refused until HAProxy listens, 503 until two good checks mark the replica up
            try:
                if _get(f"http://127.0.0.1:{lb_port}/healthz")[0] == 200:
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline and proc.poll() is None, (work / "haproxy.log").read_text()
            time.sleep(0.2)
        assert json.loads(_get(f"http://127.0.0.1:{lb_port}/healthz")[2]) == {"status": "ok"}
        assert _get(f"http://127.0.0.1:{lb_port}/metrics")[0] == 401
        held += [_upgrade(lb_port, "127.0.0.2"), _upgrade(lb_port, "127.0.0.2")]
        held.append(_upgrade(lb_port, "127.0.0.3", X_Forwarded_For="127.0.0.2"))  # forged: it is 127.0.0.3
        held.append(_upgrade(lb_port, "127.0.0.3", Forwarded="for=127.0.0.2", X_Real_IP="127.0.0.2"))  # deleted
        assert [status for _, status in held] == [101, 101, 101, 101]
        gate = s.server.admission.gate
        assert (gate.held_by("127.0.0.2"), gate.held_by("127.0.0.3"), gate.held_by("unknown")) == (2, 2, 0)
        lb = VerifierLink(
            f"ws://127.0.0.1:{lb_port}", token=TOKEN, vocab_hash=target.vocab_hash, vocab_size=target.vocab_size
        )
        try:
            assert lb.connect().target == target.name
            reply, _ = lb.request(wire.Open("via-lb", [1, 2, 3], GREEDY))
            assert isinstance(reply, wire.Opened)
        finally:
            lb.close()
    finally:
        for sock, _ in held:
            sock.close()
        stop_process(proc)
        log.close()
