"""The torch engine's device maths against protocol.sampling, the numpy reference: same seed, same
verdicts; the committed token distributed as the target's (chi-squared); bad logits refused."""

import numpy as np
import pytest
import torch
from scipy import stats

from protocol import sampling
from protocol.sampling import SamplingError, SamplingParams
from server_bridge.engines import devmath


def _dist(rng, v, sparsity=0.3):
    x = rng.gamma(0.5, size=v)
    x[rng.random(v) < sparsity] = 0.0
    x[rng.integers(v)] += 0.1
    return x / x.sum()


def test_same_seed_same_verdicts_as_the_numpy_reference():
    rng = np.random.default_rng(0)
    v, k = 40, 4
    for r in range(300):
        p = np.stack([_dist(rng, v) for _ in range(k + 1)])
        q = np.stack([_dist(rng, v) for _ in range(k)])
        draft = [int(rng.choice(v, p=q[i])) for i in range(k)]
        ref = sampling.verify_sampled(np.array(draft), q, p, np.random.default_rng(r))
        dev = devmath.verify_sampled(draft, q, torch.from_numpy(p), np.random.default_rng(r))
        assert dev == ref, r
        qx = q[np.arange(k), draft]
        assert devmath.verify_split(draft, qx, torch.from_numpy(p), np.random.default_rng(r)) == sampling.verify_split(
            np.array(draft), qx, p, np.random.default_rng(r)
        )


def test_the_device_path_commits_the_targets_distribution():
    rng = np.random.default_rng(7)
    v, k, n = 12, 3, 20_000
    p = np.stack([_dist(rng, v) for _ in range(k + 1)])
    q = np.stack([_dist(rng, v) for _ in range(k)])
    p_dev = torch.from_numpy(p).float()  # the device computes in float32
    first = []
    for _ in range(n):
        draft = [sampling.sample(q[i], rng) for i in range(k)]
        verdict = devmath.verify_sampled(draft, q, p_dev, rng)
        first.append(draft[0] if verdict.accepted else verdict.token)
    counts = np.bincount(first, minlength=v)
    support = p[0] > 0
    assert counts[~support].sum() == 0
    assert stats.chisquare(counts[support], p[0][support] * n).pvalue > 1e-4


@pytest.mark.parametrize("top_k", [0, 5])
def test_probs_match_the_reference_and_keep_ties_at_the_kth_value(top_k):
    rng = np.random.default_rng(1)
    logits = rng.normal(size=(3, 50)).astype(np.float32)
    logits[:, :3] = 4.0  # a tie at the top
    params = SamplingParams(temperature=0.7, top_k=top_k)
    ref = sampling.probs_from_logits(logits, params)
    dev = devmath.probs_from_logits(torch.from_numpy(logits), params).double().numpy()
    np.testing.assert_allclose(dev, ref, atol=1e-6)
    assert ((dev > 0).sum(-1) == (ref > 0).sum(-1)).all()


def test_half_precision_logits_stay_finite_and_bad_ones_are_refused():
    big = torch.tensor([[3e38, 1e38, -3e38]], dtype=torch.bfloat16)  # bf16 has float32's range
    p = devmath.probs_from_logits(big, SamplingParams(temperature=1.0))
    assert torch.isfinite(p).all() and abs(float(p.sum()) - 1) < 1e-6
    for bad in (float("nan"), float("inf")):
        with pytest.raises(SamplingError, match="NaN or infinity"):
            devmath.probs_from_logits(torch.tensor([[0.0, bad]], dtype=torch.float16), SamplingParams(temperature=1.0))


@pytest.mark.parametrize("top_k, top_p", [(0, 0.5), (0, 0.9), (8, 0.7)])
def test_the_device_nucleus_matches_the_reference(top_k, top_p):
    """The same nucleus on the device as in numpy: the same support row by row, the same probabilities,
    and a tie at the nucleus's edge kept on both."""
    rng = np.random.default_rng(4)
    logits = rng.normal(0, 2, size=(6, 50)).astype(np.float32)
    logits[0, :2] = 9.0  # two tied tokens, each under top_p 0.5 of the mass, together over it: both kept
    params = SamplingParams(temperature=0.9, top_k=top_k, top_p=top_p)
    ref = sampling.probs_from_logits(logits, params)
    dev = devmath.probs_from_logits(torch.from_numpy(logits), params).double().numpy()
    np.testing.assert_array_equal(dev > 0, ref > 0)
    np.testing.assert_allclose(dev, ref, atol=1e-6)
    assert (ref[0, :2] > 0).all()
    one = devmath.probs_from_logits(torch.from_numpy(logits[0]), params).double().numpy()  # [V], as ar.py
    np.testing.assert_allclose(one, ref[0], atol=1e-6)
