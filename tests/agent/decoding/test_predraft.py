"""Pre-drafting (FSD): the verdict queue, batched branches and the pre-draft cache (FSD end to end: test_end_to_end)."""

import time

import numpy as np
import pytest

from agent.decoding.predraft import PreDrafter, VerdictQueue
from protocol.payload import PayloadSpec
from protocol.sampling import SamplingParams

GREEDY = SamplingParams()


# --------------------------------------------------------------------------- the verdict queue


def test_priority_pops_highest_confidence_first():
    q = VerdictQueue(8, "priority")
    for key, conf in [((1,), 0.2), ((2,), 0.9), ((3,), 0.5)]:
        q.push(key, conf)
    assert [q.pop()[2] for _ in range(3)] == [(2,), (3,), (1,)]
    assert q.pop() is None


def test_fifo_pops_oldest_first_and_push_back_keeps_the_place():
    q = VerdictQueue(8, "fifo")
    for key, conf in [((1,), 0.2), ((2,), 0.9), ((3,), 0.5)]:
        q.push(key, conf)
    first = q.pop()
    q.push_back(first)
    assert [q.pop()[2] for _ in range(3)] == [(1,), (2,), (3,)]


def test_random_policy_pops_every_item_once():
    q = VerdictQueue(8, "random", np.random.default_rng(0))
    for i in range(5):
        q.push((i,), 0.5)
    assert sorted(q.pop()[2][0] for _ in range(5)) == list(range(5))


@pytest.mark.parametrize("policy", ["priority", "fifo", "random"])
def test_queue_stays_bounded_under_a_flood(policy):
    q = VerdictQueue(16, policy, np.random.default_rng(0))
    rng = np.random.default_rng(1)
    for i in range(10_000):
        q.push((i,), float(rng.random()))
        assert len(q) <= 16
    assert q.dropped == 10_000 - 16
    if policy == "priority":  # the survivors are the most confident ones
        assert min(q.pop()[0] for _ in range(16)) > 0.99


def test_bad_policy_is_refused():
    with pytest.raises(ValueError, match="policy"):
        VerdictQueue(4, "lifo")


# --------------------------------------------------------------------------- real draft model

PROMPT = "Explain how a robot dog climbs a flight of stairs."


@pytest.fixture(scope="module")
def predrafter(drafter):
    pd = PreDrafter(drafter, workers=2, threads=1)
    yield pd
    pd.close()


def _round(drafter, predrafter, number, committed, k=4):
    draft = drafter.propose(committed, k, GREEDY, np.random.default_rng(0), n_cands=8)
    predrafter.begin(number, committed, draft, k, GREEDY, 0, drafter.eos_ids)
    return draft


