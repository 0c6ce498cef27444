"""The verifier on the real models: at T > 0 the committed token follows the target's distribution."""

import itertools

import numpy as np
import pytest
from scipy import stats

from protocol import payload, sampling, wire
from protocol.payload import PayloadSpec
from protocol.sampling import SamplingParams
from server_bridge.config import ServerConfig
from server_bridge.verifier import Verifier

pytestmark = pytest.mark.real


@pytest.fixture(scope="module", params=["llamacpp", "torch"])
def engine_target(request):
    """The default target on each engine: numpy maths on llamacpp, the device maths (devmath) on torch."""
    return request.getfixturevalue("target" if request.param == "llamacpp" else "torch_target")


@pytest.mark.parametrize("spec", [PayloadSpec("full"), PayloadSpec("topk", 2), PayloadSpec("split")], ids=str)
def test_real_draft_and_target_commit_the_targets_distribution(drafter, engine_target, spec):
    """Draft one token (real Q4_1 q), verify it (real f32 p), over and over from the same prefix.

    T = 1.5 and top-k 4 keep the support small and make the two models disagree
    often, so both the accept path and the residual path are exercised, for each
    payload: full, topk (the draft samples from its own top 2 of 4) and split (the
    correction is drawn on the robot's side from the p_j the server sends down).
    """
    target = engine_target
    params = SamplingParams(temperature=1.5, top_k=4, seed=11)
    ids = drafter.tokenize("The robot turned", chat=False)
    verifier = Verifier(target, ServerConfig())
    session, _ = verifier.open(
        wire.Open("stat", ids, {"temperature": 1.5, "top_k": 4, "seed": 11}, payload=spec.to_wire()), 1, None
    )
    p = sampling.probs_from_logits(target.score(session.state, [])[0], params)  # [vocab]
    target.rewind(session.state, ids)
    support = np.flatnonzero(p)
    assert len(support) == 4

    rng = np.random.default_rng(5)
    firsts, rejected = [], 0
    for r in range(240):
        d = drafter.propose(ids, 1, params, rng, payload=spec)
        frame = wire.encode(wire.Verify("stat", r, len(ids), d.ids, d.wire_q()))
        out = verifier.verify(session, wire.decode(frame))
        token = out.verdict.token
        if out.residual is not None:  # split: the robot's half of the round
            res = wire.decode(wire.encode(wire.Result("stat", r, 0, -1, len(ids), {}, out.residual))).residual
            assert res["ids"] is not None and len(res["ids"]) == 4  # top-k sampling: sent sparse, 4 of 49k
            token = payload.correction(res["logits"], res["ids"], d.q.row(0), params, rng)
        firsts.append(d.ids[0] if out.verdict.accepted else token)
        rejected += out.verdict.accepted == 0
        target.rewind(session.state, ids)  # the next round starts from the same prefix
        session.owed = None
    counts = np.array([firsts.count(t) for t in support])
    assert counts.sum() == len(firsts), "a token outside the target's top-k was committed"
    assert rejected > 0  # the residual path really ran
    assert stats.chisquare(counts, p[support] * len(firsts)).pvalue > 1e-3


# --------------------------------------------------------------------------- early exits (FSD), on each engine

PROMPT = "The robot walked to the kitchen door, stopped, and"
SAMPLING = {
    "greedy": {"temperature": 0.0, "top_k": 0, "seed": 0},
    "sampled": {"temperature": 0.8, "top_k": 40, "seed": 3},
}


@pytest.fixture(scope="module")
def exit_target(engine_target):
    """llamacpp: numpy heads fed by the eval callback; torch: the modules fed by forward hooks."""
    return engine_target


@pytest.fixture(scope="module")
def exit_verifier(exit_target):
    return Verifier(exit_target, ServerConfig())


@pytest.fixture(scope="module")
def continuation(exit_target, exit_verifier):
    """The prompt and the target's own greedy continuation of it (what a perfect draft would propose)."""
    ids = exit_target.tokenizer.encode(PROMPT)
    s, _ = exit_verifier.open(wire.Open("ref", ids, SAMPLING["greedy"]), 99, None)
    return ids, [exit_verifier.ar_step(s)[0] for _ in range(40)]


