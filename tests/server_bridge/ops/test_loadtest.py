"""server_bridge.ops.loadtest (`server-bridge loadtest`): the SLO rule, capacity, trace replay, /metrics parsing and
robots against a fake verifier."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time

import pytest
from websockets.asyncio.server import serve

from protocol import wire
from server_bridge import cli
from server_bridge.ops import loadtest as lt

pytestmark = pytest.mark.timeout(120)


# --------------------------------------------------------------------------- a synthetic trace


def synthetic_trace(n_prompts: int = 3, length: int = 20, gamma_max: int = 8) -> lt.Trace:
    """Prompt j: [100 + j, 1, 2]; target: 1000 j + 10 + t; every 5th chain is wrong from its 3rd token on."""
    prompts = []
    for j in range(n_prompts):
        target = [1000 * j + 10 + t for t in range(length)]
        chains = []
        for i in range(length):
            chain = (target[i:] + [7] * gamma_max)[:gamma_max]
            if i % 5 == 0:
                chain[2:] = [9] * (gamma_max - 2)
            chains.append(chain)
        prompts.append(lt.TracePrompt([100 + j, 1, 2], target, chains))
    return lt.Trace("fake-draft", "fake-target", "ab" * 32, 5000, [3], gamma_max, prompts)


# --------------------------------------------------------------------------- the SLO rule


def test_a_generation_faster_than_its_class_meets_it_and_is_decided_when_it_finishes():
    assert lt.judge(opened=10.0, done=14.0, tokens=48, goal=48, slo=8, lost=None, now=99) == (14.0, False)


def test_a_slower_generation_violates_and_is_decided_at_its_deadline():
    # 48 tokens at 8 tok/s are due 6 s after open; done after 7 s: 6.9 tok/s
    assert lt.judge(10.0, 17.0, 48, 48, 8, None, 99) == (16.0, True)


def test_exactly_on_the_class_speed_is_not_a_violation():
    assert lt.judge(0.0, 6.0, 48, 48, 8, None, 99) == (6.0, False)


def test_an_unfinished_generation_is_undecided_until_its_deadline_then_violated():
    assert lt.judge(10.0, None, 30, 48, 4, None, now=21.9) == (None, False)  # due at 22
    assert lt.judge(10.0, None, 30, 48, 4, None, now=22.0) == (22.0, True)


def test_a_shed_generation_violates_even_when_it_ends_fast():
    assert lt.judge(10.0, 11.0, 48, 48, 2, lost=10.5, now=99) == (10.5, True)
    # shed after its deadline had passed: it was certain at the deadline already
    assert lt.judge(10.0, None, 8, 48, 8, lost=20.0, now=99) == (16.0, True)


def test_a_generation_ended_early_by_eos_is_judged_on_the_tokens_it_made():
    assert lt.judge(0.0, 2.0, 10, 48, 4, None, 99) == (2.0, False)  # 5 tok/s >= 4
    assert lt.judge(0.0, 2.0, 6, 48, 4, None, 99) == (2.0, True)  # 3 tok/s < 4


# --------------------------------------------------------------------------- capacity


def test_capacity_is_the_largest_n_before_the_first_failure():
    assert lt.capacity({2: True, 4: True, 8: True, 12: False, 16: True}) == (8, False)


def test_capacity_when_every_n_passes_is_a_lower_bound():
    assert lt.capacity({2: True, 4: True, 32: True}) == (32, True)


def test_capacity_is_zero_when_the_smallest_n_fails_and_no_data_is_skipped():
    assert lt.capacity({2: False, 4: True}) == (0, False)
    assert lt.capacity({2: None, 4: True, 8: None, 12: False}) == (4, False)
    assert lt.capacity({2: None, 4: None}) == (None, False)
    assert lt.capacity({2: None, 4: False}) == (0, False)


def test_a_point_passes_only_with_every_class_within_the_bound():
    assert lt.point_passes(0.03, {"8": 0.05, "2": 0.0, "6": None})
    assert not lt.point_passes(0.03, {"8": 0.06, "2": 0.0})
    assert not lt.point_passes(0.051, {"8": 0.0})
    assert not lt.point_passes(None, {"8": None})


# --------------------------------------------------------------------------- trace replay


def test_on_the_target_path_the_draft_is_the_recorded_chain_cut_to_k():
    p = synthetic_trace().prompts[0]
    assert lt.next_draft(p, [], 4) == p.chains[0][:4]
    assert lt.next_draft(p, p.target_ids[:7], 8) == p.chains[7]
    assert lt.next_draft(p, p.target_ids[:7], 0) == []


def test_off_the_target_path_or_past_the_recording_the_draft_is_empty():
    p = synthetic_trace().prompts[0]
    assert lt.next_draft(p, p.target_ids[:3] + [999], 4) == []
    assert lt.next_draft(p, [999] + p.target_ids[1:5], 4) == []
    assert lt.next_draft(p, p.target_ids, 4) == []


def test_trace_files_load_and_match_their_format(tmp_path):
    t = synthetic_trace(n_prompts=1, length=3, gamma_max=2)
    d = {
        "format": "edgespec-trace/1",
        "draft": t.draft,
        "target": t.target,
        "vocab_hash": t.vocab_hash,
        "vocab_size": t.vocab_size,
        "eos_ids": t.eos_ids,
        "gamma_max": 2,
        "prompts": [{"prompt_ids": p.prompt_ids, "target_ids": p.target_ids, "chains": p.chains} for p in t.prompts],
    }
    (tmp_path / "ok.json").write_text(json.dumps(d))
    assert lt.Trace.load(tmp_path / "ok.json") == t
    d["prompts"][0]["chains"].pop()
    (tmp_path / "bad.json").write_text(json.dumps(d))
    with pytest.raises(ValueError, match="one chain of 2 per target token"):
        lt.Trace.load(tmp_path / "bad.json")


# --------------------------------------------------------------------------- /metrics

METRICS = """# HELP bridge_rounds_total verification rounds
# TYPE bridge_rounds_total counter
bridge_rounds_total 120
bridge_sessions_active 4
bridge_errors_total{code="overloaded"} 3
bridge_batch_size_sum 240
bridge_batch_size_count 80
bridge_verify_seconds_bucket{le="+Inf"} 80 1700000000
bridge_tau 3.500000
python_gc_objects_collected_total 12
bridge_broken not-a-number
"""


def test_parse_metrics_keeps_every_bridge_sample_with_its_labels():
    m = lt.parse_metrics(METRICS)
    assert m == {
        "bridge_rounds_total": 120.0,
        "bridge_sessions_active": 4.0,
        'bridge_errors_total{code="overloaded"}': 3.0,
        "bridge_batch_size_sum": 240.0,
        "bridge_batch_size_count": 80.0,
        'bridge_verify_seconds_bucket{le="+Inf"}': 80.0,
        "bridge_tau": 3.5,
    }


def test_parse_metrics_drops_the_replica_label_of_the_servers_page():
    """server-bridge renders /metrics with prometheus_client and labels every sample with its replica:
    the keys stay as without it, so a window's deltas and means read the same on any replica."""
    from server_bridge.metrics import ServerMetrics

    class Sessions:
        evicted_total = 0

        def __len__(self):
            return 2

    metrics = ServerMetrics()
    metrics.count_round(4, 3, 10.0)
    metrics.count_batch(3, 5.0)
    metrics.errors["overloaded"] += 2
    metrics.count_request(8.0, late=False)
    page = metrics.render(Sessions(), 1, replica='gpu-0:8765 "a"')
    m = lt.parse_metrics(page)
    assert m["bridge_rounds_total"] == 1 and m["bridge_sessions_active"] == 2
    assert m['bridge_errors_total{code="overloaded"}'] == 2 and m['bridge_slo_requests_total{class="8"}'] == 1
    assert m['bridge_batch_size_bucket{le="+Inf"}'] == 1 and lt.metric_means(m) == {"bridge_batch_size": 3.0}
    assert not any("replica" in k for k in m)
    assert lt.parse_metrics('bridge_errors_total{code="a}b",replica="r"} 1\n') == {'bridge_errors_total{code="a}b"}': 1}


