"""Optimal draft length (TK-SLT Theorem 2 / ODLD), the cost estimator and AS2's hysteresis."""

import math

import numpy as np
import pytest

from agent.decoding.draftlen import As2, As2Config, CostEstimator, Costs, gamma_zero, optimal_gamma, speedup


def brute_force(alpha: float, L: float, hi: int = 4000) -> tuple[int, float]:
    g = np.arange(1, hi + 1)
    s = speedup(alpha, L, g)
    return int(g[np.argmax(s)]), float(s.max())


def test_closed_form_matches_brute_force_maximum():
    for alpha in np.linspace(0.02, 0.99, 25):
        for L in np.geomspace(0.002, 0.99, 20):
            g, s = optimal_gamma(alpha, L, lo=1, hi=4000)
            g_bf, s_bf = brute_force(alpha, L)
            # a tie between two integers may go either way: both then have the maximal S
            assert s == pytest.approx(s_bf, rel=1e-12, abs=1e-12), (alpha, L, g, g_bf)
            assert abs(g - g_bf) <= 1


# TK-SLT Table I: gamma* for alpha x L; * marks S(gamma*) < 1, where the target alone is faster.
# At (0.4, 0.4) and (0.6, 0.6) S(1) = (1 + a) / (1 + L) is exactly 1; the paper stars one and not
# the other (rounding in its arithmetic), so a tie is accepted either way.
TABLE_I = {0.4: [4, 2, 1, 1, "1*"], 0.6: [7, 3, 2, 1, "1*"], 0.8: [14, 6, 4, 2, 1]}


@pytest.mark.parametrize("alpha", sorted(TABLE_I))
def test_paper_table_one(alpha):
    for L, want in zip((0.01, 0.1, 0.2, 0.4, 0.6), TABLE_I[alpha], strict=True):
        g, s = optimal_gamma(alpha, L)
        assert g == int(str(want).rstrip("*")), (alpha, L)
        if abs(s - 1) > 1e-9:
            assert (s < 1) == str(want).endswith("*"), (alpha, L, s)


def test_gamma_zero_is_the_stationary_point():
    for alpha, L in [(0.8, 0.1), (0.95, 0.3), (0.6, 0.05)]:
        g0 = gamma_zero(alpha, L)
        h = 1e-5
        dS = (speedup(alpha, L, g0 + h) - speedup(alpha, L, g0 - h)) / (2 * h)
        assert abs(dS) < 1e-6


def test_degenerate_inputs_and_bounds():
    assert optimal_gamma(0.0, 0.1, lo=1, hi=8)[0] == 1
    assert optimal_gamma(1.0, 0.1, lo=1, hi=8)[0] == 8  # every token accepted: as long as allowed
    assert optimal_gamma(0.9, 0.0, lo=1, hi=8)[0] == 8  # drafting is free
    assert optimal_gamma(0.9, 1.5, lo=1, hi=8)[0] == 1  # L >= 1: S falls from the start
    assert optimal_gamma(0.99, 0.001, lo=2, hi=6)[0] == 6  # clipped to the bounds
    assert optimal_gamma(0.1, 0.5, lo=3, hi=6)[0] == 3
    with pytest.raises(ValueError):
        optimal_gamma(float("nan"), 0.1)
    with pytest.raises(ValueError):
        optimal_gamma(0.5, 0.1, lo=0)


def test_estimator_recovers_costs_and_alpha():
    est = CostEstimator(prior_alpha=0.5, decay=1.0, window=64, link_weight=0.05)
    rng = np.random.default_rng(0)
    alpha = 0.8
    for _ in range(400):
        k = int(rng.integers(1, 9))
        accepted = 0
        while accepted < k and rng.random() < alpha:
            accepted += 1
        est.observe_round(k, accepted, draft_ms=15 + 20.0 * k, verify_ms=50 + 10 * (k + 1), network_ms=40 + 0.5 * k)
    c = est.costs()
    assert est.alpha == pytest.approx(alpha, abs=0.03)  # censored MLE, not accepted/drafted
    assert (c.t_draft, c.draft_0, c.verify_0, c.verify_per_token) == pytest.approx((20.0, 15.0, 50.0, 10.0))
    assert (c.net_0, c.net_per_token) == pytest.approx((40.0, 0.5), rel=0.02)
    assert c.t_fixed == pytest.approx(115.0)  # one position + the round trip + a round's drafting
    assert c.L == pytest.approx((20 + 10 + 0.5) / 115)
    assert c.rho == pytest.approx(60 / 115)


def test_estimator_slope_needs_spread():
    est = CostEstimator()
    for _ in range(10):
        est.observe_round(4, 4, 80.0, 100.0, 20.0)
    c = est.costs()
    assert c.verify_per_token == 0.0 and c.verify_0 == pytest.approx(100.0)


