"""server_bridge.ops.planner (`server-bridge plan`, its report in tools/bench/planner.py): the pipelined-SD latency
model, the closed-form bandwidth split and the batching DP.

No models: synthetic devices and linear stage-time models. Exhaustive searches
evaluate every schedule through the latency model (Eqs. 20-22) directly and are
compared with the DPs, which never build a whole schedule.
"""

import itertools
import json
from functools import lru_cache

import numpy as np
import pytest
from scipy.optimize import minimize

from server_bridge import cli
from server_bridge.ops import planner as P
from tools.bench import planner as planner_report

LINEAR = P.LinearVerifyModel(a=0.05, b_c=1e-4, b_r=0.01, c=10.0)
SHARED = P.Drafting(shared=True, runtime=P.LLAMA_68M_DRAFT)


def device(draft=5.0, alpha=0.8, bits=1000.0, prefix=100, se=2.0, out=12, prefill=0.0) -> P.Device:
    return P.Device(
        draft_ms_per_token=draft,
        alpha=alpha,
        uplink_bits_per_token=bits,
        prefix_tokens=prefix,
        spectral_efficiency=se,
        output_tokens=out,
        prefill_ms_per_token=prefill,
    )


def random_problem(rng, n: int, shared: bool = False, padded: bool = True, gammas=(1, 2, 4)) -> P.Problem:
    devs = tuple(
        device(
            draft=rng.uniform(2, 30),
            alpha=rng.uniform(0.5, 0.95),
            prefix=int(rng.integers(16, 600)),
            se=rng.uniform(1, 8),
            out=int(rng.integers(4, 24)),
            prefill=rng.uniform(0, 1),
        )
        for _ in range(n)
    )
    verify = P.LinearVerifyModel(
        a=rng.uniform(0.01, 1), b_c=rng.uniform(0, 1e-3), b_r=rng.uniform(0, 0.02), c=rng.uniform(1, 40)
    )
    return P.Problem(devs, 1e6, verify, SHARED if shared else P.ON_DEVICE, padded=padded, gammas=gammas)


# ---------------------------------------------------------------- exhaustive search through the latency model


def t_inf(problem: P.Problem, batches, gammas, stages) -> float:
    cols = [stages(tuple(b), g) for b, g in zip(batches, gammas, strict=True)]
    return P.pipeline_ms(np.stack([c[0] for c in cols], 1), np.stack([c[1] for c in cols], 1), problem.drafting.shared)


def stage_cache(problem: P.Problem, horizon: int):
    return lru_cache(maxsize=None)(lambda members, g: problem.stages(list(members), g, horizon))


def compositions(order):
    """Every split of `order` into consecutive non-empty batches."""
    for cuts in itertools.product((False, True), repeat=len(order) - 1):
        batches, cur = [], [order[0]]
        for cut, k in zip(cuts, order[1:], strict=True):
            if cut:
                batches.append(tuple(cur))
                cur = []
            cur.append(k)
        yield batches + [tuple(cur)]


def set_partitions(items):
    if not items:
        yield []
        return
    for p in set_partitions(items[1:]):
        for i in range(len(p)):
            yield p[:i] + [(items[0],) + p[i]] + p[i + 1 :]
        yield [(items[0],)] + p


def ordered_partitions(n):
    for p in set_partitions(list(range(n))):
        yield from itertools.permutations(p)


def exhaustive(problem: P.Problem, schedules, per_batch_gamma: bool = False) -> float:
    horizon = problem.horizon(problem.gammas)
    stages = stage_cache(problem, horizon)
    best = np.inf
    for batches in schedules:
        if not all(problem.feasible(b) for b in batches):
            continue
        choices = (
            itertools.product(problem.gammas, repeat=len(batches))
            if per_batch_gamma
            else ([g] * len(batches) for g in problem.gammas)
        )
        best = min([best] + [t_inf(problem, batches, gs, stages) for gs in choices])
    return best


# ---------------------------------------------------------------- Eq. 7, Eq. 8