def test_window_deltas_subtract_counters_keep_gauges_and_give_histogram_means():
    start = lt.parse_metrics(
        "bridge_rounds_total 20\nbridge_batch_size_sum 40\nbridge_batch_size_count 20\nbridge_sessions_active 9\n"
    )
    delta = lt.metrics_delta(start, lt.parse_metrics(METRICS))
    assert delta["bridge_rounds_total"] == 100 and delta["bridge_sessions_active"] == 4
    assert delta['bridge_errors_total{code="overloaded"}'] == 3
    assert lt.metric_means(delta) == {"bridge_batch_size": 200 / 60}


# --------------------------------------------------------------------------- summary of a point


def test_summary_follows_the_generations_opened_in_the_window_and_counts_tokens_committed_in_it():
    trace = synthetic_trace()
    out = lt.PointLog(window=(10.0, 20.0), ended=25.0)
    target = trace.prompts[0].target_ids
    out.generations = [
        lt.Generation(0, 8, 0, 16, opened=5.0, tokens=target[:16], done=9.0),  # opened before: out
        lt.Generation(0, 8, 0, 16, opened=10.5, tokens=target[:16], done=12.0),  # 10.7 tok/s: met
        lt.Generation(1, 2, 0, 16, opened=11.0, tokens=target[:16], done=20.0),  # 1.8 tok/s < 2: violated
        lt.Generation(1, 2, 0, 16, opened=19.0, tokens=target[:4]),  # due at 27: undecided at 25
        lt.Generation(0, 8, 0, 16, opened=18.0, tokens=target[:2] + [1], shed=18.5),  # shed; and not exact
        lt.Generation(0, 8, 0, 16, opened=21.0, tokens=target[:16], done=22.0),  # opened in the tail: out
    ]
    out.rounds = [(9.0, 50.0, 5), (11.0, 60.0, 4), (19.0, 100.0, 3), (21.0, 80.0, 5)]
    out.sheds = [18.5]
    s = lt.summarize(out, trace, (8, 2))
    assert s["decided"] == 3 and s["violations"] == 2 and s["undecided"] == 1
    assert s["violation_rate_by_class"] == {"8": 0.5, "2": 1.0}
    assert s["goodput_tokens_per_s"] == pytest.approx(0.7)  # 4 + 3 tokens in 10 s
    assert s["slo_met_tokens_per_s"] == pytest.approx(1.6)
    assert s["rounds"] == 2 and s["round_ms_mean"] == pytest.approx(80.0) and s["sheds"] == 1
    assert s["tail_s"] == 5.0 and not s["exact"] and not s["passes"]
    assert [g["in_sample"] for g in s["generation_records"]] == [False, True, True, False, True, False]


