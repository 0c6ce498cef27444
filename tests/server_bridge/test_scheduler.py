"""The batch scheduler's decisions, as tables: WISP Algorithm 1 and the FCFS / fixed baselines."""

import math

import numpy as np
import pytest

from protocol.wire import WireError
from server_bridge.estimator import VerifyTimeModel, batch_memory_bytes
from server_bridge.scheduler import Request, Scheduler, deadline, slo_batch

# T(B) = 10 ms + 1 ms per padded new token: a batch of B rows of 5 new tokens takes 10 + 5B ms
MODEL = VerifyTimeModel(a=1.0, b_c=0.0, b_r=0.0, c=10.0)
NOW = 100.0


def req(sid, deadline_s=math.inf, value=4.0, new=5, arrival=0.0, cached=100):
    """deadline_s: seconds after NOW."""
    return Request(sid, (cached, new), value, NOW + deadline_s, NOW - 1.0 + arrival)


def pick(pending, guard_s=0.0, memory=lambda members: True, max_batch=16):
    return [r.sid for r in slo_batch(pending, NOW, MODEL, guard_s, memory, max_batch)]


def test_critical_requests_go_first_in_earliest_deadline_order():
    # solo cost 15 ms: with a 30 ms guard, a deadline within 45 ms is critical; 3 rows take 25 ms
    pending = [req("relaxed", 5.0, value=9), req("c3", 0.040), req("c1", 0.030), req("c2", 0.035)]
    assert pick(pending, guard_s=0.030, max_batch=3) == ["c1", "c2", "c3"]


def test_non_critical_requests_go_by_utility_density():
    # same cost: density follows the expected tokens; a longer draft costs more per row
    pending = [
        req("low", 5.0, value=1),
        req("high", 5.0, value=5),
        req("mid", 5.0, value=3),
        req("long", 5.0, value=5, new=40),
    ]
    assert pick(pending, max_batch=3) == ["high", "mid", "long"]


def test_growth_stops_at_the_first_infeasible_addition():
    # by density: a, b, big, small. b's deadline (26 ms) holds 2 rows (20 ms); big's 40 new tokens pad the
    # batch to 130 ms and growth stops there, though small (3 rows of 5: 25 ms) would have fitted
    pending = [
        req("a", 5.0, value=5),
        req("b", 0.026, value=4),
        req("big", 5.0, value=3.5, new=40),
        req("small", 5.0, value=1),
    ]
    assert pick(pending) == ["a", "b"]


def test_a_critical_request_that_does_not_fit_skips_the_utility_phase():
    pending = [req("c1", 0.016), req("c2", 0.019), req("other", 5.0, value=9)]
    assert pick(pending, guard_s=0.005) == ["c1"]  # c2 with c1: 20 ms > 19 ms, and then nothing else


def test_memory_budget_caps_the_batch():
    pending = [req(f"s{i}", 5.0) for i in range(6)]
    assert len(pick(pending, memory=lambda members: len(members) <= 4)) == 4


def test_a_request_that_cannot_make_its_deadline_is_served_first_and_does_not_block_others():
    pending = [req("lost", -0.5), req("ok", 5.0)]
    assert pick(pending) == ["lost", "ok"]
    assert pending[0].late and not pending[1].late


def test_even_an_infeasible_request_alone_is_served_rather_than_an_idle_target():
    assert pick([req("huge", 5.0, new=100)], memory=lambda members: False) == ["huge"]


def test_one_request_per_session_in_a_pass():
    pending = [req("s", 5.0, value=5), req("s", 5.0, value=4), req("t", 5.0, value=3)]
    assert pick(pending) == ["s", "t"]


def make(policy, **kw):
    args = dict(
        max_queue=4,
        max_batch=3,
        guard_ms=0.0,
        memory_budget_bytes=1 << 30,
        memory_of=lambda m: 0,
        batch_wait_ms=20.0,
        max_wait_ms=500.0,
    )
    args.update(kw)
    return Scheduler(policy, MODEL, **args)


def test_fcfs_serves_one_at_a_time_in_arrival_order():
    s = make("fcfs")
    for i, d in enumerate([5.0, 0.001, 2.0]):
        s.admit(req(f"r{i}", d, arrival=i * 0.01))
    assert [[r.sid for r in s.next_batch(NOW)] for _ in range(3)] == [["r0"], ["r1"], ["r2"]]


def test_fixed_waits_for_a_full_batch_or_its_timeout():
    s = make("fixed")
    s.admit(req("a", arrival=0.995))  # arrived 5 ms before NOW
    s.admit(req("b", arrival=0.996))
    assert not s.ready(NOW)
    assert s.ready(NOW + 0.016)  # the oldest waited 20 ms
    s.admit(req("c", arrival=0.997))
    assert s.ready(NOW)
    assert [r.sid for r in s.next_batch(NOW)] == ["a", "b", "c"]