@pytest.mark.parametrize("alpha,gamma", [(0.8, 4), (0.5, 2), (0.95, 8), (0.3, 1)])
def test_expected_tokens_matches_speculative_sampling_monte_carlo(alpha, gamma):
    """Draft from q, accept with min(1, p/q) until the first rejection, add the bonus token."""
    rng = np.random.default_rng(0)
    q = np.concatenate([rng.dirichlet(np.ones(4)), np.zeros(4)])  # draft: tokens 0-3
    r = np.concatenate([np.zeros(4), rng.dirichlet(np.ones(4))])  # 4-7, where the draft never goes
    p = alpha * q + (1 - alpha) * r  # target: sum_x min(p, q) = alpha
    vocab = len(q)
    acc_rate = np.minimum(p, q).sum()
    assert acc_rate == pytest.approx(alpha)
    rounds = 200_000
    x = rng.choice(vocab, size=(rounds, gamma), p=q)  # [R, gamma] drafts
    accept = rng.random((rounds, gamma)) < np.minimum(1.0, p[x] / q[x])
    committed = np.cumprod(accept, axis=1).sum(1) + 1  # accepted prefix + bonus
    want = P.expected_tokens(acc_rate, gamma)
    assert committed.mean() == pytest.approx(want, abs=4 * committed.std() / np.sqrt(rounds))
    assert want == pytest.approx(sum(acc_rate**i for i in range(gamma + 1)))


def test_expected_tokens_limits():
    assert P.expected_tokens(1.0, 5) == 6.0  # every draft accepted + bonus
    assert P.expected_tokens(0.0, 5) == 1.0  # only the correction token
    assert P.expected_tokens(0.7, 0) == 1.0  # gamma = 0 is autoregressive
    assert P.expected_tokens(0.9999999, 3) == pytest.approx(4.0, rel=1e-6)
    np.testing.assert_allclose(P.expected_tokens([0.5, 0.8], 2), [1.75, 2.44])


def test_decoding_steps_is_the_ceiling_of_output_over_tokens_per_round():
    assert P.decoding_steps(10, 0.5, 1) == 7  # L = 1.5: ceil(6.67)
    assert P.decoding_steps(12, 0.0, 3) == 12
    assert P.decoding_steps(12, 1.0, 3) == 3  # L = 4 exactly: no spurious extra step


# ---------------------------------------------------------------- Eqs. 26-27


def _numeric_min_max(bits, se, total):
    """min_w max_k bits_k / (w_k B s_k) s.t. sum w = 1, by SLSQP on the epigraph (w, t) in scaled units."""
    scale = bits / (se * total)  # T_k = scale_k / w_k
    n = len(bits)
    x0 = np.append(np.full(n, 1 / n), scale.max() * n)
    cons = [{"type": "eq", "fun": lambda x: x[:n].sum() - 1}, {"type": "ineq", "fun": lambda x: x[n] * x[:n] - scale}]
    res = minimize(
        lambda x: x[n],
        x0,
        constraints=cons,
        bounds=[(1e-9, 1)] * n + [(0, None)],
        method="SLSQP",
        options={"ftol": 1e-12, "maxiter": 500},
    )
    assert res.success, res.message
    return res.x[n], res.x[:n] * total


@pytest.mark.parametrize("seed", range(6))
def test_bandwidth_split_matches_numeric_optimum(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(2, 7))
    bits = rng.uniform(1e4, 1e7, n)
    se = rng.uniform(0.5, 10, n)
    total = 20e6
    w = P.bandwidth_split(bits, se, total)
    assert w.sum() == pytest.approx(total) and np.all(w > 0)
    t = P.upload_ms(bits, se, w)
    np.testing.assert_allclose(t, t[0], rtol=1e-9)  # everyone arrives together
    t_num, w_num = _numeric_min_max(bits, se, total)
    assert t.max() / 1e3 == pytest.approx(t_num, rel=1e-5)
    np.testing.assert_allclose(w, w_num, rtol=1e-3)
    assert t.max() <= P.upload_ms(bits, se, np.full(n, total / n)).max() + 1e-9


def test_bandwidth_split_beats_every_point_of_a_fine_grid():
    bits, se, total = np.array([3e6, 1e6, 2e6]), np.array([1.0, 4.0, 2.5]), 10e6
    best = P.upload_ms(bits, se, P.bandwidth_split(bits, se, total)).max()
    g = np.linspace(0.001, 0.998, 700)
    w1, w2 = np.meshgrid(g, g)
    w3 = 1 - w1 - w2
    ok = w3 > 0
    grid = np.stack([w1[ok], w2[ok], w3[ok]], 1) * total  # [points, 3]
    worst = (1e3 * bits / (grid * se)).max(1)
    assert best <= worst.min() + 1e-9
    assert worst.min() == pytest.approx(best, rel=5e-3)


