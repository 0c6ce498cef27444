"""The verification-time estimator: features as the padded engine runs a batch, fitting, calibration."""

import json
import math

import numpy as np
import pytest

from server_bridge.estimator import (
    Passes,
    VerifyTimeModel,
    batch_memory_bytes,
    bootstrap_ci,
    features,
    fit,
    mape,
    pass_ms,
    passes_ms,
    r2,
    split_passes,
)
from tools.bench.sched_decision import old_split_passes as exhaustive_split  # before issue 51, verbatim

TRUE = np.array([2.5, 4e-5, 8e-3, 35.0])  # a, b_c, b_r, c (ms)


def synthetic(n, rng, noise_ms=0.5):
    """Batches of cold, warm and mixed members like the profiler's grid, timed by TRUE plus noise."""
    x = []
    for _ in range(n):
        rows = int(rng.integers(1, 17))
        kind = rng.choice(["cold", "warm", "mixed"])
        members = []
        for r in range(rows):
            cold = kind == "cold" or (kind == "mixed" and r == 0)
            members.append(
                (0, int(rng.integers(16, 400))) if cold else (int(rng.integers(16, 1200)), int(rng.integers(1, 9)))
            )
        x.append(features(members))
    x = np.array(x)
    return x, x @ TRUE + rng.normal(0, noise_ms, n)


def test_a_single_member_gives_wisps_sums():
    # cached 100, new 5: 5 tokens through the linear layers, 105 * 5 interactions, 100 cached read
    assert features([(100, 5)]).tolist() == [5, 525, 100, 1]


def test_a_batch_is_counted_as_the_padded_rectangle_it_runs_as():
    # rows pad to the longest cache (300) and the longest run (40): 2 rows of 40 new over 340 keys
    assert features([(300, 5), (0, 40)]).tolist() == [80, 2 * 340 * 40, 600, 1]
    # equal shapes: the same as WISP's sums
    assert features([(50, 4)] * 3).tolist() == [12, 3 * 54 * 4, 150, 1]


def test_least_squares_recovers_known_coefficients():
    rng = np.random.default_rng(1)
    x, y = synthetic(400, rng)
    coef = fit(x, y)
    np.testing.assert_allclose(coef, TRUE, rtol=0.05)
    xt, yt = synthetic(200, rng)
    pred = xt @ coef
    assert r2(yt, pred) > 0.999
    assert mape(yt, pred) < 2.0


def test_bootstrap_intervals_cover_the_truth():
    rng = np.random.default_rng(2)
    x, y = synthetic(300, rng, noise_ms=2.0)
    ci = bootstrap_ci(x, y, n=300, level=0.99, rng=rng)
    assert ci.shape == (4, 2)
    assert np.all(ci[:, 0] <= TRUE) and np.all(TRUE <= ci[:, 1])
    assert np.all(ci[:, 0] < ci[:, 1])


def test_fit_never_returns_a_negative_cost():
    rng = np.random.default_rng(3)
    x, y = synthetic(100, rng)
    y = y - 2e-3 * x[:, 2] * 5  # make the cached term's true cost negative: it must be dropped, not kept
    coef = fit(x, y)
    assert np.all(coef >= 0)
    with pytest.raises(ValueError, match="fit needs"):
        fit(x[:, :3], y)


def test_online_scale_tracks_a_slower_machine_within_bounds():
    model = VerifyTimeModel(a=1.0, b_c=0.0, b_r=0.0, c=10.0)
    members = [(100, 5)]
    assert model.predict_ms(members) == pytest.approx(15.0)
    for _ in range(60):
        model.observe(members, 30.0)  # this machine is twice as slow
    assert model.predict_ms(members) == pytest.approx(30.0, rel=0.02)
    for _ in range(60):
        model.observe(members, 1e6)  # a stall is clipped, not believed
    assert model.scale == pytest.approx(4.0, rel=0.01)