def test_the_sample_is_the_generations_opened_in_the_window_or_the_one_a_stuck_robot_spent_it_in():
    g = lambda robot, opened, done=None: lt.Generation(robot, 8, 0, 48, opened, done=done)  # noqa: E731
    gens = [
        g(0, 1.0, 4.0),
        g(0, 4.0, 12.0),
        g(0, 12.0, 30.0),
        g(0, 30.0),  # robot 0: opens in [10, 20)
        g(1, 2.0, 25.0),
        g(1, 25.0),  # robot 1: one spans the window
        g(2, 3.0, 15.0),
        g(2, 15.0, 21.0),
        g(2, 21.0),
    ]  # robot 2: opened 15 only
    assert lt.sample(gens, (10.0, 20.0)) == [False, False, True, False, True, False, False, True, False]


# --------------------------------------------------------------------------- robots against a fake verifier


class FakeVerifier:
    """A websocket verifier that answers from the trace: greedy acceptance against target_ids.

    Every `shed_every`-th verify is answered with `error overloaded` (and forgets the session,
    as a shedding server may), so the robots' back-off and re-open path runs.
    """

    def __init__(self, trace: lt.Trace, shed_every: int = 0, verify_s: float = 0.002):
        self.trace = trace
        self.shed_every = shed_every
        self.verify_s = verify_s
        self.sessions: dict[str, list[int]] = {}
        self.verifies = 0
        self.opens: list[tuple[str, int, dict]] = []

    def continuation(self, ids: list[int]) -> tuple[list[int], int]:
        p = next(p for p in self.trace.prompts if ids[: len(p.prompt_ids)] == p.prompt_ids)
        return p.target_ids, len(p.prompt_ids)

    async def handle(self, ws) -> None:
        async for frame in ws:
            msg = wire.decode(frame)
            if isinstance(msg, wire.Hello):
                if msg.draft_vocab_hash != self.trace.vocab_hash:
                    await ws.send(wire.encode(wire.Error("vocab_mismatch", "not my vocabulary")))
                    return
                await ws.send(
                    wire.encode(
                        wire.Welcome(
                            "fake",
                            self.trace.vocab_size,
                            self.trace.vocab_hash,
                            [3],
                            [],
                            {"max_frame_bytes": 1 << 20, "max_draft_len": 16, "max_context": 2048},
                        )
                    )
                )
            elif isinstance(msg, wire.Open):
                self.sessions[msg.sid] = list(msg.prompt_ids)
                self.opens.append((msg.sid, len(msg.prompt_ids), msg.slo))
                await ws.send(wire.encode(wire.Opened(msg.sid, len(msg.prompt_ids), {})))
            elif isinstance(msg, wire.Verify):
                await ws.send(wire.encode(await self.verify(msg)))
            elif isinstance(msg, wire.Close):
                self.sessions.pop(msg.sid, None)

    async def verify(self, msg: wire.Verify) -> wire.Message:
        self.verifies += 1
        if self.shed_every and self.verifies % self.shed_every == 0:
            self.sessions.pop(msg.sid, None)
            return wire.Error("overloaded", "shed", msg.sid)
        ids = self.sessions.get(msg.sid)
        if ids is None:
            return wire.Error("unknown_session", "gone", msg.sid)
        assert msg.n_committed == len(ids)
        await asyncio.sleep(self.verify_s)
        target, n_prompt = self.continuation(ids)
        at = len(ids) - n_prompt
        accepted = 0
        while accepted < len(msg.draft_ids) and msg.draft_ids[accepted] == target[at + accepted]:
            accepted += 1
        token = target[at + accepted]
        ids += msg.draft_ids[:accepted] + [token]
        return wire.Result(msg.sid, msg.round, accepted, token, len(ids), {"verify_ms": 1.0, "passes": 1})