def test_bandwidth_split_gives_nothing_to_a_device_with_nothing_to_send():
    w = P.bandwidth_split([0.0, 1e6, 1e6], [1.0, 1.0, 3.0], 4e6)
    assert w[0] == 0 and w.sum() == pytest.approx(4e6) and w[1] == pytest.approx(3 * w[2])
    np.testing.assert_allclose(P.bandwidth_split([0.0, 0.0], [1.0, 2.0], 4e6), [2e6, 2e6])


@pytest.mark.parametrize(
    "bits,se,total,match",
    [
        ([1.0, 2.0], [1.0], 1e6, "same shape"),
        ([1.0, -2.0], [1.0, 1.0], 1e6, ">= 0"),
        ([1.0, np.nan], [1.0, 1.0], 1e6, "finite"),
        ([[1.0, 2.0]], [[1.0, 1.0]], 1e6, "1-D"),
        ([], [], 1e6, "non-empty"),
        ([1.0, 2.0], [1.0, 0.0], 1e6, "spectral_efficiency must be > 0"),
        ([1.0, 2.0], [1.0, 1.0], 0.0, "total_hz"),
        ([1.0, 2.0], [1.0, 1.0], float("nan"), "total_hz"),
    ],
)
def test_bandwidth_split_rejects_bad_inputs(bits, se, total, match):
    with pytest.raises(ValueError, match=match):
        P.bandwidth_split(bits, se, total)


# ---------------------------------------------------------------- Eqs. 13-14, 17-20: the latency model


def test_pipeline_recursion_by_hand():
    """One step, three batches: draft 1, 4, 4 ms; verify 1 ms each (Eq. 20)."""
    draft, verify = np.array([[1.0, 4.0, 4.0]]), np.array([[1.0, 1.0, 1.0]])
    assert P.pipeline_ms(draft, verify, shared_drafter=True) == 10.0  # C^d = 1, 5, 9 -> C = 2, 6, 10
    assert P.pipeline_ms(draft, verify, shared_drafter=False) == 6.0  # ready 1, 4, 4 -> C = 2, 5, 6
    assert P.pipeline_ms(draft, verify, True, pipelined=False) == 12.0  # (1+1) + (4+1) + (4+1)
    # steps add up (Eq. 22), and a finished batch (zeros) changes nothing
    two = P.pipeline_ms(np.vstack([draft, [[1.0, 0.0, 4.0]]]), np.vstack([verify, [[1.0, 0.0, 1.0]]]), True)
    assert two == 10.0 + P.pipeline_ms(np.array([[1.0, 4.0]]), np.array([[1.0, 1.0]]), True)
    with pytest.raises(ValueError, match=r"\[steps, batches\]"):
        P.pipeline_ms(draft, verify[:, :2], True)


def test_stage_times_follow_the_papers_flops_law():
    """Eqs. 13, 14, 17-19 written out for a padded batch of two at l = 3."""
    v, d = P.LLAMA_7B_VERIFY, P.LLAMA_68M_DRAFT
    devs = [device(prefix=120, alpha=0.8, out=20), device(prefix=200, alpha=0.8, out=20)]
    l, b, i_m = 3, 2, 200
    big_l = (1 - 0.8 ** (l + 1)) / (1 - 0.8)
    t_draft, t_verify = P.batch_stage_ms(devs, [0, 1], l, 10, v, P.Drafting(True, d), padded=True)

    def fv(n):  # Eq. 14
        if n == 1:
            return 4 * v.layers * v.hidden * (i_m + l) * (2 * v.hidden + i_m + l + v.ffn)
        kv = i_m + (n - 1) * big_l - 1
        return 4 * v.layers * v.hidden * (1 + l) * (2 * v.hidden + kv + l + 1 + v.ffn)

    def fd(i, n):  # Eq. 13
        if n == 1 and i == 1:
            return 4 * d.layers * d.hidden * i_m * (2 * d.hidden + i_m + d.ffn)
        kv = i_m + ((n - 1) * big_l - 1) + i - 1
        return 4 * d.layers * d.hidden * (2 * d.hidden + kv + 1 + d.ffn)

    n_m = int(np.ceil(20 / big_l))
    for n in range(1, n_m + 1):
        assert t_verify[n - 1] == pytest.approx(1e3 * (v.c1 * fv(n) * b + v.c2))  # Eq. 18
        assert t_draft[n - 1] == pytest.approx(1e3 * sum(d.c1 * fd(i, n) * b + d.c2 for i in range(1, l + 1)))
    assert not t_verify[n_m:].any() and not t_draft[n_m:].any()  # done after n_m = ceil(O/L) steps


