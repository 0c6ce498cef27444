"""The sampling math: exactness of accept/reject + residual resampling, greedy tables, seeds."""

import numpy as np
import pytest
from scipy import stats

from protocol import sampling
from protocol.sampling import SamplingError, SamplingParams


def _random_dist(rng, v, sparsity=0.0):
    x = rng.gamma(0.5, size=v)
    x[rng.random(v) < sparsity] = 0.0
    x[rng.integers(v)] += 0.1  # never all zero
    return x / x.sum()


def _committed_tokens(p, q, n, seed):
    """Run n independent rounds (draft from q, verify against p); return what landed at positions 0 and 1."""
    rng = np.random.default_rng(seed)
    k = q.shape[0]
    first, second = [], []
    for _ in range(n):
        draft = np.array([sampling.sample(q[i], rng) for i in range(k)])
        v = sampling.verify_sampled(draft, q, p, rng)
        committed = list(draft[: v.accepted]) + [v.token]
        first.append(committed[0])
        if len(committed) > 1:
            second.append(committed[1])
    return np.array(first), np.array(second)


def _tv(samples, p):
    counts = np.bincount(samples, minlength=len(p))
    return 0.5 * np.abs(counts / counts.sum() - p).sum(), counts


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_rejection_sampling_reproduces_target_distribution(seed):
    rng = np.random.default_rng(100 + seed)
    v, k = 12, 3
    p = np.stack([_random_dist(rng, v, 0.3) for _ in range(k + 1)])
    q = np.stack([_random_dist(rng, v, 0.3) for _ in range(k)])
    small, _ = _committed_tokens(p, q, 2_000, seed)
    first, second = _committed_tokens(p, q, 40_000, seed + 10)

    tv_small, _ = _tv(small, p[0])
    tv_large, counts = _tv(first, p[0])
    # The distance shrinks like 1/sqrt(n): 20x the samples, well under half the distance.
    assert tv_large < 0.02
    assert tv_large < tv_small
    support = p[0] > 0
    assert counts[~support].sum() == 0, "a token the target gives zero probability was committed"
    chi = stats.chisquare(counts[support], p[0][support] * counts.sum())
    assert chi.pvalue > 1e-4

    # Given position 0 was an accepted draft token, position 1 is again distributed as p[1].
    tv_second, counts2 = _tv(second, p[1])
    assert tv_second < 0.03
    assert counts2[p[1] == 0].sum() == 0


def test_draft_equal_to_target_is_always_accepted():
    rng = np.random.default_rng(0)
    p = np.stack([_random_dist(rng, 10) for _ in range(5)])
    for _ in range(200):
        draft = np.array([sampling.sample(p[i], rng) for i in range(4)])
        assert sampling.verify_sampled(draft, p[:4], p, rng).accepted == 4


def test_residual_is_where_target_exceeds_draft():
    p = np.array([0.5, 0.3, 0.2, 0.0])
    q = np.array([0.1, 0.6, 0.2, 0.1])
    np.testing.assert_allclose(sampling.residual(p, q), [1.0, 0.0, 0.0, 0.0])
    np.testing.assert_allclose(sampling.residual(p, p), p)  # no mass left: falls back to p


@pytest.mark.parametrize(
    "draft, target_argmax, accepted, token",
    [
        ([5, 6, 7], [5, 6, 7, 8], 3, 8),  # all kept, bonus token
        ([5, 6, 7], [5, 9, 7, 8], 1, 9),  # rejected at 1, corrected to the target's choice
        ([5, 6, 7], [4, 6, 7, 8], 0, 4),  # rejected at once
        ([], [3], 0, 3),  # no draft: one target token
    ],
)
def test_greedy_table(draft, target_argmax, accepted, token):
    v = sampling.verify_greedy(np.array(draft, dtype=int), np.array(target_argmax))
    assert (v.accepted, v.token) == (accepted, token)


def test_greedy_needs_k_plus_one_rows():
    with pytest.raises(SamplingError):
        sampling.verify_greedy(np.array([1, 2]), np.array([1, 2]))