def _rounds(verifier, exit_target, continuation, sampling_, exits, n=6, k=4, emit_factory=None):
    """Drive one session through n rounds of k-token drafts: the greedy continuation with one token
    changed in most rounds, and the true token among 8 candidates. Returns (verdicts, committed ids, exits).
    """
    ids, ref = continuation
    session, _ = verifier.open(wire.Open(f"x{len(exits)}", ids, sampling_, exits=exits), 1, None)
    rng = np.random.default_rng(7)
    verdicts, sent = [], []
    for r in range(n):
        done = len(session.state.ids) - len(ids)
        draft = list(ref[done : done + k]) if done + k <= len(ref) else rng.integers(0, 999, k).tolist()
        if r % 3 != 2:  # every third draft is left perfect
            draft[rng.integers(0, k)] = int(rng.integers(0, exit_target.vocab_size))
        cands = rng.integers(0, exit_target.vocab_size, (k, 8)).astype(np.int32)
        cands[:, 0] = ref[done : done + k] if done + k <= len(ref) else cands[:, 0]
        q = {"kind": "none"}
        if sampling_["temperature"] > 0:
            probs = np.full((k, exit_target.vocab_size), 0.5 / exit_target.vocab_size)
            probs[np.arange(k), draft] += 0.5
            q = {"kind": "full", "probs": probs.astype(np.float16)}
        mine = []
        out = verifier.verify(
            session, wire.Verify(session.sid, r, len(session.state.ids), draft, q, cands=cands), mine.append
        )
        verdicts.append((out.verdict, out.timing()))
        sent.append((draft, out, mine))
    return verdicts, session.state.ids, sent


@pytest.mark.parametrize("mode", ["greedy", "sampled"])
@pytest.mark.parametrize("exits", [[12, 18, 22, 26], [18, 26]])
def test_exits_change_nothing_and_their_verdicts_are_consistent(exit_verifier, exit_target, continuation, mode, exits):
    on, on_ids, sent = _rounds(exit_verifier, exit_target, continuation, SAMPLING[mode], exits)
    off, off_ids, quiet = _rounds(exit_verifier, exit_target, continuation, SAMPLING[mode], [])
    assert [v for v, _ in on] == [v for v, _ in off] and on_ids == off_ids
    assert all(not mine for _, _, mine in quiet)  # exits off: nothing emitted
    assert all("exit_layer" not in t for _, t in off)
    assert sum(len(mine) for _, _, mine in sent) >= len(sent)
    for r, (draft, out, mine) in enumerate(sent):
        assert mine, "the first exit of a pass always reports"
        committed = draft[: out.verdict.accepted] + [out.verdict.token]
        for m in mine:
            assert (m.sid, m.round) == (f"x{len(exits)}", r) and m.layer in exits
            assert 1 <= len(m.tokens) <= len(draft) + 1 and m.tokens[:-1] == draft[: len(m.tokens) - 1]
            assert 0.0 <= m.confidence <= 1.0
            assert wire.decode(wire.encode(m)) == m  # a valid wire message
        assert all(a.tokens != b.tokens for a, b in itertools.pairwise(mine))  # only changes are sent
        assert [m.layer for m in mine] == sorted({m.layer for m in mine})
        timing = out.timing()
        assert timing["exit_layer"] in exits + [exit_target.n_layers] and 0 < timing["exit_ms"] < timing["verify_ms"]
        # the verdict at exit_layer is the last one sent at or before it, and it equals the result
        before = [m for m in mine if m.layer <= timing["exit_layer"]]
        if timing["exit_layer"] < exit_target.n_layers:
            assert before[-1].tokens == committed
        assert all(m.tokens != committed for m in mine if m.layer < timing["exit_layer"])


def test_open_refuses_an_exit_the_server_does_not_have(exit_verifier, continuation):
    assert exit_verifier.exit_layers == [12, 18, 22, 26]
    with pytest.raises(wire.WireError) as e:
        exit_verifier.open(wire.Open("bad", continuation[0], SAMPLING["greedy"], exits=[12, 13]), 1, None)
    assert e.value.code == "bad_field" and "13" in e.value.message
    off = Verifier(exit_verifier.target, ServerConfig(exits=""))
    assert off.exit_layers == []
    with pytest.raises(wire.WireError, match="none"):
        off.open(wire.Open("bad", continuation[0], SAMPLING["greedy"], exits=[12]), 1, None)