def test_the_queue_is_bounded_and_sheds_with_overloaded():
    s = make("slo")
    for i in range(4):
        s.admit(req(f"r{i}"))
    with pytest.raises(WireError) as e:
        s.admit(req("one-too-many"))
    assert e.value.code == "overloaded" and len(s) == 4


def test_requests_waiting_past_max_wait_are_handed_back_to_be_shed():
    # Only those a batch was chosen without (issue 51, item 4; before, every one past max_wait): a request that
    # waited for the pass running when it came is the next batch's, however long that pass took (Scheduler.expired)
    s = make("fcfs", max_wait_ms=500.0)
    s.admit(req("served", arrival=0.0))
    s.admit(req("old", arrival=0.0))  # waited 1 s at NOW
    s.admit(req("new", arrival=0.9))  # waited 100 ms
    assert s.expired(NOW) == []  # no batch chosen since they came: they waited for the running pass alone
    assert [r.sid for r in s.next_batch(NOW - 1.0)] == ["served"]
    assert [r.sid for r in s.expired(NOW)] == ["old"]
    assert [r.sid for r in s.pending] == ["new"]
    assert [r.sid for r in s.expired(math.inf)] == ["new"]  # the server stopping: every one


def test_only_a_passed_over_request_sets_the_wake_up_for_its_shedding():
    s = make("fixed", max_wait_ms=500.0, batch_wait_ms=10_000.0, max_batch=2)
    s.admit(req("a", arrival=0.0))
    assert s.wake_at() == pytest.approx(NOW - 1.0 + 10.0)  # the batch wait alone: nothing can be shed
    s.admit(req("b", arrival=0.1))
    s.admit(req("c", arrival=0.2))
    assert [r.sid for r in s.next_batch(NOW)] == ["a", "b"]
    assert s.wake_at() == pytest.approx(NOW - 0.8 + 0.5)  # c, passed over, is shed once it waited 500 ms


def test_deadline_is_the_rounds_budget_at_its_class_speed():
    # 8 tokens/s, previous result at 10 s: 4.6 expected tokens are due at 10 + 4.6 / 8
    assert deadline(8.0, 10.0, 4.6) == pytest.approx(10 + 4.6 / 8)
    assert deadline(0.0, 10.0, 4.6) == math.inf


def test_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="scheduler must be one of"):
        make("lifo")


def robot_back_in(s, sid, answered_at, gap_s):
    """Teach the scheduler that sid's robot comes back gap_s after an answer, and answer it at answered_at."""
    s.answered(sid, answered_at - 1.0)
    s.admit(Request(sid, (100, 5), 4.0, math.inf, answered_at - 1.0 + gap_s))
    s.next_batch(answered_at - 1.0 + gap_s)
    s.answered(sid, answered_at)


def test_slo_waits_briefly_for_a_robot_due_back_when_nothing_is_critical():
    s = make("slo", batch_wait_ms=50.0)
    robot_back_in(s, "returning", NOW - 0.010, gap_s=0.030)  # answered 10 ms ago, back in ~20 ms
    s.admit(req("waiting", 5.0, arrival=0.995))
    assert not s.ready(NOW)
    assert s.wake_at() == pytest.approx(NOW - 0.010 + 0.050)  # at most batch_wait after the target freed
    s.admit(req("returning", 5.0, arrival=1.0))  # it came back: no one else is due
    assert s.ready(NOW)
    assert sorted(r.sid for r in s.next_batch(NOW)) == ["returning", "waiting"]


def test_slo_never_holds_a_critical_request_or_waits_for_an_overdue_robot():
    s = make("slo", batch_wait_ms=50.0)
    robot_back_in(s, "returning", NOW - 0.010, gap_s=0.030)
    s.admit(req("urgent", 0.010))  # solo 15 ms > 10 ms left: critical now
    assert s.ready(NOW)
    s = make("slo", batch_wait_ms=50.0)
    robot_back_in(s, "gone", NOW - 0.040, gap_s=0.030)  # was due 10 ms ago: it may have left
    s.admit(req("waiting", 5.0))
    assert s.ready(NOW)


