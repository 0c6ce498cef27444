"""One credential cannot hold every session, nor take over another robot's (DESIGN.md, Trust).

A token holder that fills the server with idle sessions does not lock a new robot out: the least recently
used idle session (a detached one first) is evicted and its engine sequence freed; its robot gets
`unknown_session` on its next round, re-opens with its committed prefix and loses nothing. A session whose
connection is still open is taken over by another connection only with its resume secret.

These servers (no exit heads: they load in seconds) share the test run's target (32 sequences) with every
other server: each test gives back what it holds (`_give_back`), and the first fills the engine itself, as
the attacker did.
"""

import asyncio
import gc
import time

import pytest
from websockets.sync.client import connect

from protocol import wire

pytestmark = pytest.mark.real

GREEDY = {"temperature": 0.0, "top_k": 0, "seed": 0}
PROMPT = [1, 504, 3287, 288]  # a short greedy prompt: an open is one 3-token prefill


def _connect(server, target, token=""):
    ws = connect(server.url, max_size=None, legacy=True)
    ws.send(wire.encode(wire.Hello(token, "test", target.vocab_hash, target.vocab_size)))
    assert isinstance(wire.decode(ws.recv(timeout=10)), wire.Welcome)
    return ws


def _ask(ws, msg) -> wire.Message:
    ws.send(wire.encode(msg))
    return wire.decode(ws.recv(timeout=30))


def _open(ws, sid, ids, resume="") -> wire.Message:
    return _ask(ws, wire.Open(sid, list(ids), GREEDY, resume=resume))


def _round(ws, sid, committed) -> list[int]:
    """One empty-draft greedy round: the target's next token; returns the prefix with it."""
    result = _ask(ws, wire.Verify(sid, 0, len(committed), [], {"kind": "none"}))
    assert isinstance(result, wire.Result) and result.n_committed == len(committed) + 1, result
    return committed + [result.token]


def _in_loop(server, fn):
    """fn() in the server's event loop (the session table's thread)."""

    async def call():
        return fn()

    return asyncio.run_coroutine_threadsafe(call(), server.loop).result(10)


def _in_use(target) -> int:
    gc.collect()  # sessions of servers earlier tests left
    return target.engine.ids.in_use()


def _give_back(server, target, baseline):
    """Let every session of this server go and wait for the model thread to free their sequences."""
    _in_loop(server, server.server.sessions.clear)
    deadline = time.monotonic() + 10
    while _in_use(target) > baseline and time.monotonic() < deadline:
        time.sleep(0.02)
    assert _in_use(target) <= baseline, "the sessions' engine sequences were not freed"


