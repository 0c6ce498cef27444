"""Batched verification on the real target: a session gets the same tokens in a batch as alone."""

import numpy as np
import pytest

from protocol import wire
from server_bridge.config import ServerConfig
from server_bridge.requests import OpenRequest, VerifyRequest
from server_bridge.target import Extension
from server_bridge.verifier import Verifier

pytestmark = pytest.mark.real

PROMPTS = [
    "Go to the red box.",
    "Turn left at the second door, then stop next to the chair.",
    "What do you see?",
    "Walk forward two meters and look around for a person wearing a hat.",
    "Stop.",
    "Describe the room in one sentence.",
]


def greedy(target, ids, n):
    """The target's own greedy continuation, one token per pass, alone."""
    state = target.new_state(ids)
    out = []
    for _ in range(n):
        token = int(np.argmax(target.score(state, [])[0]))
        target.commit(state, [token], len(state.ids))
        out.append(token)
    return out


@pytest.fixture(scope="module", params=["llamacpp", "torch", "torch-compiled"])
def target(request, target):
    """Every test here on each engine (the session-wide `target` is the llamacpp one), and on the torch engine
    with its pass compiled (the tiny random target: compiling the 30-layer one would take minutes here)."""
    if request.param == "torch-compiled":
        return request.getfixturevalue("compiled_torch_target")
    return target if request.param == "llamacpp" else request.getfixturevalue("torch_target")


@pytest.fixture(scope="module")
def prompts(drafter):
    return [drafter.tokenize(p, chat=True) for p in PROMPTS]


@pytest.fixture(scope="module")
def references(target, prompts):
    return [greedy(target, ids, 20) for ids in prompts]


def test_a_padded_pass_gives_every_row_the_logits_it_gets_alone(target, prompts, references):
    """Warm sessions with caches of different lengths beside cold ones with nothing cached."""

    def members():
        out = []
        for i, (ids, ref) in enumerate(zip(prompts, references, strict=True)):
            committed = ids + ref[:i]  # committed prefixes of different lengths
            draft = ref[i : i + 1 + i % 4]
            if i % 3 == 2:  # cold: the whole prefix goes with the draft
                state = target.new_state(committed, prefill=False)
                draft[-1:] = [17]  # and a draft that goes wrong at its end
            else:
                state = target.new_state(committed)
            out.append(Extension(state, committed[state.cached :] + draft, len(draft) + 1))
        return out

    alone = [target.extend([e])[0] for e in members()]
    batched = target.extend(members())
    for a, b in zip(alone, batched, strict=True):
        assert a.shape == b.shape
        np.testing.assert_array_equal(a.argmax(-1), b.argmax(-1))
        # llama.cpp tiles a matmul by the batch's size, so a batched row rounds differently (seen: up to
        # 0.028 on a cold row whose prompt rides with the draft, logits of magnitude ~20)
        np.testing.assert_allclose(a, b, atol=2e-3 if target.engine.info.engine == "torch" else 5e-2)


def test_after_a_padded_pass_each_cache_is_its_own_again(target, prompts, references):
    """The caches cut out of a batch carry on alone: the next solo pass gives the reference token."""
    states = [target.new_state(ids) for ids in prompts[:3]]
    refs = references[:3]
    batch = [Extension(s, s.ids[s.cached :] + ref[:2], 3) for s, ref in zip(states, refs, strict=True)]
    target.extend(batch)
    for s, ref in zip(states, refs, strict=True):
        target.commit(s, ref[:3], len(s.ids) + 2)  # the pass verified ref[:2]; ref[2] is its bonus
        assert s.seq.length >= s.cached == len(s.ids) - 1
        assert int(np.argmax(target.score(s, [])[0])) == ref[3]