def test_the_robot_table_forgets_the_longest_silent_robots_never_one_waiting():
    s = make("slo")  # holds 4 * 4 + 64 = 80 robots, then trims a quarter
    s.answered("shed", 0.1)  # its request was shed and it went quiet
    s.admit(Request("shed", (100, 5), 4.0, math.inf, 0.2))
    assert [r.sid for r in s.expired(math.inf)] == ["shed"]  # (shed as the server stops: Scheduler.expired)
    s.answered("flying", 0.3)  # its request is in the pass now running
    s.admit(Request("flying", (100, 5), 4.0, math.inf, 0.4))
    assert [r.sid for r in s.next_batch(0.4)] == ["flying"]
    for i in range(4):  # answered long ago, but waiting again: the busiest
        s.answered(f"busy{i}", 0.5 + i)
        s.admit(Request(f"busy{i}", (100, 5), 4.0, math.inf, 10.0 + i))
    quiet = [f"quiet{i}" for i in range(80 - len(s._seen) + 1)]
    for i, sid in enumerate(quiet):  # answered one after another, none back yet
        s.answered(sid, 20.0 + i)
    gone = ["shed"] + quiet[: 81 // 4 - 1]  # the longest silent: no answer since 0.2 s, then oldest
    assert len(s._seen) == 81 - 81 // 4
    assert set(s._seen) == {"flying", "busy0", "busy1", "busy2", "busy3", *quiet} - set(gone)


def exhaustive_batch_ms(model, members):
    """batch_ms as it was before issue 51 (e73bce7): every start i for every j of the split's programme."""
    order = sorted(range(len(members)), key=lambda i: (members[i][1], members[i][0]))
    best = [0.0] + [math.inf] * len(order)
    for j in range(1, len(order) + 1):
        for i in range(j):
            best[j] = min(best[j], best[i] + model.predict_ms([members[k] for k in order[i:j]]))
    return best[-1]


def every_addition_slo_batch(pending, now, model, guard_s, fits_memory, max_batch, batch_ms=exhaustive_batch_ms):
    """slo_batch as it was before issue 51 (e73bce7), kept as the reference: each addition tried and priced."""
    solo = {id(r): model.predict_ms([r.member]) / 1e3 for r in pending}  # v_i, seconds
    critical, other = [], []
    for r in pending:
        r.late = now + solo[id(r)] > r.deadline
        (critical if now >= r.deadline - solo[id(r)] - guard_s else other).append(r)
    critical.sort(key=lambda r: (r.deadline, r.arrival))  # EDF
    other.sort(key=lambda r: (-r.value / max(solo[id(r)], 1e-9), r.arrival))  # density
    batch = []

    def feasible_add(r):
        trial = batch + [r]
        if len(trial) > max_batch or not fits_memory([m.member for m in trial]):
            return False
        bound = min((m.deadline for m in trial if not m.late), default=math.inf)
        return now + batch_ms(model, [m.member for m in trial]) / 1e3 <= bound

    sids = set()
    for queue in (critical, other):
        for r in queue:
            if r.sid in sids:
                continue
            if not feasible_add(r):
                if not batch:
                    batch.append(r)
                return batch
            batch.append(r)
            sids.add(r.sid)
    return batch


GPU_7B = VerifyTimeModel(a=0.05, b_c=1e-7, b_r=2e-5, c=12.0)  # a 7B on an H200, roughly


def random_fleet(rng, n, lax=False):
    """Robots' rounds (drafts over warm caches, now and then a prompt), SLO classes 0-32 tok/s, a few sessions
    with two requests waiting; the previous result up to half a second ago. lax: slow classes, results just
    in, so that batches grow to where a split into passes decides whether the next one fits."""
    sessions = max(1, n - int(rng.integers(0, 3)))
    out = []
    for _ in range(n):
        if rng.random() < 0.1:
            member, value = (int(rng.integers(0, 300)), int(rng.integers(16, 600))), 1.0
        else:
            k = int(rng.integers(1, 16))
            member, value = (int(rng.integers(0, 4000)), k + 1), float(rng.uniform(0.2, 0.95) * k + 1)
        slo = float(rng.choice([1.0, 2.0, 4.0] if lax else [0.0, 2.0, 4.0, 8.0, 16.0, 32.0]))
        since = NOW - float(rng.uniform(0, 0.05 if lax else 0.5))
        out.append(Request(f"s{rng.integers(sessions)}", member, value, deadline(slo, since, value), since, slo))
    return out


def test_the_batch_is_the_one_trying_every_addition_chose_on_random_fleets():
    # the same requests in the same order, and the same late ones: under every model, memory, cap and guard
    rng = np.random.default_rng(51)
    models = [GPU_7B, GPU_7B, VerifyTimeModel(), MODEL, VerifyTimeModel(a=0.15, b_c=1e-6, b_r=1e-4, c=4.0, scale=1.7)]
    memories = [
        lambda members: True,
        lambda members: True,
        lambda members: len(members) <= 5,
        lambda members: batch_memory_bytes(members, 100, 50) <= 8_000_000,
    ]
    for _ in range(300):
        pending = random_fleet(rng, int(rng.integers(1, 28)), lax=bool(rng.random() < 0.5))
        model, memory = models[rng.integers(len(models))], memories[rng.integers(len(memories))]
        args = (NOW, model, float(rng.choice([0.0, 0.005, 0.03])), memory, int(rng.choice([1, 8, 16, 1024, 1024])))
        before = [id(r) for r in every_addition_slo_batch(pending, *args)], [r.late for r in pending]
        after = [id(r) for r in slo_batch(pending, *args)], [r.late for r in pending]
        assert after == before


def test_the_batch_is_the_same_at_a_thousand_waiting():
    # past the reference's reach: every addition tried, priced by today's split (itself the same as before);
    # the last fleet, drafts of 4 to 9 tokens due in 0.2-1.4 s, grows batches of hundreds whose last member
    # only the exact split can turn away
    rng = np.random.default_rng(52)
    mixed = [
        Request(
            f"r{i}", (int(rng.integers(256, 4096)), int(rng.integers(4, 10))), 4.0, NOW + rng.uniform(0.2, 1.4), NOW
        )
        for i in range(1024)
    ]
    for pending in (random_fleet(rng, 300), random_fleet(rng, 300, True), random_fleet(rng, 1024), mixed):
        args = (pending, NOW, GPU_7B, 0.005, lambda members: True, 1024)
        chosen = [id(r) for r in slo_batch(*args)]
        assert len(chosen) > 20
        assert chosen == [id(r) for r in every_addition_slo_batch(*args, batch_ms=VerifyTimeModel.batch_ms)]


def test_a_packed_engines_batch_is_the_one_trying_every_addition_chose():
    # one unpadded pass: the batch is the longest prefix whose summed rows finish before every deadline in it
    rng = np.random.default_rng(53)
    packed = [
        VerifyTimeModel(a=0.05, b_c=1e-7, b_r=2e-5, c=12.0, packed=True),
        VerifyTimeModel(a=0.12, b_c=0.0, b_r=6e-3, c=0.0, packed=True, scale=1.3),
    ]
    for _ in range(200):
        pending = random_fleet(rng, int(rng.integers(1, 60)), lax=bool(rng.random() < 0.5))
        model = packed[rng.integers(len(packed))]
        args = (NOW, model, float(rng.choice([0.0, 0.005, 0.03])), lambda members: True, int(rng.choice([8, 1024])))
        before = every_addition_slo_batch(pending, *args, batch_ms=VerifyTimeModel.batch_ms)
        assert [id(r) for r in slo_batch(pending, *args)] == [id(r) for r in before]


def test_a_batch_ends_within_max_batch_ms_even_when_every_request_is_late():
    # an overloaded fleet: every round already late, so no deadline bounds the batch; max_batch_ms does
    model = VerifyTimeModel(a=1.0, b_c=0.0, b_r=0.0, c=10.0, packed=True)  # 10 ms + 5 ms a round
    pending = [req(f"r{i}", -1.0) for i in range(100)]
    assert len(slo_batch(pending, NOW, model, 0.0, lambda members: True, 1024)) == 100
    assert len(slo_batch(pending, NOW, model, 0.0, lambda members: True, 1024, max_batch_s=0.1)) == 18
    assert len(slo_batch(pending, NOW, model, 0.0, lambda members: True, 1024, max_batch_s=0.001)) == 6  # 4 x c
    long = [req("prefill", -1.0, new=500)] + pending
    assert len(slo_batch(long, NOW, model, 0.0, lambda members: True, 1024, max_batch_s=0.001)) == 1  # alone


def test_a_refused_robot_is_told_to_come_back_once_the_queue_has_drained():
    s = make("slo")
    assert s.retry_after_ms(NOW) == 1000  # nothing waits: the shortest hint
    s.admit(req("old", arrival=-1.0))  # waiting since NOW - 2 s
    assert s.saturated(NOW) is not None
    assert s.retry_after_ms(NOW) == 4000  # twice its wait
    assert s.retry_after_ms(NOW + 30) == 10_000  # at most 10 s


def test_the_batch_bound_never_falls_below_four_passes_fixed_cost():
    # one pass costs 114 ms fixed (the shipped f32 target on 2 cores): a 100 ms bound would serve one at a time
    model = VerifyTimeModel(a=3.7, b_c=0.0, b_r=0.0, c=114.0, packed=True)  # 114 + 18.5 ms a round
    pending = [req(f"r{i}", -1.0) for i in range(40)]
    assert len(slo_batch(pending, NOW, model, 0.0, lambda members: True, 1024, max_batch_s=0.1)) == 18  # <= 456 ms
