"""The session table is bounded, evicts least-recently-used and idle sessions, and isolates connections."""

import numpy as np
import pytest

from protocol.sampling import SamplingParams
from protocol.wire import WireError
from server_bridge.sessions import Session, SessionTable, Turns, in_request


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


def test_another_open_connection_cannot_take_a_session_without_its_resume_secret():
    t = SessionTable(max_sessions=10, max_per_connection=10, idle_timeout_s=60)
    owner = _session("a", conn=1)
    owner.resume = "s3cret-of-a"
    t.put(owner)
    for resume in ("", "s3cret-of-b", "s3cret-of-a-"):  # knowing its prompt or sid proves nothing
        with pytest.raises(WireError) as e:
            t.check_owner("a", 2, resume)
        assert e.value.code == "session_taken" and "resume secret" in e.value.message
    assert t.get("a", 1) is owner  # the owner never noticed
    t.check_owner("a", 1)  # its own connection may start anything on it
    t.check_owner("b", 2)  # an unknown sid is anyone's
    t.check_owner("a", 2, "s3cret-of-a")  # its robot back on a new link, the old one not yet closed
    # the secret stays with the session while its robot re-opens it; anyone else gets a fresh one
    assert t.secret_for("a", 1) == t.secret_for("a", 2, "s3cret-of-a") == "s3cret-of-a"
    fresh = {t.secret_for("a", 2), t.secret_for("new", 1), t.secret_for("new", 1)}
    assert len(fresh) == 3 and "s3cret-of-a" not in fresh and all(len(x) >= 22 for x in fresh)


def test_a_session_whose_connection_closed_may_be_reopened_by_any_connection_but_gets_a_new_secret():
    t = SessionTable(max_sessions=10, max_per_connection=10, idle_timeout_s=60)
    s = _session("a", conn=1)
    s.resume = "s3cret-of-a"
    t.put(s)
    with pytest.raises(WireError):
        t.check_owner("a", 2)  # connection 1 is open: no secret, no entry
    assert t.detach(1) == 1 and t.detach(1) == 0
    t.check_owner("a", 2)  # closed: the next step's open re-opens it (a robot after a dropped link)
    assert t.secret_for("a", 2, "s3cret-of-a") == "s3cret-of-a"  # its robot, with its secret, keeps it
    assert t.secret_for("a", 2) != "s3cret-of-a"  # whoever re-opens it without the secret never learns it
    with pytest.raises(WireError):
        t.get("a", 2)  # but only an open takes it over


def _table(released, **kw):
    return SessionTable(idle_timeout_s=60, on_release=released.extend, **{"max_per_connection": 10, **kw})


def test_a_full_table_evicts_the_least_recently_used_idle_session_detached_first():
    released = []
    t = _table(released, max_sessions=4)
    for sid, conn in (("a", 1), ("b", 2), ("c", 1), ("d", 3)):
        t.put(_session(sid, conn))
    t.peek("a").requests = 1  # in a request now: never evicted
    t.detach(3)  # d's connection closed
    assert t.put(_session("e", 4)) == ["d"]  # detached before idle, though the most recently used
    assert t.put(_session("f", 4)) == ["b"]  # then the least recently used idle one, a passed by
    assert [s.sid for s in released] == ["d", "b"] and all(s.retired for s in released)
    assert t.evicted_total == 2 and sorted(t._sessions) == ["a", "c", "e", "f"]
    for sid in "cef":
        t.peek(sid).requests = 1
    with pytest.raises(WireError) as e:  # every one in a request: the newcomer is refused, nobody evicted
        t.make_room("g", 5, "")
    assert e.value.code == "overloaded" and len(t) == 4 and len(released) == 2
    t.make_room("a", 5, "")  # a re-open needs no room


def test_evict_one_frees_a_sequence_for_an_open():
    released = []
    t = _table(released, max_sessions=10)
    for sid in "abc":
        t.put(_session(sid))
    t.peek("a").requests = 1
    assert t.evict_one(keep="b", why="engine full") == "c"  # a is in a request, b is the one opening
    assert t.evict_one(keep="b", why="engine full") is None and [s.sid for s in released] == ["c"]