def test_streamed_tokens_and_pings_feed_the_estimates():
    est = CostEstimator(prior_alpha=0.9, prior_weight=1.0, decay=0.5)
    for _ in range(20):
        est.observe_streamed(0.0, 15.0, 60.0)
        est.observe_latency(300.0)
    c = est.costs()
    assert est.alpha < 0.01
    assert c.t_ar == pytest.approx(60.0) and c.net_0 == pytest.approx(300.0)
    assert c.rho == pytest.approx(60 / 360)
    for _ in range(8):  # the link recovers: the round trip follows quickly
        est.observe_latency(5.0)
    assert est.costs().net_0 < 10.0


def test_slow_link_makes_speculation_lose():
    fast = Costs(alpha=0.9, t_draft=20, draft_0=0, verify_0=50, verify_per_token=10, net_0=10, net_per_token=0)
    slow = Costs(alpha=0.9, t_draft=20, draft_0=0, verify_0=50, verify_per_token=10, net_0=800, net_per_token=0)
    for costs, wins in ((fast, True), (slow, False)):
        g, s = optimal_gamma(costs.alpha, costs.L, hi=16)
        assert (s * costs.rho > 1) == wins


def test_as2_hysteresis_and_patience():
    as2 = As2(As2Config(leave_below=1.0, return_above=1.2, patience=2, warmup=3))
    assert not as2.decide(0.5, samples=2)  # warming up
    assert not as2.decide(0.5, samples=3)  # 1 of 2
    assert as2.decide(0.5, samples=4) and not as2.speculating
    assert not as2.decide(1.1, samples=5)  # inside the band: stays off
    assert not as2.decide(1.1, samples=6)
    assert not as2.decide(1.3, samples=7)
    assert not as2.decide(1.1, samples=8)  # the run of evidence restarts
    assert not as2.decide(1.3, samples=9)
    assert as2.decide(1.3, samples=10) and as2.speculating
    with pytest.raises(ValueError):
        As2Config(leave_below=1.2, return_above=1.0)


def test_speedup_formula_is_theorem_one():
    # S(1) = (1 - a^2) / ((1 + L)(1 - a)) = (1 + a) / (1 + L)
    assert speedup(0.7, 0.2, 1) == pytest.approx(1.7 / 1.2)
    assert speedup(1.0, 0.1, 4) == pytest.approx(5 / 1.4)
    assert math.isfinite(float(speedup(0.999999, 0.1, 50)))


def test_streamed_agreement_estimates_the_acceptance_rate():
    """While the target streams alone, min(1, q(x)/p(x)) for x ~ p averages to sum_x min(p, q) = alpha."""
    from agent.decoding.streaming import _agreement
    from protocol import sampling, wire
    from protocol.sampling import SamplingParams

    rng = np.random.default_rng(0)
    params = SamplingParams(temperature=0.8)
    draft_logits = rng.normal(0, 2, 50).astype(np.float32)
    p = sampling.probs_from_logits(rng.normal(0, 2, 50), params)
    q = sampling.probs_from_logits(draft_logits, params)
    xs = rng.choice(50, size=40000, p=p)
    est = np.mean([_agreement(draft_logits, wire.Token("s", 0, int(x), False, {}, float(p[x])), params) for x in xs])
    assert est == pytest.approx(np.minimum(p, q).sum(), abs=0.01)
    greedy = SamplingParams()
    assert _agreement(draft_logits, wire.Token("s", 0, int(np.argmax(draft_logits)), False, {}, 1.0), greedy) == 1.0
    assert _agreement(draft_logits, wire.Token("s", 0, int(np.argmin(draft_logits)), False, {}, 1.0), greedy) == 0.0


def test_slopes_wait_for_eight_rounds_of_different_lengths():
    from agent.decoding.draftlen import _fit

    est = CostEstimator()
    for k in (1, 4, 2, 6, 3, 5, 2):  # 7 rounds: a slope would be guesswork
        est.observe_round(k, k, 10.0 + 20.0 * k, 50 + 10 * (k + 1), 20.0)
    assert _fit(est.verify) is None and est.costs().verify_per_token == 0.0
    est.observe_round(4, 4, 90.0, 100.0, 20.0)  # the 8th
    c = est.costs()
    assert (c.verify_0, c.verify_per_token, c.draft_0, c.t_draft) == pytest.approx((50.0, 10.0, 10.0, 20.0))