def test_save_and_load_round_trip(tmp_path):
    model = VerifyTimeModel(a=1.5, b_c=1e-5, b_r=2e-3, c=30.0, target="smollm2-f32", fitted=True, report={"r2": 0.99})
    path = tmp_path / "est.json"
    model.save(path)
    back = VerifyTimeModel.load(path)
    assert (back.a, back.b_c, back.b_r, back.c, back.target, back.fitted) == (
        1.5,
        1e-5,
        2e-3,
        30.0,
        "smollm2-f32",
        True,
    )
    path.write_text(json.dumps({"a": 1.0, "c": "fast"}))
    with pytest.raises(ValueError, match=r"\['b_c', 'b_r', 'c'\]"):
        VerifyTimeModel.load(path)


def test_memory_of_a_padded_batch():
    # 2 rows x (300 + 40) positions of KV, logits for min(new, 17) rows each
    assert (
        batch_memory_bytes([(300, 5), (0, 40)], kv_bytes_per_token=100, logits_row_bytes=10)
        == 2 * 340 * 100 + (5 + 17) * 10
    )
    assert batch_memory_bytes([], 100, 10) == 0


def test_a_long_prefill_gets_a_pass_of_its_own_when_that_is_cheaper():
    model = VerifyTimeModel(a=3.0, b_c=0.0, b_r=0.0, c=130.0)
    warm, cold = (80, 5), (0, 40)
    # together: 4 rows padded to 40 = 130 + 480 ms; apart: (130 + 45) + (130 + 120) ms
    assert split_passes([warm, cold, warm, warm], model) == [[0, 2, 3], [1]]
    assert model.batch_ms([warm, cold, warm, warm]) == pytest.approx(175 + 250)
    # drafts alone share one pass: the fixed cost dominates
    assert split_passes([warm, (80, 3), warm], model) == [[1, 0, 2]]
    assert model.batch_ms([warm]) == model.predict_ms([warm])
    assert split_passes([], model) == []


def random_members(rng, n):
    """Drafts on warm caches, cold prompts, and shapes with many equal keys (ties)."""
    kind = rng.integers(3)
    if kind == 0:  # a fleet: drafts of 2-9 tokens over 200-4000 cached, now and then a prompt
        return [
            (int(rng.integers(200, 4000)), int(rng.integers(2, 10)))
            if rng.random() > 0.1
            else (0, int(rng.integers(32, 600)))
            for _ in range(n)
        ]
    high_cached, high_new = [(5, 3), (50, 20), (3000, 500)][kind - 1]
    return [(int(rng.integers(0, high_cached + 1)), int(rng.integers(1, high_new + 1))) for _ in range(n)]


def random_model(rng):
    """A 7B-on-an-H200 shape, the CPU default, integer coefficients (exact ties), or anything non-negative."""
    pick = rng.integers(4)
    if pick == 0:
        return VerifyTimeModel(a=0.05, b_c=1e-7, b_r=2e-5, c=12.0)
    if pick == 1:
        return VerifyTimeModel()
    if pick == 2:
        return VerifyTimeModel(
            a=float(rng.integers(0, 4)), b_c=0.0, b_r=float(rng.choice([0, 0.5, 1])), c=float(rng.integers(0, 20))
        )
    return VerifyTimeModel(
        a=rng.uniform(0, 5),
        b_c=rng.uniform(0, 1e-3),
        b_r=rng.uniform(0, 1e-2),
        c=rng.uniform(0, 200),
        scale=rng.uniform(0.25, 4),
    )


def test_the_split_is_the_exhaustive_dynamic_programmes_on_random_batches():
    # the same passes (ties included: the smallest start wins, as before) and so the same batch_ms to the last bit
    rng = np.random.default_rng(51)
    for _ in range(1000):
        members, model = random_members(rng, int(rng.integers(0, 28))), random_model(rng)
        assert split_passes(members, model) == exhaustive_split(members, model), (members, model)