def test_a_robot_answered_within_protect_active_s_keeps_its_session_and_the_newcomer_waits():
    """More robots than sequences: LRU would evict the robot due back soonest (it drafted longest), every
    round a re-open for everyone. Inside the window a newcomer is refused instead; past it, or detached, the
    session goes as before."""
    released = []
    t = _table(released, max_sessions=2, protect_active_s=30.0)
    t.put(_session("a", 1))
    t.put(_session("b", 2))
    t.peek("a").t_last = t.peek("a").last_used = 0.0  # a's robot was last answered long ago
    assert t.put(_session("c", 3)) == ["a"]  # past the window: the least recently used idle one goes
    with pytest.raises(WireError) as e:
        t.make_room("d", 4, "")  # b and c were answered within the window: d is refused, nobody evicted
    assert e.value.code == "overloaded" and "answered within 30s" in e.value.message
    assert t.evict_one(keep="d", why="engine full") is None and [s.sid for s in released] == ["a"]
    t.detach(2)  # b's robot lost its link: anyone's to evict, window or not
    assert t.evict_one(keep="d", why="engine full") == "b"
    assert t.check_room("c", 3) is None and len(t) == 1  # the per-connection counts followed every move


def test_a_full_table_says_so_before_any_model_work():
    """`full`: the check an open passes before its images, grammar and pass; a robot's own session never waits."""
    t = _table([], max_sessions=2, protect_active_s=30.0)
    assert t.full("a") is None
    t.put(_session("a", 1))
    t.put(_session("b", 2))
    assert "all 2 sessions" in t.full("c") and t.full("a") is None  # a re-open of a held session is not new
    t.peek("a").t_last = t.peek("a").last_used = 0.0  # past the window: a would be evicted for c
    assert t.full("c") is None


def test_a_refused_robots_turn_is_the_robots_refused_over_the_rate_sessions_end():
    turns, bounds = Turns(window_s=10.0), (1.0, 10.0)
    assert turns.retry_after_s(0.0, bounds) is None  # no session ended yet: no rate (the scheduler's hint)
    turns.ended(20, 0.0)  # 2 a second
    for i in range(5):
        turns.refused(f"r{i}", 0.0)
    assert turns.retry_after_s(0.0, bounds) == 3.0  # itself and 5 ahead of it, at 2 a second
    turns.refused("r0", 1.0)  # a robot refused again counts once
    turns.admitted("r1")  # and one that got in, not at all
    assert turns.retry_after_s(1.0, bounds) == 2.5
    assert turns.retry_after_s(10.5, bounds) is None  # the window has passed: nothing ended in it
    turns.ended(100, 11.0)
    assert turns.retry_after_s(11.0, bounds) == 1.0  # 1 robot at 10 a second: the shortest bound
    small = Turns(most=8)
    for i in range(100):
        small.refused(f"x{i}", 0.0)
    small.ended(100, 0.0)
    assert len(small._refused) == 8 and len(small._ended) == 8  # bounded, however many come


def _of(client, sid, conn):
    s = _session(sid, conn)
    s.client = client
    return s


def test_one_client_cannot_hold_more_than_its_share():
    released = []
    t = _table(released, max_sessions=10, max_per_client=3)
    for i, sid in enumerate("abc"):
        t.put(_of("10.0.0.7", sid, conn=i + 1))  # over several connections: still one client
    t.put(_of("10.0.0.8", "x", conn=9))
    t.get("a", 1)  # b is now its least recently used
    assert t.put(_of("10.0.0.7", "d", conn=4)) == ["b"]  # its own idle session goes, not another client's
    assert t.make_room("a", 4, "10.0.0.7") == []  # a re-open of one of its own counts once
    for sid in "acd":
        t.peek(sid).requests = 1
    with pytest.raises(WireError) as e:
        t.put(_of("10.0.0.7", "e", conn=4))
    assert e.value.code == "too_many_sessions" and "max_sessions_per_client" in e.value.message
    t.put(_of("10.0.0.8", "y", conn=9))  # another client is unaffected
    for i in range(4):
        t.put(_of("", f"z{i}", conn=10 + i))  # and "" (a trusted loopback client) has no share of its own
    assert [s.sid for s in released] == ["b"] and len(t) == 9


def test_closing_a_session_releases_it_and_a_session_in_a_request_is_marked_while_it_waits():
    released = []
    t = _table(released, max_sessions=10)
    s = _session("a")
    t.put(s)
    with in_request(s):
        assert s.requests == 1
        with in_request(s):
            assert s.requests == 2
    assert s.requests == 0
    with in_request(None):  # an open of a new sid has no session yet
        pass
    assert t.discard("a", 1) and released == [s] and s.retired
    t.put(_session("b"))
    assert t.clear() == 1 and len(t) == 0 and [x.sid for x in released] == ["a", "b"]
