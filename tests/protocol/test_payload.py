"""Payload modes on small synthetic vocabularies: every mode commits the target's distribution,
and malformed payloads are refused with a message that says what is wrong.

Each round goes through the wire (encode, decode) between the robot's half
(`payload.draw`, `payload.correction`) and the server's half (`dense_q` /
`split_qx`, then `verify_sampled` / `verify_split`), as in production.
"""

import numpy as np
import pytest
from scipy import stats

from protocol import payload, sampling, wire
from protocol.payload import PayloadSpec
from protocol.sampling import SamplingError, SamplingParams

V, K_DRAFT = 10, 3
PARAMS = SamplingParams(temperature=1.0)


def _models(seed):
    """Target and draft logits [k + 1, V] for k = 3 positions, different enough to reject often."""
    rng = np.random.default_rng(seed)
    target = rng.normal(0, 1.5, (K_DRAFT + 1, V))
    draft = target[:K_DRAFT] + rng.normal(0, 1.5, (K_DRAFT, V))
    return target, draft


def _round(spec, target_logits, draft_logits, rng, params=PARAMS, accept=None):
    """One SD round over the wire; returns the committed tokens."""
    ids, rows = [], []
    for i in range(K_DRAFT):
        token, _, row = payload.draw(draft_logits[i], params, spec, rng)
        ids.append(token)
        rows.append(row)
    dq = payload.DraftQ.stack(spec.kind, ids, rows)
    msg = wire.decode(wire.encode(wire.Verify("t", 0, 5, ids, dq.to_wire())))
    p = sampling.probs_from_logits(target_logits, params)
    if spec.kind == "split":
        qx = payload.split_qx(msg.q, msg.draft_ids, spec)
        v = (accept or sampling.verify_split)(np.array(ids), qx, p, rng)
        if v.token != sampling.RESIDUAL:
            return ids[: v.accepted] + [v.token]
        sent_ids, logits = payload.sparse_residual(target_logits[v.accepted].astype(np.float32), p[v.accepted], params)
        return ids[: v.accepted] + [payload.correction(logits, sent_ids, dq.row(v.accepted), params, rng)]
    q = payload.dense_q(msg.q, msg.draft_ids, V, spec)
    v = sampling.verify_sampled(np.array(ids), q, p, rng)
    return ids[: v.accepted] + [v.token]


def _check(committed, target_logits, params=PARAMS):
    """Position 0 over all rounds, and position 1 where position 0 was the accepted draft token, follow p."""
    p = sampling.probs_from_logits(target_logits, params)
    firsts = np.array([c[0] for c in committed])
    counts = np.bincount(firsts, minlength=V)
    assert counts[p[0] == 0].sum() == 0, "a token the target rules out was committed"
    support = p[0] > 0
    pvalue = stats.chisquare(counts[support], p[0][support] * len(firsts)).pvalue
    seconds = np.array([c[1] for c in committed if len(c) > 1])
    c2 = np.bincount(seconds, minlength=V)
    support2 = p[1] > 0
    pvalue2 = stats.chisquare(c2[support2], p[1][support2] * len(seconds)).pvalue
    return pvalue, pvalue2, len(seconds)


@pytest.mark.parametrize(
    "spec",
    [PayloadSpec("full"), PayloadSpec("topk", 1), PayloadSpec("topk", 3), PayloadSpec("topk", V), PayloadSpec("split")],
    ids=str,
)
def test_every_payload_commits_the_targets_distribution(spec):
    target, draft = _models(3)
    rng = np.random.default_rng(17)
    committed = [_round(spec, target, draft, rng) for _ in range(12_000)]
    pvalue, pvalue2, n2 = _check(committed, target)
    assert pvalue > 1e-4 and pvalue2 > 1e-4
    assert n2 > 1_000  # the second position was reached often
    assert sum(len(c) < K_DRAFT + 1 for c in committed) > 1_000  # and rejections happened often


def test_split_with_top_k_sampling_sends_a_sparse_exact_residual():
    params = SamplingParams(temperature=0.9, top_k=4)
    target, draft = _models(5)
    rng = np.random.default_rng(2)
    ids, logits = payload.sparse_residual(
        target[0].astype(np.float32), sampling.probs_from_logits(target[:1], params)[0], params
    )
    assert len(ids) == 4
    committed = [_round(PayloadSpec("split"), target, draft, rng, params) for _ in range(12_000)]
    pvalue, pvalue2, _ = _check(committed, target, params)
    assert pvalue > 1e-4 and pvalue2 > 1e-4


def test_the_inverted_split_ratio_is_caught():
    """The public DSSD code accepts with min(1, q/p); the same test rejects it, so the test has teeth."""

    def inverted(draft_ids, qx, p, rng):
        for i, x in enumerate(draft_ids):
            if rng.random() >= min(1.0, qx[i] / p[i, x]):
                return sampling.Verdict(i, sampling.RESIDUAL)
        return sampling.Verdict(len(draft_ids), sampling.sample(p[-1], rng))

    target, draft = _models(3)
    rng = np.random.default_rng(17)
    committed = [_round(PayloadSpec("split"), target, draft, rng, accept=inverted) for _ in range(12_000)]
    pvalue, _, _ = _check(committed, target)
    assert pvalue < 1e-6