async def run_against_fake(fake: FakeVerifier, n: int, cfg: lt.LoadConfig) -> lt.PointLog:
    async with serve(fake.handle, "127.0.0.1", 0) as server:
        port = server.sockets[0].getsockname()[1]
        return await lt.run_robots(f"ws://127.0.0.1:{port}", fake.trace, n, cfg)


async def robots_until(fake: FakeVerifier, n: int, cfg: lt.LoadConfig, enough, limit_s: float = 60.0) -> lt.PointLog:
    """N robots against the fake until `enough(out)` holds, however slow the machine, then halt them.

    The window is the whole run. A test of what the robots commit must not depend on how many
    rounds a fixed window holds: a loaded CI machine once fitted 6 generations where 150 fit here.
    """
    out, halt = lt.PointLog(), asyncio.Event()
    async with serve(fake.handle, "127.0.0.1", 0) as server:
        url = f"ws://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        start = time.monotonic()
        robots = [asyncio.create_task(lt.Robot(i, url, fake.trace, cfg, out, halt).run()) for i in range(n)]
        while not enough(out) and time.monotonic() - start < limit_s:
            await asyncio.sleep(0.01)
        out.window = (start, time.monotonic())
        out.ended = out.window[1]
        halt.set()
        await asyncio.wait_for(asyncio.gather(*robots), cfg.recv_timeout_s + 5)
    assert enough(out), f"not enough work in {limit_s:.0f}s: {len(out.generations)} generations, {out.errors}"
    return out


def done_per_robot(out: lt.PointLog, n: int) -> list[int]:
    return [sum(g.robot == r and g.done is not None for g in out.generations) for r in range(n)]


# classes lax enough (12 tokens in 4-12 s) that only a broken robot or fake violates them
FAST = lt.LoadConfig(
    gamma=4,
    draft_ms=1.0,
    tokens=12,
    classes=(3, 1, 2),
    warmup_s=0.2,
    window_s=1.0,
    backoff_s=0.02,
    recv_timeout_s=5.0,
    stagger_s=0.05,
)