def _wait_cached(predrafter, key, timeout_s=20.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with predrafter._cv:
            r = predrafter._round
            if r is not None and key in r.cache:
                return
        time.sleep(0.01)
    raise AssertionError(f"{key} was never pre-drafted")


@pytest.mark.real
def test_branches_draft_what_the_draft_model_would(drafter):
    """Batched branches give the draft model's own greedy drafts (llama.cpp's batched kernels may
    round differently from one-row decoding, so a near tie can flip: most, not all, must agree)."""
    from agent.decoding.branches import BranchDrafter

    bd = BranchDrafter(drafter, slots=3, threads=1)
    committed = drafter.tokenize(PROMPT, chat=True)
    draft = drafter.propose(committed, 4, GREEDY, None)
    bonus = bd.base(committed, draft.ids)
    keys = [tuple(draft.ids) + (int(np.argmax(bonus)),), tuple(draft.ids[:1]) + (13,), (29,)]
    branches = [bd.start(k, len(committed), 4, np.random.default_rng(0)) for k in keys]
    while not all(b.done for b in branches):
        bd.step([b for b in branches if not b.done], GREEDY)
    agree = total = 0
    for b in branches:
        ref = drafter.propose(committed + list(b.key), 4, GREEDY, None)
        agree += sum(x == y for x, y in zip(ref.ids, b.ids, strict=True))
        total += 4
        out = bd.result(b, PayloadSpec("none"))
        assert out.cands.shape == (4, 8) and out.cand_p.shape == (4, 8)
        assert all(t in c for t, c in zip(out.ids, out.cands, strict=True))  # greedy: the token is the top-1
    assert agree / total >= 0.75
    # reusing a finished branch's KV as the next base gives the same next-token logits' argmax
    bd.keep(branches[0])
    nxt = committed + list(keys[0])
    b2 = bd.base(nxt, branches[0].ids, reuse=keys[0])
    b3 = BranchDrafter(drafter, slots=1, threads=1).base(nxt, branches[0].ids)
    assert int(np.argmax(b2)) == int(np.argmax(b3))


@pytest.mark.real
def test_hit_path_returns_the_cached_draft(drafter, predrafter):
    committed = drafter.tokenize(PROMPT, chat=True)
    draft = _round(drafter, predrafter, 100, committed)
    # "all accepted, plus the draft's own next token" is the robot's best guess at T = 0
    bonus = drafter.propose(committed + draft.ids, 1, GREEDY, None).ids[0]
    key = tuple(draft.ids) + (bonus,)
    _wait_cached(predrafter, key)
    got, hit = predrafter.take(100, key)
    assert hit and got is not None and len(got.ids) == 4 and got.cands.shape == (4, 8)


@pytest.mark.real
def test_miss_path_drafts_the_key_on_request(drafter, predrafter):
    committed = drafter.tokenize(PROMPT, chat=True)
    draft = _round(drafter, predrafter, 101, committed)
    key = tuple(draft.ids[:1]) + (12345,)  # no guess or exit would produce this
    got, hit = predrafter.take(101, key)
    assert not hit and got is not None and len(got.ids) == 4


@pytest.mark.real
def test_exit_flood_stays_bounded_and_inconsistent_verdicts_are_ignored(drafter, predrafter):
    committed = drafter.tokenize(PROMPT, chat=True)
    draft = _round(drafter, predrafter, 102, committed)
    assert not predrafter.offer(102, 12, [draft.ids[0] + 1, 5], 0.9)  # not a prefix of the draft
    assert not predrafter.offer(7, 12, [draft.ids[0], 5], 0.9)  # another round
    for i in range(5000):
        predrafter.offer(102, 12 + i % 4, list(draft.ids[: i % 4]) + [1000 + i], float(i % 100) / 100)
    with predrafter._cv:
        r = predrafter._round
        assert len(r.exits) <= predrafter.queue_size
        assert len(r.cache) <= predrafter.cache_size
        assert len(r.drafting) <= predrafter.workers
    predrafter.cancel()


@pytest.mark.real
def test_branches_draft_under_the_grammar_and_never_what_it_forbids(drafter, predrafter):
    """Mid-answer under the NaVILA grammar: every pre-drafted continuation is one the grammar allows, and its draft
    is allowed after it token by token (drawn under the branch's own state, as Drafter.propose draws)."""
    from agent.robot.actions import answer_grammar

    g = drafter.grammars.compile("gbnf", answer_grammar())
    answer = drafter.tokenize("The red box is to the left")
    committed = drafter.tokenize(PROMPT, chat=True) + answer
    state = g.walk(answer)
    draft = drafter.propose(committed, 4, GREEDY, np.random.default_rng(0), n_cands=8, grammar=state)
    predrafter.begin(102, committed, draft, 4, GREEDY, 0, drafter.eos_ids, PayloadSpec(), state)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        with predrafter._cv:
            cached = dict(predrafter._round.cache)
            seen = set(predrafter._round.seen)
        if len(cached) >= 2 or (cached and time.monotonic() > deadline - 15):
            break
        time.sleep(0.05)
    assert cached, "nothing was pre-drafted"
    for key, got in cached.items():
        walk = state.clone()
        assert walk.advance(key) == len(key), f"{key} is forbidden yet was drafted"
        assert walk.advance(got.ids) == len(got.ids), f"the draft after {key} leaves the grammar"
    forbidden = next(t for t in range(1000) if not state.allows(t))
    with predrafter._cv:
        assert predrafter._walk(predrafter._round, (forbidden,)) is None
    assert all(state.clone().advance(k) == len(k) for k in seen & set(cached))
    got, _ = predrafter.take(102, next(iter(cached)))
    assert got is not None