def test_batched_rounds_commit_what_each_session_commits_alone(target, prompts, references):
    """Several SD sessions, cold and warm, through Verifier.run_batch round after round: each commits the
    target's greedy tokens, whatever its draft and whoever shares its pass."""
    verifier = Verifier(target, ServerConfig())
    sessions = {}
    jobs = [
        OpenRequest(
            wire.Open(f"s{i}", ids, {"temperature": 0.0, "top_k": 0, "seed": 0}, payload={"kind": "none", "k": 0}),
        )
        for i, ids in enumerate(prompts)
    ]
    results, _, members = verifier.run_batch(jobs)
    assert len(members) == len(prompts) and all(m[0] == 0 for m in members)  # six cold prefills in one pass
    for opened, ids in zip(results, prompts, strict=True):
        session = opened.session
        sessions[session.sid] = session
        assert session.state.cached == len(ids) - 1
    rng = np.random.default_rng(0)
    for r in range(6):
        jobs = []
        for i, (ids, ref) in enumerate(zip(prompts, references, strict=True)):
            s = sessions[f"s{i}"]
            n = len(s.state.ids) - len(ids)
            if n >= 12:
                continue
            draft = list(ref[n : n + int(rng.integers(0, 5))])
            if draft and rng.random() < 0.4:
                draft[int(rng.integers(0, len(draft)))] = 42  # a wrong guess somewhere
            jobs.append(VerifyRequest(s, wire.Verify(s.sid, r, len(s.state.ids), draft, {"kind": "none"})))
        results, _, members = verifier.run_batch(jobs)
        assert len(members) == len(jobs)
        for _job, outcome in zip(jobs, results, strict=True):
            assert not isinstance(outcome, Exception), outcome
    for i, (ids, ref) in enumerate(zip(prompts, references, strict=True)):
        got = sessions[f"s{i}"].state.ids[len(ids) :]
        assert got == ref[: len(got)] and len(got) >= 6


def test_a_bad_request_gets_its_error_and_leaves_the_others_pass_alone(target, prompts, references):
    verifier = Verifier(target, ServerConfig())
    good, _ = verifier.open(wire.Open("good", prompts[0], {"temperature": 0.0}), 1, None)
    bad, _ = verifier.open(wire.Open("bad", prompts[1], {"temperature": 0.0}), 1, None)
    jobs = [
        VerifyRequest(bad, wire.Verify("bad", 0, len(prompts[1]) + 5, [1, 2], {"kind": "none"})),  # desync
        VerifyRequest(good, wire.Verify("good", 0, len(prompts[0]), references[0][:3], {"kind": "none"})),
    ]
    (err, outcome), _, members = verifier.run_batch(jobs)
    assert isinstance(err, wire.WireError) and err.code == "desync"
    assert outcome.verdict.accepted == 3 and outcome.verdict.token == references[0][3]
    assert len(members) == 1


@pytest.fixture(scope="module", params=["llamacpp", "torch"])
def tapped(request):
    """A target whose layer 12 can be tapped, on each engine (llama.cpp names its tapped layers at start)."""
    if request.param == "torch":
        return request.getfixturevalue("torch_target")
    from server_bridge.target import load_target

    return load_target(threads=1, max_sequences=8, kv_tokens=4096, tap_layers=[12])


def test_taps_in_a_batch_see_their_own_rows(tapped, prompts, references):
    """Early exits read the residual stream of their session's rows, not a neighbour's, on each engine."""
    target = tapped

    def run(batch_with_others):
        seen = []
        state = target.new_state(prompts[0])
        mine = Extension(
            state, state.ids[state.cached :] + references[0][:3], 4, taps={12: lambda h: seen.append(np.array(h))}
        )
        others = (
            [
                Extension(target.new_state(ids), ids[-1:] + ref[:6], 7)
                for ids, ref in zip(prompts[1:3], references[1:3], strict=True)
            ]
            if batch_with_others
            else []
        )
        target.extend(others[:1] + [mine] + others[1:])
        return seen[0]

    alone, batched = run(False), run(True)
    assert alone.shape == batched.shape == (4, target.engine.hidden_size)
    np.testing.assert_allclose(alone, batched, atol=1e-3)