def test_robots_commit_exactly_the_target_tokens_generation_after_generation():
    trace = synthetic_trace()
    fake = FakeVerifier(trace)
    out = asyncio.run(robots_until(fake, 3, FAST, lambda o: min(done_per_robot(o, 3)) >= 3))
    assert not out.errors and out.sheds == []
    done = [g for g in out.generations if g.done is not None]
    assert len(done) >= 3 * 3  # several generations per robot
    for g in out.generations:
        assert g.tokens == trace.prompts[g.prompt].target_ids[: len(g.tokens)]
    for g in done:
        assert len(g.tokens) == g.goal == 12  # never past the goal: the last draft is cut short
    assert {g.prompt for g in out.generations if g.robot == 0} == {0, 1, 2}
    assert {slo["tokens_per_s"] for _, _, slo in fake.opens} == {3, 1, 2}
    s = lt.summarize(out, trace, FAST.classes)
    assert s["exact"] and s["decided"] >= 9 and s["violation_rate"] == 0.0 and s["goodput_tokens_per_s"] > 0
    # the trace's wrong chains cost rounds: tau is below gamma + 1
    assert 1 < s["tokens_per_round"] < 5


def test_a_shed_round_counts_as_a_violation_and_the_robot_reopens_with_its_prefix():
    trace = synthetic_trace()
    fake = FakeVerifier(trace, shed_every=7)
    out = asyncio.run(robots_until(fake, 2, FAST, lambda o: len(o.sheds) >= 2 and min(done_per_robot(o, 2)) >= 2))
    assert not out.errors and out.sheds
    shed = [g for g in out.generations if g.sheds]
    assert shed and all(g.tokens == trace.prompts[g.prompt].target_ids[: len(g.tokens)] for g in out.generations)
    # a re-open carries the prompt and every token committed before the shed
    assert any(n > len(trace.prompts[0].prompt_ids) for _, n, _ in fake.opens)
    s = lt.summarize(out, trace, FAST.classes)
    recs = [r for r in s["generation_records"] if r["sheds"] and r["in_sample"]]
    assert recs and all(r["violated"] for r in recs)
    assert s["sheds"] >= 1 and s["exact"]


def test_robots_halt_once_every_generation_opened_in_the_window_is_decided():
    fake = FakeVerifier(synthetic_trace(), verify_s=0.05)
    cfg = lt.LoadConfig(
        gamma=4, draft_ms=1.0, tokens=12, classes=(8,), warmup_s=0.0, window_s=0.5, recv_timeout_s=5.0, stagger_s=0.0
    )
    out = asyncio.run(run_against_fake(fake, 2, cfg))
    start, stop = out.window
    sample = [g for g, c in zip(out.generations, lt.sample(out.generations, out.window), strict=True) if c]
    assert sample and all(lt.decided(g, out.ended) for g in sample)
    assert stop <= out.ended <= stop + 12 / 8 + 1.0  # the tail lasts at most the longest deadline
    # and the robots stop right after: their round in flight (50 ms here) is the last; the slack is a loaded CI's
    assert time.monotonic() - out.ended < 1.0
    assert out.rounds and all(r[0] <= out.ended + 0.5 for r in out.rounds)


def test_a_refused_handshake_is_reported_and_the_run_still_ends_on_time():
    fake = FakeVerifier(synthetic_trace())
    other = lt.Trace(**{**synthetic_trace().__dict__, "vocab_hash": "cd" * 32})
    cfg = lt.LoadConfig(tokens=12, classes=(8,), warmup_s=0.0, window_s=0.3, recv_timeout_s=2.0, stagger_s=0.0)

    async def run():
        async with serve(fake.handle, "127.0.0.1", 0) as server:
            port = server.sockets[0].getsockname()[1]
            return await lt.run_robots(f"ws://127.0.0.1:{port}", other, 2, cfg)

    t0 = time.monotonic()
    out = asyncio.run(run())
    assert time.monotonic() - t0 < 3.0
    assert out.errors and all("vocab_mismatch" in e for e in out.errors)
    assert out.generations == [] and out.rounds == []


# --------------------------------------------------------------------------- `server-bridge loadtest`