def test_the_split_of_hundreds_of_members_is_still_the_dynamic_programmes():
    # past the reference's reach, the same programme with the pass's shape kept as it goes (O(n^2), no lists)
    rng = np.random.default_rng(52)
    for n in (120, 300, 300, 600):
        members, model = random_members(rng, n), random_model(rng)
        order = sorted(range(n), key=lambda i: (members[i][1], members[i][0]))
        best, cut = [0.0] + [math.inf] * n, [0] * (n + 1)
        for j in range(1, n + 1):
            top = 0
            for i in range(j - 1, -1, -1):  # downwards: the cache maximum of i..j-1 as it goes
                top = max(top, members[order[i]][0])
                t = best[i] + pass_ms(model, j - i, top, members[order[j - 1]][1])
                if t <= best[j]:  # downwards, so on a tie the smaller start
                    best[j], cut[j] = t, i
        groups, j = [], n
        while j > 0:
            groups.append(order[cut[j] : j])
            j = cut[j]
        assert split_passes(members, model) == groups[::-1]
        assert model.batch_ms(members) == best[n]


def test_passes_bound_batch_ms_from_both_sides_as_members_join():
    rng = np.random.default_rng(53)
    for _ in range(200):
        members, model = random_members(rng, int(rng.integers(1, 60))), random_model(rng)
        exact = Passes.best(members, model)
        assert exact.ms == model.batch_ms(members) and exact.floor <= exact.ms
        cheap = Passes.cheap(np.array(members, dtype=np.int64), model)  # one pass or two
        assert cheap.floor <= model.batch_ms(members) <= cheap.ms
        for passes in (exact, cheap):
            grown = list(members)
            for member in random_members(rng, int(rng.integers(1, 20))):
                grown.append(member)
                passes.add(member)
                assert passes.floor <= model.batch_ms(grown) <= passes.ms


def test_a_pass_is_priced_from_its_shape_as_from_its_members():
    rng = np.random.default_rng(54)
    for _ in range(100):
        model, members = random_model(rng), random_members(rng, int(rng.integers(1, 9)))
        assert model.member_ms(members[0]) == model.predict_ms(members[:1])
        shape = len(members), max(m[0] for m in members), max(m[1] for m in members)
        assert pass_ms(model, *shape) == model.predict_ms(members)
        assert passes_ms(model, *(np.array([x]) for x in shape))[0] == model.predict_ms(members)


def test_a_negative_cost_is_refused():
    with pytest.raises(ValueError, match="must be >= 0"):
        VerifyTimeModel(a=1.0, b_c=-1e-6, b_r=0.0, c=10.0)
    with pytest.raises(ValueError, match="scale > 0"):
        VerifyTimeModel(scale=0.0)


def test_a_packed_engine_pays_for_its_members_as_they_are_in_one_pass():
    # llama.cpp packs a batch's tokens: WISP's own sums, no padding; a split would save nothing
    packed = VerifyTimeModel(a=1.0, b_c=1e-3, b_r=1e-2, c=10.0, packed=True)
    members = [(300, 5), (0, 40), (120, 5)]
    assert features(members, packed=True).tolist() == [50, 305 * 5 + 40 * 40 + 125 * 5, 420, 1]
    assert split_passes(members, packed) == [[0, 1, 2]]
    assert split_passes([], packed) == []
    assert packed.batch_ms(members) == packed.predict_ms(members) == 50 + 3.75 + 4.2 + 10
    padded = VerifyTimeModel(a=1.0, b_c=1e-3, b_r=1e-2, c=10.0)
    assert len(split_passes(members, padded)) > 1  # the same batch, padded, runs its prefill apart
    # its memory: the logits rows only (the KV goes into the engine's own cache)
    assert batch_memory_bytes(members, 100, 10, packed=True) == (5 + 17 + 5) * 10


def test_packed_is_saved_with_the_coefficients(tmp_path):
    path = tmp_path / "est.json"
    VerifyTimeModel(a=1.0, b_c=0.0, b_r=0.0, c=2.0, packed=True).save(path)
    assert VerifyTimeModel.load(path).packed
    VerifyTimeModel(a=1.0, b_c=0.0, b_r=0.0, c=2.0).save(path)
    assert not VerifyTimeModel.load(path).packed