def test_on_device_drafting_waits_for_the_slowest_robot_and_drops_finished_ones():
    fast = device(draft=2.0, alpha=0.9, out=6, prefix=50, prefill=1.0)  # L(4) = 4.10: 2 steps
    slow = device(draft=10.0, alpha=0.5, out=6, prefix=80)  # L(4) = 1.94: 4 steps
    t_draft, t_verify = P.batch_stage_ms([fast, slow], [0, 1], 4, 5, LINEAR, P.ON_DEVICE, padded=False)
    np.testing.assert_allclose(t_draft, [max(8 + 50, 40), 40, 40, 40, 0])
    # the verifier sees WISP's sums over the members still running
    kv_fast2 = 50 + P.expected_tokens(0.9, 4) - 1
    assert t_verify[1] == pytest.approx(LINEAR(np.array([5.0, 5.0]), np.array([kv_fast2, 80 + 1.9375 - 1])))
    kv_slow3 = 80 + 2 * P.expected_tokens(0.5, 4) - 1
    assert t_verify[2] == pytest.approx(LINEAR(np.array([5.0]), np.array([kv_slow3])))
    assert t_verify[4] == 0.0


def test_padding_charges_every_row_the_widest_one():
    a, b = device(prefix=100), device(prefix=400)
    padded = P.batch_stage_ms([a, b], [0, 1], 2, 8, LINEAR, padded=True)[1]
    ragged = P.batch_stage_ms([a, b], [0, 1], 2, 8, LINEAR, padded=False)[1]
    assert padded[0] == pytest.approx(LINEAR(np.array([402.0, 402.0]), np.zeros(2)))
    assert np.all(padded >= ragged) and padded[0] > ragged[0]


def test_kv_budget_from_memory_inverts_eqs_9_and_10():
    m = P.LLAMA_68M_DRAFT
    weights = m.layers * (8 * m.hidden**2 + 4 * m.hidden * m.ffn)
    budget = P.kv_budget_tokens(weights + 4 * m.layers * m.hidden * 1000, m.layers, m.hidden, m.ffn)
    assert budget == pytest.approx(1000)


# ---------------------------------------------------------------- the DP


# Seeds 20, 29, 53, 59 (and 108-138 below) are instances where a DP keeping one label per state
# (Algorithm 1's rule) is not optimal: they fail if the Pareto sets are cut to one label.
@pytest.mark.parametrize("seed", [0, 1, 2, 3, 20, 29, 53, 59])
def test_consecutive_dp_equals_exhaustive_search_over_the_papers_space(seed):
    rng = np.random.default_rng(seed)
    problem = random_problem(rng, n=int(rng.integers(2, 6)), shared=seed % 2 == 0, padded=seed % 3 != 1)
    order = P.paper_order(problem.devices)
    sol = min((P.plan_consecutive(problem, [g]) for g in problem.gammas), key=lambda s: s.t_inf_ms)
    assert sol.exact
    assert sol.t_inf_ms == pytest.approx(exhaustive(problem, list(compositions(order))), rel=1e-9)
    # ... and the schedule it returns really has that latency
    assert P.evaluate(problem, sol.batches, sol.gammas).t_inf_ms == pytest.approx(sol.t_inf_ms, rel=1e-12)
    # the published Algorithm 1 never does better than the exact DP over its own space
    for g in problem.gammas:
        assert P.paper_algorithm1(problem, g).t_inf_ms >= P.plan_consecutive(problem, [g]).t_inf_ms - 1e-9