def trace_file(tmp_path, trace: lt.Trace):
    d = dataclasses.asdict(trace) | {"format": "edgespec-trace/1"}
    (tmp_path / "trace.json").write_text(json.dumps(d))
    return tmp_path / "trace.json"


@pytest.fixture
def fake_url():
    """FakeVerifier on a loopback port, in a thread of its own (the CLI runs its own event loop)."""
    import threading

    fake, ready, stop = FakeVerifier(synthetic_trace()), threading.Event(), None
    url = []

    async def main():
        nonlocal stop
        stop = asyncio.get_running_loop().create_future()
        async with serve(fake.handle, "127.0.0.1", 0) as server:
            url.append(f"ws://127.0.0.1:{server.sockets[0].getsockname()[1]}")
            ready.set()
            await stop

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_until_complete, args=(main(),), daemon=True)
    thread.start()
    assert ready.wait(10)
    yield url[0]
    loop.call_soon_threadsafe(stop.set_result, None)
    thread.join(10)


def test_loadtest_runs_the_sizes_asked_and_reports_each_class_capacity(tmp_path, fake_url, capsys):
    path = trace_file(tmp_path, synthetic_trace())
    timing = ["--warmup-s", "0.2", "--window-s", "1", "--draft-ms", "1", "--tokens", "12", "--stagger-s", "0"]
    argv = ["loadtest", "--trace", str(path), "--url", fake_url, "--n", "1,2", "--classes", "3,1", *timing]
    assert cli.main([*argv, "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert [p["n"] for p in got["points"]] == [1, 2]
    assert all(p["exact"] and p["errors"] == [] and p["decided"] > 0 for p in got["points"])
    assert got["capacity"] == {c: {"capacity": 2, "lower_bound": True, "tried": [1, 2]} for c in ("3", "1")}
    assert cli.main([*argv[:6], "1", *argv[7:]]) == 0  # text: one line a point, one a class
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("N=1 ") and out[-2] == "3 tok/s: at least 1 robots (N tried: [1])"
    assert out[-1].startswith("1 tok/s: ")  # one robot: none of class 1 ran


@pytest.mark.parametrize(
    "argv, match",
    [
        (["--url", "http://x"], "url must be ws:// or wss://"),
        (["--gamma", "9"], "gamma 9 > the trace's gamma_max 8"),
        (["--classes", "0"], "classes must be positive"),
        (["--n", "0"], "n must be fleet sizes >= 1"),
    ],
)
def test_loadtest_refuses_bad_flags_in_one_line(tmp_path, capsys, argv, match):
    path = trace_file(tmp_path, synthetic_trace())
    assert cli.main(["loadtest", "--trace", str(path), *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("server-bridge loadtest: ") and match in err and len(err.splitlines()) == 1


def test_a_trace_that_is_not_one_is_refused_before_any_robot_runs(tmp_path, capsys, monkeypatch):
    (tmp_path / "t.json").write_text(json.dumps({"format": "edgespec-trace/1", "prompts": []}))
    assert cli.main(["loadtest", "--trace", str(tmp_path / "t.json")]) == 2
    assert "a trace without 'draft'" in capsys.readouterr().err
    monkeypatch.setattr(lt, "MAX_TRACE_BYTES", 10)
    assert cli.main(["loadtest", "--trace", str(tmp_path / "t.json")]) == 2
    assert "too big for a trace" in capsys.readouterr().err


def test_a_refused_robot_waits_at_least_the_servers_hint():
    robot = lt.Robot(0, "ws://127.0.0.1:1", synthetic_trace(), FAST, lt.PointLog(), asyncio.Event())
    plain = wire.Error("overloaded", "saturated", "s1")
    hinted = wire.Error("overloaded", "saturated", "s1", 3000)
    own = [robot.backoff(0, plain) for _ in range(50)]
    assert all(0.01 <= w <= 0.03 for w in own)  # backoff_s 0.02, jittered by +-50 %
    waits = [robot.backoff(0, hinted) for _ in range(50)]
    assert all(3.0 <= w <= 4.5 for w in waits) and len(set(waits)) > 1  # the hint, spread up to +50 %
    assert robot.backoff(30, hinted) <= lt.MAX_BACKOFF_S * 1.5
