"""An open's grammar from a hostile peer (issue 50): over the wire, against a real server on port 0, the schema and
the Lark grammar that killed `server-bridge serve` with SIGSEGV, and a flood of slow grammars. Each is that open's
bad_field; the server goes on serving the same connection and every other one; and another robot's small schema
compiles on time while one peer floods (protocol/sandbox.py: peers take turns, one worker each at most)."""

from __future__ import annotations

import json
import threading
import time

import pytest

from agent.decoding.link import ServerError, VerifierLink
from protocol import structured, wire
from tools.schemas.hostile import lark_alternatives, lark_chain, schema_chain

pytestmark = pytest.mark.real

TOKEN = "s3cret"
GREEDY = {"temperature": 0.0, "top_k": 0, "seed": 0}
IDS = [1, 2, 3, 4]


def robot(server, name: str) -> VerifierLink:
    target = server.server.verifier.target
    link = VerifierLink(
        server.url, token=TOKEN, client=name, vocab_hash=target.vocab_hash, vocab_size=target.vocab_size
    )
    link.connect()
    return link


def open_with(link: VerifierLink, sid: str, grammar: dict | None) -> wire.Message:
    g = None if grammar is None else {**grammar, "from": len(IDS)}
    reply, _ = link.request(wire.Open(sid, IDS, GREEDY, grammar=g), timeout_s=30)
    return reply


def test_the_grammars_that_killed_the_verifier_are_that_opens_bad_field(make_server, monkeypatch):
    s = make_server(exits="", token=TOKEN)
    attacker, bystander = robot(s, "attacker"), robot(s, "bystander")
    try:
        cases = [
            ({"json_schema": schema_chain(4000)}, "chain of nested values"),
            ({"lark": lark_chain(4000)}, "chain of rules"),
            ({"lark": lark_alternatives(40000)}, "to compile and was stopped"),
        ]
        for i, (grammar, words) in enumerate(cases):
            with pytest.raises(ServerError, match=words) as e:
                open_with(attacker, f"a{i}", grammar)
            assert e.value.code == "bad_field"
            assert isinstance(open_with(attacker, f"ok{i}", None), wire.Opened)  # the same connection goes on
            assert isinstance(open_with(bystander, f"b{i}", {"json_schema": '{"enum": ["x", "y"]}'}), wire.Opened)
        monkeypatch.setattr(structured, "MAX_REFERENCE_CHAIN", 10**6)  # the chains reach a worker: it dies of them
        for i, grammar in enumerate(({"json_schema": schema_chain(4000)}, {"lark": lark_chain(4000)})):
            with pytest.raises(ServerError, match=r"crashed the compiler \(killed by SIGSEGV") as e:
                open_with(attacker, f"c{i}", grammar)
            assert e.value.code == "bad_field"
            assert isinstance(open_with(bystander, f"d{i}", None), wire.Opened)
    finally:
        attacker.close()
        bystander.close()


def test_a_flood_of_slow_grammars_never_holds_up_another_robots_schema(make_server):
    """One robot opens with 40,000-alternative grammars back to back (each refused at the deadline); another
    robot's opens, each with a small schema it never sent before, are answered on time every time."""
    s = make_server(exits="", token=TOKEN)
    attacker, victim = robot(s, "attacker"), robot(s, "victim")
    stop = threading.Event()
    refused = []

    def flood() -> None:
        n = 0
        while not stop.is_set():
            n += 1
            try:
                open_with(attacker, f"f{n % 4}", {"lark": lark_alternatives(40000)})
            except ServerError as e:
                refused.append(e.code)

    flooder = threading.Thread(target=flood, daemon=True)
    flooder.start()
    took = []
    try:
        time.sleep(0.5)
        for i in range(6):
            t0 = time.monotonic()
            reply = open_with(
                victim, f"v{i}", {"json_schema": json.dumps({"enum": [f"left {i}", f"right {i}", "stop"]})}
            )
            took.append(time.monotonic() - t0)
            assert isinstance(reply, wire.Opened)
            time.sleep(0.3)
    finally:
        stop.set()
        flooder.join(30)
        attacker.close()
        victim.close()
    assert refused and set(refused) == {"bad_field"}
    assert max(took) < structured.COMPILE_TIMEOUT_S, took
