"""The session table is bounded, evicts least-recently-used and idle sessions, and isolates connections."""
import numpy as np
import pytest

from protocol.sampling import SamplingParams
from server_bridge.sessions import Session, SessionTable
from protocol.wire import WireError


def _session(sid, conn=1):
    return Session(sid, conn, state=None, params=SamplingParams(), rng=np.random.default_rng(0))


def test_full_table_evicts_least_recently_used():
    t = SessionTable(max_sessions=3, max_per_connection=10, idle_timeout_s=60)
    for sid in "abc":
        t.put(_session(sid))
    t.get("a", 1)                                   # a is now the most recent
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
    t.put(_session("c", conn=2))                    # another robot is unaffected


def test_sessions_belong_to_their_connection():
    t = SessionTable(max_sessions=10, max_per_connection=10, idle_timeout_s=60)
    t.put(_session("a", conn=1))
    with pytest.raises(WireError) as e:
        t.get("a", conn_id=2)
    assert e.value.code == "unknown_session"
    assert not t.discard("a", conn_id=2)            # another connection cannot close it
    assert t.peek("a") is not None
    t.put(_session("a", conn=2))                    # a re-open moves it
    assert t.get("a", 2).conn_id == 2
    assert t.discard("a", 2) and not t.discard("a", 2)   # closing twice is fine