def test_fitted_lines_never_go_below_zero():
    """Pre-drafted rounds cost the loop nothing and missed ones the whole draft: an unconstrained
    line through them can have a negative intercept, which made a round look free."""
    from collections import deque

    from agent.decoding.draftlen import _fit

    pts = deque([(1, 0.0), (2, 0.0), (3, 0.0), (6, 600.0), (7, 700.0), (8, 800.0), (1, 0.0), (8, 790.0)])
    b0, b1 = _fit(pts)
    assert b0 >= 0.0 and b1 >= 0.0
    xs = np.array([p[0] for p in pts], float)
    ys = np.array([p[1] for p in pts], float)
    # no feasible line fits better (a grid over intercept and slope >= 0)
    best = min(float(np.sum((ys - a - b * xs) ** 2)) for a in np.linspace(0, 400, 81) for b in np.linspace(0, 150, 151))
    assert float(np.sum((ys - b0 - b1 * xs) ** 2)) <= best + 1e-6
    falling = deque((k, 100.0 - 10.0 * k) for k in (1, 2, 3, 4, 5, 6, 7, 8))
    assert _fit(falling) == pytest.approx((float(np.mean([p[1] for p in falling])), 0.0))


def test_a_new_link_restarts_the_per_token_network_slope():
    est = CostEstimator()
    for k in (1, 4, 2, 6, 3, 5, 2, 8, 7, 3):  # a 400 ms link, 1 ms a token
        est.observe_round(k, k, 10.0 * k, 50.0, 400.0 + k)
    assert est.costs().net_per_token == pytest.approx(1.0)
    est.observe_latency(390.0)  # the same link: the window stays
    assert est.costs().net_per_token == pytest.approx(1.0)
    est.observe_latency(12.0)  # a new link: its rounds alone make the slope
    assert not est.network and est.costs().net_per_token == 0.0
    for k in (1, 4, 2, 6, 3, 5, 2, 8):
        est.observe_round(k, k, 10.0 * k, 50.0, 12.0 + 0.5 * k)
    c = est.costs()
    assert c.net_per_token == pytest.approx(0.5) and c.net_0 < 30.0


def test_rounds_show_a_new_link_when_two_in_a_row_agree_and_a_spike_is_not_one():
    est = CostEstimator()
    ks = (1, 4, 2, 6, 3, 5, 2, 8, 7, 3)
    for k in ks:  # a 400 ms link, 1 ms a token
        est.observe_round(k, k, 10.0 * k, 50.0, 400.0 + k)
    est.observe_round(4, 4, 40.0, 50.0, 1400.0)  # one spike
    est.observe_round(3, 3, 30.0, 50.0, 403.0)  # and the link is back: the window stays, less the spike
    assert len(est.network) == 11 and (4, 1400.0) not in est.network
    assert est.round_trip == pytest.approx(400.0, abs=1.0) and est.costs().net_per_token == pytest.approx(1.0)
    est.observe_round(2, 2, 20.0, 50.0, 13.0)  # faster, then faster again: a new link
    est.observe_round(6, 6, 60.0, 50.0, 15.0)
    assert list(est.network) == [(2, 13.0), (6, 15.0)] and est.round_trip < 20.0
    for k in ks:
        est.observe_round(k, k, 10.0 * k, 50.0, 12.0 + 0.5 * k)
    c = est.costs()
    assert c.net_per_token == pytest.approx(0.5) and c.net_0 < 40.0
    for k in (2, 6):  # and slower again: the same two-round rule
        est.observe_round(k, k, 10.0 * k, 50.0, 300.0 + k)
    assert list(est.network) == [(2, 302.0), (6, 306.0)]


def test_jitter_of_a_few_ms_on_a_fast_link_is_not_a_new_link():
    est = CostEstimator()
    for i in range(40):  # loopback: 0.3 ms, with 3 ms hiccups (10x, yet the same link)
        est.observe_round(1 + i % 5, 1, 10.0, 50.0, 3.0 if i % 3 else 0.3)
        est.observe_latency(0.2 if i % 2 else 2.5)
    assert len(est.network) == 32


def test_estimates_carry_over_to_the_next_generation():
    from agent.decoding.policy import DraftController, DraftPolicy

    est, as2 = CostEstimator(), As2()
    first = DraftController(DraftPolicy("optimal"), 4, 16, estimator=est, as2=as2)
    assert first.gamma_star is None and first.plan() == 4  # nothing known yet: gamma
    for k in range(1, 11):
        first.observe(k, k % 8 + 1, k % 8 + 1, 20.0 * (k % 8 + 1), 60 + 5 * (k % 8 + 2), 5.0)
    second = DraftController(DraftPolicy("optimal"), 4, 16, estimator=est, as2=as2)
    assert second.gamma_star == first.gamma_star and second.plan() == first.gamma_star
    assert second.accepted == 0  # the running acceptance is per session