@pytest.mark.parametrize("seed,n", [(100, 5), (108, 4), (112, 4), (136, 4), (138, 4)])
def test_plan_equals_exhaustive_search_over_every_partition_and_gamma(seed, n):
    rng = np.random.default_rng(seed)
    problem = random_problem(rng, n=n, shared=seed % 2 == 1, gammas=(1, 3) if n == 5 else (1, 2, 4))
    p = P.plan(problem)
    assert p.label == "dp (all partitions)" and p.exact
    assert p.t_inf_ms == pytest.approx(exhaustive(problem, ordered_partitions(n)), rel=1e-9)
    assert p.t_inf_ms <= P.plan(problem, search="consecutive").t_inf_ms + 1e-9
    assert sorted(k for b in p.batches for k in b) == list(range(n))


@pytest.mark.parametrize("seed", range(4))
def test_per_batch_gamma_equals_exhaustive_search(seed):
    rng = np.random.default_rng(200 + seed)
    n = 3
    problem = random_problem(rng, n=n, shared=seed % 2 == 0, gammas=(1, 2, 3))
    p = P.plan(problem, per_batch_gamma=True)
    assert p.t_inf_ms == pytest.approx(exhaustive(problem, ordered_partitions(n), per_batch_gamma=True), rel=1e-9)
    assert p.t_inf_ms <= P.plan(problem).t_inf_ms + 1e-9
    cons = P.plan_consecutive(problem, problem.gammas)
    order = P.paper_order(problem.devices)
    assert cons.t_inf_ms == pytest.approx(exhaustive(problem, list(compositions(order)), per_batch_gamma=True))


def test_plan_is_the_closed_form_split_plus_the_dp_schedule():
    rng = np.random.default_rng(7)
    problem = random_problem(rng, n=4)
    p = P.plan(problem)
    bits = [d.uplink_bits for d in problem.devices]
    se = [d.spectral_efficiency for d in problem.devices]
    np.testing.assert_allclose(p.bandwidth_hz, P.bandwidth_split(bits, se, problem.total_bandwidth_hz))
    assert p.t_com_ms == pytest.approx(
        sum(b / s for b, s in zip(bits, se, strict=True)) / problem.total_bandwidth_hz * 1e3
    )
    assert p.total_ms == pytest.approx(p.t_com_ms + p.t_inf_ms)
    assert p.tokens_per_s == pytest.approx(sum(d.output_tokens for d in problem.devices) / p.total_ms * 1e3)
    assert p.steps == max(P.decoding_steps(d.output_tokens, d.alpha, p.gammas[0]) for d in problem.devices)


def test_slow_robot_goes_last_which_the_papers_order_cannot_do():
    """Same prompts, one slow drafter: verify the fast robots while it drafts, then it alone."""
    slow, fast = device(draft=30.0), device(draft=5.0)
    problem = P.Problem((slow, fast, fast), 1e6, LINEAR, gammas=(2,))
    p = P.plan(problem)
    assert p.batches == ((1, 2), (0,))
    assert p.t_inf_ms < P.plan(problem, search="consecutive").t_inf_ms


def test_published_algorithm1_can_miss_the_optimum():
    """Keeping one label per prefix (least sum_n C_n) loses a prefix that pipelines better later."""
    devs = (
        device(draft=2.0, prefix=200, out=12),
        device(draft=20.0, prefix=800, out=4),
        device(draft=5.0, prefix=100, out=8),
    )
    problem = P.Problem(devs, 1e6, P.LinearVerifyModel(a=0.05, b_c=0.0, b_r=0.01, c=2.0), gammas=(1,))
    greedy, exact = P.paper_algorithm1(problem, 1), P.plan_consecutive(problem, [1])
    assert greedy.batches == [(2, 0), (1,)] and exact.batches == [(2,), (0,), (1,)]
    assert greedy.t_inf_ms > exact.t_inf_ms + 0.5


def test_kv_budget_is_never_exceeded():
    devs = tuple(device(prefix=100, out=20) for _ in range(4))  # 120 KV tokens each, padded
    problem = P.Problem(devs, 1e6, LINEAR, kv_budget_tokens=250, gammas=(2,))
    for p in (P.plan(problem), P.plan(problem, search="consecutive")):
        assert all(len(b) <= 2 for b in p.batches)
    with pytest.raises(ValueError, match="budget"):
        P.Problem(devs, 1e6, LINEAR, kv_budget_tokens=100)