def test_a_token_holders_idle_sessions_do_not_lock_a_new_robot_out(make_server, target):
    """The attack: sessions on several connections until every engine sequence is held, all idle. A new robot
    still opens and runs a round; the evicted session's robot re-opens with its committed prefix and goes on."""
    # the table outlasts the engine; no protect_active_s window: these sessions are idle the moment they are made
    # (a fleet's sessions answered within it are kept: test_sessions.py)
    s = make_server(exits="", max_sessions=64, max_sessions_per_connection=8, protect_active_s=0)
    baseline = _in_use(target)
    free = target.engine.ids.capacity - baseline
    holder = [_connect(s, target) for _ in range(-(-free // 8))]
    robot = None
    try:
        sids = [f"hold-{i}" for i in range(free)]
        for i, sid in enumerate(sids):
            assert isinstance(_open(holder[i // 8], sid, PROMPT), wire.Opened)
            if i == 0:
                first = _round(holder[0], sid, PROMPT)  # the oldest session ran a round
        assert target.engine.ids.in_use() == target.engine.ids.capacity  # every sequence is held, all idle
        robot = _connect(s, target)
        opened = _open(robot, "robot", PROMPT)
        assert isinstance(opened, wire.Opened), opened  # not `overloaded: all 32 sequences are in use`
        assert _round(robot, "robot", PROMPT) == first  # and it is verified
        table = s.server.sessions
        assert table.evicted_total == 1 and _in_loop(s, lambda: table.peek(sids[0])) is None  # the LRU went
        assert target.engine.ids.in_use() == target.engine.ids.capacity  # its sequence is the robot's now
        # its robot learns it at its next round, re-opens with what it committed (evicting the next idle one)
        # and goes on from there exactly as the target would
        error = _ask(holder[0], wire.Verify(sids[0], 1, len(first), [], {"kind": "none"}))
        assert isinstance(error, wire.Error) and error.code == "unknown_session", error
        reopened = _open(holder[0], sids[0], first)
        assert isinstance(reopened, wire.Opened) and reopened.n_committed == len(first)
        assert _round(holder[0], sids[0], first) == _round(robot, "robot", first[: len(PROMPT) + 1])
        assert table.evicted_total == 2 and _in_loop(s, lambda: table.peek(sids[1])) is None
    finally:
        for ws in holder + [robot]:
            if ws is not None:
                ws.close()
        _give_back(s, target, baseline)


def test_a_full_table_evicts_a_detached_session_first(make_server, target):
    baseline = _in_use(target)
    s = make_server(exits="", max_sessions=4, protect_active_s=0)  # LRU order, each idle at once
    a, b, robot = _connect(s, target), _connect(s, target), None
    try:
        for ws, sid in ((a, "a0"), (a, "a1"), (b, "b0"), (b, "b1")):
            assert isinstance(_open(ws, sid, PROMPT), wire.Opened)
        b.close()  # b's robot lost its link after a0 and a1 were last used
        table = s.server.sessions
        deadline = time.monotonic() + 5
        while _in_loop(s, lambda: table.peek("b0").conn_id) != 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        robot = _connect(s, target)
        assert isinstance(_open(robot, "robot", PROMPT), wire.Opened)
        assert _in_loop(s, lambda: sorted(table._sessions)) == ["a0", "a1", "b1", "robot"]  # b0, detached
        assert isinstance(_open(robot, "robot2", PROMPT), wire.Opened)
        assert _in_loop(s, lambda: sorted(table._sessions)) == ["a0", "a1", "robot", "robot2"]  # then b1
        assert isinstance(_open(robot, "robot3", PROMPT), wire.Opened)  # then the least recently used idle one
        assert _in_loop(s, lambda: sorted(table._sessions)) == ["a1", "robot", "robot2", "robot3"]
        assert _in_use(target) == baseline + 4  # the evicted ones' sequences are free again
    finally:
        for ws in (a, robot):
            if ws is not None:
                ws.close()
        _give_back(s, target, baseline)


def test_a_live_session_is_taken_over_only_with_its_resume_secret(make_server, target):
    baseline = _in_use(target)
    s = make_server(exits="")
    owner, other = _connect(s, target), _connect(s, target)
    try:
        opened = _open(owner, "mine", PROMPT)
        assert isinstance(opened, wire.Opened) and len(opened.resume) >= 22
        committed = _round(owner, "mine", PROMPT)
        # someone else who knows the sid and the prompt, even the whole committed prefix, or a wrong secret
        for prompt, resume in ((PROMPT, ""), (committed, ""), (committed, opened.resume[:-1] + "x")):
            error = _open(other, "mine", prompt, resume)
            assert isinstance(error, wire.Error) and error.code == "session_taken", error
        committed = _round(owner, "mine", committed)  # the owner goes on as if nothing happened
        again = _open(owner, "mine", committed)  # its own re-opens keep the secret
        assert isinstance(again, wire.Opened) and again.resume == opened.resume
        # its robot back on a new link while the old one still looks open: the secret moves the session
        back = _open(other, "mine", committed, opened.resume)
        assert isinstance(back, wire.Opened) and back.resume == opened.resume
        assert _round(other, "mine", committed)
        error = _ask(owner, wire.Verify("mine", 3, len(committed) + 1, [], {"kind": "none"}))
        assert isinstance(error, wire.Error) and error.code == "unknown_session"  # it moved with its robot
        # a detached session is anyone's to re-open (a lost link), but without the secret it gets a new one
        other.close()
        table = s.server.sessions
        deadline = time.monotonic() + 5
        while _in_loop(s, lambda: table.peek("mine").conn_id) != 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        third = _open(owner, "mine", PROMPT)
        assert isinstance(third, wire.Opened) and third.resume not in ("", opened.resume)
    finally:
        owner.close()
        other.close()
        _give_back(s, target, baseline)


def test_one_client_over_its_share_evicts_its_own_least_recently_used_session(make_server, target):
    """With a token, loopback is a client like any other: all these connections are one client."""
    baseline = _in_use(target)
    s = make_server(exits="", token="t0ken", max_sessions_per_client=3)
    conns = [_connect(s, target, "t0ken") for _ in range(2)]
    try:
        for ws, sid in ((conns[0], "c0"), (conns[1], "c1"), (conns[0], "c2")):
            assert isinstance(_open(ws, sid, PROMPT), wire.Opened)
        assert isinstance(_open(conns[1], "c3", PROMPT), wire.Opened)  # its fourth: its own oldest goes
        table = s.server.sessions
        assert _in_loop(s, lambda: sorted(table._sessions)) == ["c1", "c2", "c3"]
        error = _ask(conns[0], wire.Verify("c0", 0, len(PROMPT), [], {"kind": "none"}))
        assert isinstance(error, wire.Error) and error.code == "unknown_session"
        assert _in_use(target) == baseline + 3
    finally:
        for ws in conns:
            ws.close()
        _give_back(s, target, baseline)


def test_an_open_that_finds_the_kv_pool_full_evicts_an_idle_session(make_server, target, monkeypatch):
    """The other room the sessions share: a unified KV pool whose cells idle sessions hold."""
    from server_bridge.engines import NoRoom

    baseline = _in_use(target)
    s = make_server(exits="", protect_active_s=0)  # "idle" is idle the moment it is made
    ws = _connect(s, target)
    try:
        assert isinstance(_open(ws, "idle", PROMPT), wire.Opened)
        forward, refused = target.engine.forward, []

        def full_once(batch):
            if not refused:
                refused.append(len(batch))
                raise NoRoom("the pass needs 3 KV cells, 0 of 16384 are free")
            return forward(batch)

        monkeypatch.setattr(target.engine, "forward", full_once)
        assert isinstance(_open(ws, "new", PROMPT), wire.Opened) and refused == [1]
        table = s.server.sessions
        assert table.evicted_total == 1 and _in_loop(s, lambda: sorted(table._sessions)) == ["new"]
    finally:
        ws.close()
        _give_back(s, target, baseline)


def test_a_new_robot_finding_a_full_table_is_refused_before_any_pass_and_told_when_to_return(make_server, target):
    """Every session answered within protect_active_s: a newcomer is refused at once, in the event loop (no pass
    runs for it), with its turn as retry_after_ms: never sooner than the window; once sessions end, as fast as
    they end (sessions.Turns). Its robot waits that long instead of retrying at its own backoff: at 512 robots
    on llama.cpp's 256 sequences, refused opens were most of the loop's work (docs/benchmarks/fleet_cpu/)."""
    baseline = _in_use(target)
    s = make_server(exits="", max_sessions=2, protect_active_s=3)
    a, b = _connect(s, target), _connect(s, target)
    try:
        for ws, sid in ((a, "a"), (b, "b")):
            assert isinstance(_open(ws, sid, PROMPT), wire.Opened)
            _round(ws, sid, PROMPT)  # answered now: inside the window
        passes = s.server.metrics.batches
        refused = _open(b, "c", PROMPT)
        assert isinstance(refused, wire.Error) and refused.code == "overloaded", refused
        assert "all 2 sessions" in refused.message and s.server.metrics.batches == passes  # no pass for it
        assert refused.retry_after_ms == 3000  # no session has ended (no rate yet): protect_active_s
        a.send(wire.encode(wire.Close("a")))  # one ends: a turn is the robots refused over that rate
        gone = _ask(a, wire.Verify("a", 1, len(PROMPT) + 1, [], {"kind": "none"}))  # a's frames go in order
        assert isinstance(gone, wire.Error) and gone.code == "unknown_session"
        assert isinstance(_open(b, "c", PROMPT), wire.Opened)
    finally:
        for ws in (a, b):
            ws.close()
        _give_back(s, target, baseline)