def test_a_failing_exit_does_not_stop_the_result(exit_target, continuation, monkeypatch):
    verifier = Verifier(exit_target, ServerConfig(exit_layers=[18, 26]))
    off, off_ids, _ = _rounds(verifier, exit_target, continuation, SAMPLING["greedy"], [])
    monkeypatch.setattr(verifier.exits, "logits", lambda *a, **k: 1 / 0)
    broken, broken_ids, sent = _rounds(verifier, exit_target, continuation, SAMPLING["greedy"], [18, 26])
    assert [v for v, _ in broken] == [v for v, _ in off] and broken_ids == off_ids
    assert all(not mine and out.exit_layer == exit_target.n_layers for _, out, mine in sent)


def test_a_verify_with_bad_candidates_is_refused(exit_verifier, exit_target, continuation):
    session, _ = exit_verifier.open(wire.Open("c", continuation[0], SAMPLING["greedy"], exits=[26]), 1, None)
    cands = np.full((1, 4), exit_target.vocab_size, np.int32)
    with pytest.raises(wire.WireError) as e:
        exit_verifier.verify(
            session, wire.Verify("c", 0, len(session.state.ids), [5], {"kind": "none"}, cands=cands), lambda m: None
        )
    assert e.value.code == "bad_field"


LOOP_FIELDS = ("conn_id", "last_used", "requests", "detached_at", "client", "resume", "evicted", "alpha", "t_last")


def test_the_model_thread_writes_no_field_the_event_loop_owns(target):
    """Session's fields have one writer each (sessions.Session): a pass (open, verify round, ar token) returns an
    outcome and leaves the loop's fields as they were; the loop applies the outcome (Session.answered)."""
    verifier = Verifier(target, ServerConfig())
    ids = [1, 504, 3287, 288]
    session, _ = verifier.open(wire.Open("own", ids, {"temperature": 0.0, "top_k": 0, "seed": 0}), 1, None)
    session.client, session.resume, session.alpha, session.t_last = "robot", "secret", 0.5, 7.0
    before = {f: getattr(session, f) for f in LOOP_FIELDS}
    out = verifier.verify(session, wire.Verify("own", 0, len(ids), [28, 8001], {"kind": "none"}))
    verifier.ar_step(session)
    assert {f: getattr(session, f) for f in LOOP_FIELDS} == before
    reopened, _ = verifier.open(wire.Open("own", ids, {"temperature": 0.0, "top_k": 0, "seed": 0}), 1, session)
    assert session.superseded and session.retired and not session.evicted  # the model thread's own flag
    assert {f: getattr(session, f) for f in LOOP_FIELDS} == before
    assert (reopened.alpha, reopened.t_last) == (0.5, 7.0)  # the same generation goes on: its bookkeeping too
    reopened.answered(2, out.verdict.accepted, 9.0)  # in the loop, from the round's outcome
    assert reopened.alpha == pytest.approx(0.5 + 0.2 * (out.verdict.accepted / 2 - 0.5)) and reopened.t_last == 9.0


def test_a_pass_takes_every_greedy_rounds_argmax_at_once(engine_target):
    """Verifier._greedy_ids: one argmax (on torch, one copy to the host) for the pass's greedy rounds gives each
    round the ids its own rows give, and a round decided from them commits what it would have alone."""
    from server_bridge.target import Extension

    target = engine_target
    states = [target.new_state([1, 504, 3287 + i, 288], prefill=False) for i in range(3)]
    exts = [Extension(s, s.ids[s.cached :] + [28] * (i + 1), i + 2) for i, s in enumerate(states)]
    rows = target.extend(exts)
    assert [ids.tolist() for ids in target.argmax_each(rows)] == [target.argmax(r).tolist() for r in rows]
    assert target.argmax_each([]) == []
    for s in states:
        target.free(s)
