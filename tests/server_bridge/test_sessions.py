"""The session table is bounded, evicts least-recently-used and idle sessions, and isolates connections."""

from types import SimpleNamespace

import numpy as np
import pytest

from protocol.sampling import SamplingParams
from protocol.wire import WireError
from server_bridge.sessions import Session, SessionTable


def _session(sid, conn=1):
    return Session(sid, conn, state=None, params=SamplingParams(), rng=np.random.default_rng(0))


def test_full_table_evicts_least_recently_used():
    t = SessionTable(max_sessions=3, max_per_connection=10, idle_timeout_s=60)
    for sid in "abc":
        t.put(_session(sid))
    t.get("a", 1)  # a is now the most recent
    assert t.put(_session("d")) == ["b"]
    assert len(t) == 3 and t.peek("b") is None and t.evicted_total == 1


def test_idle_sessions_are_evicted():
    t = SessionTable(max_sessions=10, max_per_connection=10, idle_timeout_s=5)
    t.put(_session("old"))
    t.put(_session("new"))
    t.peek("old").last_used -= 10
    assert t.evict_idle() == ["old"]
    assert t.peek("new") is not None


def test_per_connection_cap():
    t = SessionTable(max_sessions=10, max_per_connection=2, idle_timeout_s=60)
    t.put(_session("a", conn=1))
    t.put(_session("b", conn=1))
    with pytest.raises(WireError) as e:
        t.put(_session("c", conn=1))
    assert e.value.code == "too_many_sessions"
    t.put(_session("c", conn=2))  # another robot is unaffected


def test_sessions_belong_to_their_connection():
    t = SessionTable(max_sessions=10, max_per_connection=10, idle_timeout_s=60)
    t.put(_session("a", conn=1))
    with pytest.raises(WireError) as e:
        t.get("a", conn_id=2)
    assert e.value.code == "unknown_session"
    assert not t.discard("a", conn_id=2)  # another connection cannot close it
    assert t.peek("a") is not None
    t.put(_session("a", conn=2))  # a re-open moves it
    assert t.get("a", 2).conn_id == 2
    assert t.discard("a", 2) and not t.discard("a", 2)  # closing twice is fine


def _owned(sid, ids, acked, conn=1):
    """A session of conn whose committed prefix is ids; its robot has shown it holds the first `acked`."""
    s = _session(sid, conn)
    s.state = SimpleNamespace(ids=list(ids))
    s.acknowledge(acked)
    return s


def test_another_connection_cannot_take_a_session_without_its_committed_prefix():
    t = SessionTable(max_sessions=10, max_per_connection=10, idle_timeout_s=60)
    owner = _owned("a", [1, 2, 3, 4, 5], acked=5)
    t.put(owner)
    for prompt in ([1, 2, 3, 9], [9, 9], [1, 2, 3], [1, 2, 3, 4, 6, 7]):  # another prefix, or too little of it
        with pytest.raises(WireError) as e:
            t.check_owner("a", 2, prompt)
        assert e.value.code == "session_taken" and "committed prefix" in e.value.message
    assert t.get("a", 1) is owner and owner.state.ids == [1, 2, 3, 4, 5]  # the owner never noticed
    t.check_owner("a", 1, [7, 7])  # its own connection may start anything on it
    t.check_owner("b", 2, [7, 7])  # an unknown sid is anyone's


def test_a_robot_back_on_a_new_connection_reopens_with_its_committed_prefix():
    t = SessionTable(max_sessions=10, max_per_connection=10, idle_timeout_s=60)
    t.put(_owned("a", [1, 2, 3, 4, 5], acked=5))
    t.check_owner("a", 2, [1, 2, 3, 4, 5])  # the whole committed prefix
    t.check_owner("a", 2, [1, 2, 3, 4, 5, 6])  # and a correction it still owes (split)
    # its last round was committed here but its result was lost with the link: the robot has 5 of our 8
    t.put(_owned("b", [1, 2, 3, 4, 5, 6, 7, 8], acked=5))
    t.check_owner("b", 2, [1, 2, 3, 4, 5])
    t.check_owner("b", 2, [1, 2, 3, 4, 5, 6])  # part of the lost round came through
    with pytest.raises(WireError):
        t.check_owner("b", 2, [1, 2, 3, 4, 5, 9])  # a different token where we have one is no proof


def test_a_session_whose_connection_closed_may_be_reopened_by_any_connection_with_any_prompt():
    t = SessionTable(max_sessions=10, max_per_connection=10, idle_timeout_s=60)
    t.put(_owned("a", [1, 2, 3], acked=3))
    with pytest.raises(WireError):
        t.check_owner("a", 2, [1, 2, 9])  # connection 1 is alive: no proof, no entry
    assert t.detach(1) == 1 and t.detach(1) == 0
    t.check_owner("a", 2, [1, 2, 9])  # closed: the next step's prompt re-opens it
    with pytest.raises(WireError):
        t.get("a", 2)  # but only an open takes it over