# ---------------------------------------------------------------- bad inputs


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"alpha": 1.5}, "alpha"),
        ({"alpha": float("nan")}, "finite"),
        ({"prefix": 0}, "prefix_tokens"),
        ({"se": 0.0}, "spectral_efficiency"),
        ({"draft": -1.0}, ">= 0"),
        ({"bits": float("inf")}, "finite"),
    ],
)
def test_device_rejects_bad_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        device(**kwargs)


def test_other_bad_inputs_say_what_is_wrong():
    with pytest.raises(ValueError, match=r"alpha must be in \[0, 1\]"):
        P.expected_tokens(1.2, 3)
    with pytest.raises(ValueError, match="gamma must be a non-negative integer"):
        P.expected_tokens(0.5, 2.5)
    with pytest.raises(ValueError, match="at least one device"):
        P.Problem((), 1e6)
    with pytest.raises(ValueError, match="total_bandwidth_hz"):
        P.Problem((device(),), -1.0)
    problem = P.Problem((device(), device()), 1e6, LINEAR, gammas=(1,))
    with pytest.raises(ValueError, match="partition"):
        P.evaluate(problem, [(0,), (0, 1)], [1, 1])
    with pytest.raises(ValueError, match="gammas"):
        P.evaluate(problem, [(0, 1)], [1, 2])
    with pytest.raises(ValueError, match="search"):
        P.plan(problem, search="greedy")
    with pytest.raises(ValueError, match=">= 0"):
        P.LinearVerifyModel(a=-1.0, b_c=0.0, b_r=0.0, c=1.0)


def test_estimator_json_is_loaded_and_checked(tmp_path):
    good = tmp_path / "est.json"
    good.write_text(json.dumps({"a": 1.0, "b_c": 2e-5, "b_r": 3e-3, "c": 20.0, "target": "t", "device": "cpu"}))
    m = P.LinearVerifyModel.load(good)
    assert (m.a, m.b_c, m.b_r, m.c) == (1.0, 2e-5, 3e-3, 20.0)
    assert m(np.array([[2.0, 3.0]]), np.array([[10.0, 0.0]])) == pytest.approx(
        1.0 * 5 + 2e-5 * (12 * 2 + 3 * 3) + 3e-3 * 10 + 20.0
    )
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"a": 1.0, "b_c": 2e-5, "c": 20.0}))
    with pytest.raises(ValueError, match="b_r"):
        P.LinearVerifyModel.load(bad)


# ---------------------------------------------------------------- the CLI


def test_cli_writes_json_markdown_and_png(tmp_path, capsys):
    est = tmp_path / "est.json"
    est.write_text(json.dumps({"a": 0.05, "b_c": 3e-5, "b_r": 0.005, "c": 15.0}))
    out = tmp_path / "report" / "planner"
    assert (
        planner_report.main(
            [
                "--devices",
                "3",
                "--gamma-max",
                "3",
                "--fixed-gamma",
                "2",
                "--output-tokens",
                "16",
                "--estimator",
                str(est),
                "--out",
                str(out),
            ]
        )
        == 0
    )
    printed = capsys.readouterr().out
    assert "| dp (all partitions) |" in printed and "paper Algorithm 1" in printed
    report = json.loads(out.with_suffix(".json").read_text())
    assert report["config"]["verify_model"]["c"] == 15.0
    plans = {p["label"]: p for p in report["plans"]}
    dp = report["plans"][0]
    assert dp["label"] == "dp (all partitions)" and dp["exact"]
    for name in (
        "dp (consecutive)",
        "paper Algorithm 1",
        "dp, equal bandwidth",
        "dp, no pipeline",
        "one batch, gamma=2",
        "one device per batch",
    ):
        assert dp["total_ms"] <= plans[name]["total_ms"] + 1e-9, name
    assert plans["dp, equal bandwidth"]["t_com_ms"] >= dp["t_com_ms"]
    assert sum(dp["bandwidth_hz"]) == pytest.approx(20e6)
    md = out.with_suffix(".md").read_text()
    assert "| scheme |" in md and "planner.png" in md
    assert out.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_refuses_a_wrong_number_of_alphas(tmp_path):
    with pytest.raises(SystemExit, match="alpha needs 1 or 3 values"):
        planner_report.main(["--devices", "3", "--alpha", "0.8,0.7", "--out", str(tmp_path / "p")])