def test_fixed_point_sums_exactly_and_is_what_is_drawn():
    rng = np.random.default_rng(0)
    probs = sampling.probs_from_logits(rng.normal(0, 6, 5_000)[None], PARAMS)[0]
    counts = sampling.fixed_point(probs)
    assert counts.sum() == sampling.SPLIT_ONE and counts.min() >= 0
    assert np.abs(counts / sampling.SPLIT_ONE - probs).max() <= 1.0 / sampling.SPLIT_ONE
    small = np.array([3, 1, 0, 4])
    draws = np.bincount([sampling.sample_fixed(small, rng) for _ in range(8_000)], minlength=4)
    assert draws[2] == 0
    assert stats.chisquare(draws[[0, 1, 3]], np.array([3, 1, 4]) / 8 * 8_000).pvalue > 1e-4


def test_greedy_draws_ids_only():
    logits = np.array([0.1, 3.0, 0.2])
    for kind in payload.KINDS:
        spec = PayloadSpec.parse(kind).for_params(SamplingParams())
        assert spec.kind == "none"
        assert payload.draw(logits, SamplingParams(), spec, np.random.default_rng(0)) == (1, None, None)


# --------------------------------------------------------------------------- malformed payloads


def _topk(ids, probs):
    return {"kind": "topk", "ids": np.array(ids, np.int32), "probs": np.array(probs, np.float16)}


@pytest.mark.parametrize(
    "q, spec, draft, words",
    [
        (_topk([[1, 2]], [[0.5, 0.5]]), PayloadSpec("topk", 3), [1], "K=2"),  # wrong K
        (_topk([[1, 99]], [[0.5, 0.5]]), PayloadSpec("topk", 2), [1], "vocabulary"),  # id outside V
        (_topk([[1, -1]], [[0.5, 0.5]]), PayloadSpec("topk", 2), [1], "vocabulary"),
        (_topk([[1, 1]], [[0.5, 0.5]]), PayloadSpec("topk", 2), [1], "repeat"),
        (_topk([[1, 2]], [[1.5, -0.5]]), PayloadSpec("topk", 2), [1], "negative"),
        (_topk([[1, 2]], [[np.nan, 0.5]]), PayloadSpec("topk", 2), [1], "NaN"),
        (_topk([[1, 2]], [[0.9, 0.9]]), PayloadSpec("topk", 2), [1], "sums to 1.79"),
        (_topk([[1, 2]], [[0.3, 0.3]]), PayloadSpec("topk", 2), [1], "sums to 0.6"),
        (_topk([[1, 2]], [[1.0, 0.0]]), PayloadSpec("topk", 2), [2], "zero probability"),  # drafted, q says 0
        (_topk([[1, 2]], [[1.0, 0.0]]), PayloadSpec("topk", 2), [3], "zero probability"),  # not even among the K
        (
            {"kind": "full", "probs": np.full((1, V), 0.2, np.float16)},
            PayloadSpec("full"),
            [1],
            "sums to 1.99|sums to 2.0",
        ),
        ({"kind": "full", "probs": np.full((1, V - 1), 0.1, np.float16)}, PayloadSpec("full"), [1], "vocabulary"),
        ({"kind": "full", "probs": np.full((1, V), 0.1, np.float16)}, PayloadSpec("topk", 2), [1], "declared"),
    ],
)
def test_bad_dense_payloads_are_refused(q, spec, draft, words):
    with pytest.raises(SamplingError, match=words):
        payload.dense_q(q, draft, V, spec)


@pytest.mark.parametrize("px, words", [([0], "counts"), ([sampling.SPLIT_ONE + 1], "counts"), ([5, 6], "2 prob")])
def test_bad_split_payloads_are_refused(px, words):
    with pytest.raises(SamplingError, match=words):
        payload.split_qx({"kind": "split", "px": np.array(px)}, [4], PayloadSpec("split"))


def test_bad_specs_are_refused():
    for kind, k in (("topk", 0), ("topk", payload.MAX_TOPK + 1), ("topk", 2.5), ("gzip", 0)):
        with pytest.raises(ValueError):
            PayloadSpec(kind, k)
    assert PayloadSpec("full", 4).k == 0 and PayloadSpec().to_wire() == {"kind": "topk", "k": payload.DEFAULT_TOPK}


def test_vocab_hash_reads_the_sentencepiece_space_marker_as_a_space():
    """llama.cpp and transformers render Gemma 3's whitespace pieces differently; the tokens are the same."""
    from protocol.modelfiles import vocab_hash

    assert vocab_hash([b"a", "\u2581\u2581".encode()]) == vocab_hash([b"a", b"  "])
    assert vocab_hash([b"a", b"  "]) != vocab_hash([b"a", b" "]) != vocab_hash([b" ", b"a"])


@pytest.mark.parametrize("spec", [PayloadSpec("full"), PayloadSpec("topk", 3), PayloadSpec("split")], ids=str)
def test_every_payload_commits_the_targets_nucleus_under_top_p(spec):
    """Draft and target both sample under top_p = 0.9: each payload still commits the target's nucleus
    distribution; split's residual after a rejection travels sparse (the nucleus the server judged by)."""
    params = SamplingParams(temperature=1.0, top_p=0.9)
    target, draft = _models(3)
    p = sampling.probs_from_logits(target, params)
    assert (1 < np.count_nonzero(p[:2], axis=-1)).all() and (np.count_nonzero(p, axis=-1) < V).all()  # it cuts
    ids, _ = payload.sparse_residual(target[0].astype(np.float32), p[0], params)
    assert ids is not None and sorted(ids) == sorted(np.flatnonzero(p[0]))
    rng = np.random.default_rng(23)
    committed = [_round(spec, target, draft, rng, params) for _ in range(10_000)]
    pvalue, pvalue2, n2 = _check(committed, target, params)  # _check asserts nothing left the nucleus
    assert pvalue > 1e-4 and pvalue2 > 1e-4
    assert n2 > 1_000 and sum(len(c) < K_DRAFT + 1 for c in committed) > 1_000