def test_same_seed_same_verdicts():
    rng = np.random.default_rng(3)
    p = np.stack([_random_dist(rng, 50) for _ in range(5)])
    q = np.stack([_random_dist(rng, 50) for _ in range(4)])
    runs = []
    for _ in range(2):
        r = np.random.default_rng(42)
        runs.append(
            [
                sampling.verify_sampled(np.array([sampling.sample(q[i], r) for i in range(4)]), q, p, r)
                for _ in range(50)
            ]
        )
    assert runs[0] == runs[1]
    assert len({v.accepted for v in runs[0]}) > 1  # the draws really vary


def test_probs_from_logits_top_k_and_temperature():
    logits = np.array([[1.0, 3.0, 2.0, 0.5, 2.5]])
    p = sampling.probs_from_logits(logits, SamplingParams(temperature=1.0, top_k=2))
    assert np.count_nonzero(p) == 2 and p[0, 1] > p[0, 4] > 0
    np.testing.assert_allclose(p.sum(), 1.0)
    cold = sampling.probs_from_logits(logits, SamplingParams(temperature=0.1))
    hot = sampling.probs_from_logits(logits, SamplingParams(temperature=10.0))
    assert cold.max() > 0.99 and hot.max() < 0.3


def test_probs_from_logits_works_on_its_own_copy_and_computes_the_plain_softmax():
    """It writes into its own array (no fresh row per step): the caller's float64 logits and mask stay as
    they were, and the result is bit for bit the masked, top-k, tempered softmax written out plainly."""
    rng = np.random.default_rng(0)
    logits = rng.normal(0, 3, size=(2, 50))  # float64: np.asarray alone would not copy it
    mask = rng.random(50) < 0.5
    before, mask_before = logits.copy(), mask.copy()
    p = sampling.probs_from_logits(logits, SamplingParams(temperature=0.7, top_k=5), mask)
    np.testing.assert_array_equal(logits, before)
    np.testing.assert_array_equal(mask, mask_before)
    assert not np.shares_memory(p, logits)
    x = np.where(mask, logits / 0.7, -np.inf)
    x = np.where(x >= np.sort(x, axis=-1)[:, -5, None], x, -np.inf)
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    np.testing.assert_array_equal(p, e / e.sum(axis=-1, keepdims=True))


def test_bad_distributions_are_refused():
    with pytest.raises(SamplingError):
        sampling.probs_from_logits(np.array([[1.0, np.nan]]), SamplingParams(temperature=1.0))
    with pytest.raises(SamplingError):
        sampling.dequantize_q(np.array([[0.5, np.nan]], dtype=np.float16))
    with pytest.raises(SamplingError):
        sampling.dequantize_q(np.zeros((1, 4), dtype=np.float16))
    with pytest.raises(SamplingError):
        sampling.verify_sampled(np.array([1]), np.array([[1.0, 0.0]]), np.full((2, 2), 0.5), np.random.default_rng(0))
    with pytest.raises(SamplingError):
        SamplingParams(temperature=-1.0)


def test_quantized_q_is_the_distribution_sampled_from():
    """Tokens drawn from the fp16 table never have zero q, even when float32 q underflows fp16."""
    rng = np.random.default_rng(0)
    logits = rng.normal(0, 8, size=(1, 5000))  # many probabilities below fp16's range
    q16, q = sampling.quantize_q(sampling.probs_from_logits(logits, SamplingParams(temperature=1.0)))
    assert q16.dtype == np.float16
    np.testing.assert_array_equal(q, sampling.dequantize_q(q16))  # the server rebuilds the same q
    for _ in range(500):
        assert q[0, sampling.sample(q[0], rng)] > 0


def test_nucleus_keeps_the_smallest_top_set_reaching_top_p_and_ties_at_its_edge():
    p = np.array([0.1, 0.5, 0.2, 0.2])
    np.testing.assert_allclose(sampling.nucleus(p, 0.5), [0.0, 1.0, 0.0, 0.0])  # 0.5 alone reaches 0.5
    # 0.5 + 0.2 reaches 0.6; the other 0.2 ties with the edge and is kept too
    np.testing.assert_allclose(sampling.nucleus(p, 0.6), [0.0, 0.5, 0.2, 0.2] / np.float64(0.9))
    np.testing.assert_allclose(sampling.nucleus(p, 0.95), p)
    np.testing.assert_allclose(sampling.nucleus(p, 1.0), p)
    np.testing.assert_allclose(sampling.nucleus(p, 1e-9), [0.0, 1.0, 0.0, 0.0])  # the top token always stays
    rows = sampling.nucleus(np.stack([p, p[::-1]]), 0.6)  # [2, V]: row by row
    np.testing.assert_allclose(rows[1], rows[0][::-1])


