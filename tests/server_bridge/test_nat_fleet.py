"""Fleets behind one address (DESIGN.md, Trust): 64 robots behind one NAT address, each with the token, all finish.

They used not to: `max_sessions_per_client` counted the whole address as one client, so the 17th robot's open
evicted another robot's idle session (`unknown_session`, a re-open that evicted the next) or, with every one of
the 16 in a request, was refused (`too_many_sessions`, which a robot does not retry). Now, once its token is
checked, a robot's sessions count against its own share (its address, X-Robot-Id and hello's client). Before
hello nothing it says about itself is believed: a peer's caps are its address's, however many names it claims;
past the address's share (8) its connections borrow the strangers' table's free room. They used to be refused
at once, and the 64 robots connecting together needed up to 6 of the decoder's 8 reconnect attempts.

Each robot is the agent's own code: a `VerifierLink` with its X-Robot-Id, reconnected and re-opened by
`Sessions`/`Attempt` as the decoder does, running empty-draft greedy rounds. The server is a real one on a
target of its own with the 64 engine sequences a default server has (max_sequences = max_sessions), so that
what is measured is the session table, not an engine smaller than the fleet.
"""

from __future__ import annotations

import threading
import time

import pytest

from agent.decoding.link import LinkLost, ServerError, VerifierLink
from agent.decoding.metrics import Metrics
from agent.decoding.session import ReconnectPolicy, Sessions
from protocol import wire

pytestmark = pytest.mark.real

TOKEN = "s3cret"
GREEDY = {"temperature": 0.0, "top_k": 0, "seed": 0}
PROMPT = [1, 504, 3287, 288]
ROBOTS = 64
ROUNDS = 3


@pytest.fixture(scope="module")
def fleet_target():
    """The default target with a default server's 64 sequences (the shared one has 32), no exits."""
    from server_bridge.target import load_target

    return load_target(threads=1, max_sequences=ROBOTS, kv_tokens=4096)


@pytest.fixture
def fleet_server(fleet_target):
    from server_bridge.verifier import Verifier
    from tests.conftest import ThreadedServer

    # a loaded test machine must not shed a round (overloaded, max_wait_ms): what is measured is the table
    config = {"exits": "", "token": TOKEN, "max_wait_ms": 30000.0}
    with ThreadedServer(lambda cfg: Verifier(fleet_target, cfg), **config) as server:
        yield server


def _robot(server, i: int, out: dict, reconnects: dict, failures: dict) -> None:
    """One robot's generation: open with the prompt, ROUNDS empty-draft greedy rounds, close; a lost link or
    a lost session is recovered as the decoder recovers it, anything else fails the robot."""
    target = server.server.verifier.target

    def link() -> VerifierLink:
        return VerifierLink(
            server.url, token=TOKEN, vocab_hash=target.vocab_hash, vocab_size=target.vocab_size, robot_id=f"robot-{i}"
        )

    sessions = Sessions(link, ReconnectPolicy())
    m = Metrics()
    attempt = sessions.begin(None, m)
    committed = list(PROMPT)

    def open_session(sid: str, resume: str) -> wire.Opened:
        assert sessions.link is not None
        reply, _ = sessions.link.request(wire.Open(sid, committed, GREEDY, resume=resume))
        assert isinstance(reply, wire.Opened), reply
        return reply

    try:
        while len(committed) < len(PROMPT) + ROUNDS:
            try:
                attempt.ensure_open(open_session)
                assert sessions.link is not None
                reply, _ = sessions.link.request(
                    wire.Verify(attempt.sid, len(committed), len(committed), [], {"kind": "none"})
                )
                assert isinstance(reply, wire.Result), reply
                committed.append(reply.token)
                attempt.succeeded()
            except (LinkLost, ServerError) as e:
                attempt.recover(e, len(committed))  # raises what the decoder would not retry
        attempt.end(close=True)
        out[i], reconnects[i] = committed, m.reconnects
    except Exception as e:  # the robot's generation failed: what a robot would report
        failures[i] = f"{type(e).__name__}: {e}"
    finally:
        sessions.drop_link()


def test_64_robots_behind_one_address_all_finish(fleet_server):
    out: dict[int, list[int]] = {}
    reconnects: dict[int, int] = {}  # a robot's lost links (refused before hello over the address's share)
    failures: dict[int, str] = {}
    threads = [
        threading.Thread(target=_robot, args=(fleet_server, i, out, reconnects, failures), name=f"robot-{i}")
        for i in range(ROBOTS)
    ]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    elapsed = time.monotonic() - t0
    assert not failures, f"{len(failures)} of {ROBOTS} robots failed: {sorted(failures.items())[:4]}"
    assert len(out) == ROBOTS and len({tuple(ids) for ids in out.values()}) == 1  # all the same greedy tokens
    server = fleet_server.server
    # nobody's session was taken for another's: each robot held its own share
    assert server.sessions.evicted_total == 0
    assert server.metrics.errors["too_many_sessions"] == 0 and server.metrics.errors["unknown_session"] == 0
    # nobody was turned away before hello either: past the address's share the NAT borrowed the free room
    assert server.metrics.refused["address_cap"] == 0 and max(reconnects.values()) == 0
    print(
        f"{ROBOTS} robots x {ROUNDS} rounds behind 127.0.0.1 in {elapsed:.1f}s; refused before hello over the "
        f"address's share: {server.metrics.refused['address_cap']}, reconnects per robot at most "
        f"{max(reconnects.values())}"
    )