def test_stage_times_refuse_an_empty_or_unknown_batch():
    with pytest.raises(ValueError, match="members"):
        P.batch_stage_ms([device()], [], 2, 4, LINEAR)
    with pytest.raises(ValueError, match="members"):
        P.batch_stage_ms([device()], [3], 2, 4, LINEAR)
    with pytest.raises(ValueError, match="horizon"):
        P.batch_stage_ms([device(out=40)], [0], 1, 2, LINEAR)


# ---------------------------------------------------------------- `server-bridge plan`


def test_plan_prints_the_dp_plan_for_example_robots(capsys):
    assert cli.main(["plan", "--devices", "3", "--gamma-max", "3", "--output-tokens", "16"]) == 0
    out = capsys.readouterr().out
    assert "3 robots" in out and "dp (all partitions)" in out and "batch 0: robots" in out
    assert out.count("MHz of uplink") == 3


def test_plan_for_the_operators_fleet_as_json_is_the_planners_optimum(tmp_path, capsys):
    fleet = tmp_path / "robots.json"
    robots = [
        {"draft_ms_per_token": 4.0, "alpha": 0.9, "prefix_tokens": 120, "output_tokens": 12},
        {"draft_ms_per_token": 30.0, "alpha": 0.6, "prefix_tokens": 40, "spectral_efficiency": 2.0},
    ]
    fleet.write_text(json.dumps({"robots": robots}))
    est = tmp_path / "est.json"
    est.write_text(json.dumps({"a": 0.05, "b_c": 3e-5, "b_r": 0.005, "c": 15.0}))
    argv = ["plan", "--fleet", str(fleet), "--estimator", str(est), "--gamma-max", "4", "--output-tokens", "20"]
    assert cli.main([*argv, "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert [r["draft_ms_per_token"] for r in got["robots"]] == [4.0, 30.0]
    assert [r["output_tokens"] for r in got["robots"]] == [12, 20]  # the file's, else --output-tokens
    assert got["robots"][0]["spectral_efficiency"] == 5.0 and got["robots"][1]["spectral_efficiency"] == 2.0
    problem = P.Problem(
        tuple(P.Device(**r) for r in got["robots"]), 20e6, P.LinearVerifyModel.load(est), gammas=(1, 2, 3, 4)
    )
    best = P.plan(problem)
    assert got["plan"]["total_ms"] == pytest.approx(best.total_ms)
    assert [tuple(b) for b in got["plan"]["batches"]] == list(best.batches)
    assert str(est) in got["verify_model"]


@pytest.mark.parametrize(
    "content, match",
    [
        ("{not json", "not JSON"),
        ("[]", "a list of 1-64 robots"),
        (json.dumps([{"alpha": 0.5}]), "robot 0 must be an object with draft_ms_per_token"),
        (json.dumps([{"draft_ms_per_token": 1, "alpha": 0.5, "prefix_tokens": 9, "colour": "red"}]), "only Device"),
        (json.dumps([{"draft_ms_per_token": 1, "alpha": 1.5, "prefix_tokens": 9}]), r"robot 0: Device.alpha"),
        (json.dumps([{"draft_ms_per_token": 1, "alpha": 0.5, "prefix_tokens": 9}] * 65), "1-64 robots"),
        (" " * (P.MAX_FLEET_BYTES + 1), "too big for a fleet file"),
    ],
)
def test_a_bad_fleet_file_is_one_line_and_exit_2(tmp_path, capsys, content, match):
    fleet = tmp_path / "robots.json"
    fleet.write_text(content)
    assert cli.main(["plan", "--fleet", str(fleet)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("server-bridge plan: ") and len(err.splitlines()) == 1
    assert __import__("re").search(match, err)


def test_plan_refuses_bad_flags_in_one_line(capsys):
    assert cli.main(["plan", "--devices", "3", "--alpha", "0.8,0.7"]) == 2
    assert "alpha needs 1 or 3 values" in capsys.readouterr().err
    assert cli.main(["plan", "--gamma-max", "0"]) == 2
    assert cli.main(["plan", "--fleet", "/nonexistent/robots.json"]) == 1
    assert "No such file" in capsys.readouterr().err