@pytest.mark.parametrize("temperature, top_k", [(0.3, 0), (3.0, 0), (10.0, 0), (1.0, 10), (3.0, 600)])
def test_nucleus_is_the_whole_sort_rule_written_out(temperature, top_k):
    """nucleus sorts only what it must (a small nucleus, a sparse row, a wide nucleus each take another way):
    bit for bit the rule on a whole sorted row, over a 5000-token vocabulary."""
    rng = np.random.default_rng(5)
    probs = sampling.probs_from_logits(rng.normal(0, 3, (3, 5000)), SamplingParams(temperature, top_k))
    desc = np.sort(probs, axis=-1)[:, ::-1]
    for top_p in (0.05, 0.5, 0.9, 0.999, 1.0):
        n = np.minimum((np.cumsum(desc, -1) < top_p * probs.sum(-1, keepdims=True)).sum(-1, keepdims=True), 4999)
        want = np.where(probs >= np.take_along_axis(desc, n, -1), probs, 0.0)
        np.testing.assert_array_equal(sampling.nucleus(probs, top_p), want / want.sum(-1, keepdims=True))


def test_top_p_filters_after_top_k_and_one_changes_nothing():
    rng = np.random.default_rng(3)
    logits = rng.normal(0, 2, size=(3, 40))
    base = sampling.probs_from_logits(logits, SamplingParams(temperature=0.8, top_k=10))
    np.testing.assert_array_equal(
        sampling.probs_from_logits(logits, SamplingParams(temperature=0.8, top_k=10, top_p=1.0)), base
    )
    p = sampling.probs_from_logits(logits, SamplingParams(temperature=0.8, top_k=10, top_p=0.7))
    np.testing.assert_allclose(p, sampling.nucleus(base, 0.7))
    np.testing.assert_allclose(p.sum(-1), 1.0)
    for row, b in zip(p, base, strict=True):
        kept = np.sort(b[row > 0])[::-1]
        assert kept.sum() >= 0.7 - 1e-12 and kept[:-1].sum() < 0.7  # the smallest set (no ties here)
        assert b[row == 0].max() < kept.min()  # and the most likely ones


@pytest.mark.parametrize("bad", [float("nan"), 0.0, 1.5, -0.1, float("inf")])
def test_a_bad_top_p_is_refused_with_a_clear_error(bad):
    with pytest.raises(SamplingError, match=r"top_p must be a finite number in \(0, 1\]"):
        SamplingParams(temperature=1.0, top_p=bad)


def test_top_p_travels_in_an_open_only_below_one():
    assert "top_p" not in SamplingParams(temperature=1.0).to_wire()
    assert SamplingParams(temperature=1.0, top_p=0.9).to_wire()["top_p"] == 0.9
    d = SamplingParams(temperature=0.5, top_k=7, seed=3, top_p=0.9).to_wire()
    assert SamplingParams(**d) == SamplingParams(temperature=0.5, top_k=7, seed=3, top_p=0.9)


@pytest.mark.parametrize("seed", [0, 1])
def test_rejection_sampling_reproduces_the_nucleus_filtered_target(seed):
    """Draft and target both sample under top_p: q and p have different supports, and the committed
    tokens follow the target's nucleus, never a token outside it."""
    rng = np.random.default_rng(200 + seed)
    v, k = 12, 3
    params = SamplingParams(temperature=1.0, top_p=0.8)
    target = rng.normal(0, 1.5, (k + 1, v))
    p = sampling.probs_from_logits(target, params)
    q = sampling.probs_from_logits(target[:k] + rng.normal(0, 1.5, (k, v)), params)
    assert (np.count_nonzero(p, axis=-1) < v).all() and (np.count_nonzero(p[:2], axis=-1) > 1).all()
    first, second = _committed_tokens(p, q, 20_000, seed)
    for samples, row in ((first, p[0]), (second, p[1])):
        counts = np.bincount(samples, minlength=v)
        assert counts[row == 0].sum() == 0, "a token outside the target's nucleus was committed"
        assert stats.chisquare(counts[row > 0], row[row > 0] * counts.sum()).pvalue > 1e-4
