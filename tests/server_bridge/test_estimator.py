"""The verification-time estimator: features as the padded engine runs a batch, fitting, calibration."""

import json

import numpy as np
import pytest

from server_bridge.estimator import (
    VerifyTimeModel,
    batch_memory_bytes,
    bootstrap_ci,
    features,
    fit,
    mape,
    r2,
    split_passes,
)

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
