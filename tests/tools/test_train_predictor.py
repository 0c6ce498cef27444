"""Training the rejection predictor: the exported ONNX is the trained model; the metrics mean what they say."""

import json

import numpy as np
import pytest

from agent.decoding.predictor import FEATURES, RejectionPredictor
from tools.train import predictor as tp


def synthetic(n: int, seed: int):
    """Rows whose acceptance depends on max_prob and position, like real traces do."""
    rng = np.random.default_rng(seed)
    x = np.zeros((n, len(FEATURES)), np.float32)
    x[:, 0] = rng.uniform(0, 1, n)  # max_prob
    x[:, 1] = rng.uniform(0, 5, n)  # entropy
    x[:, 2] = x[:, 0] * rng.uniform(0, 1, n)  # margin
    x[:, 3] = rng.uniform(2, 4, n)  # logit std
    x[:, 4] = rng.integers(0, 8, n)  # position
    x[:, 5] = rng.uniform(0.5, 1, n)  # running acceptance
    p = 1 / (1 + np.exp(-(6 * x[:, 0] - 0.3 * x[:, 4] - 1)))
    y = (rng.uniform(0, 1, n) < p).astype(np.int64)
    return x, y


def test_exported_onnx_gives_the_training_models_outputs(tmp_path):
    torch = pytest.importorskip("torch")
    x, y = synthetic(3000, 0)
    xv, yv = synthetic(800, 1)
    model = tp.train_mlp(x, y, xv, yv, epochs=15, seed=0, log=lambda *_: None)
    path = tmp_path / "m.onnx"
    tp.export_onnx(model, path, {"features": list(FEATURES), "threshold": "0.42", "pair": "a__b"})
    fixed = np.array(
        [[0.9, 0.3, 0.8, 3.0, 0, 0.9], [0.1, 4.0, 0.02, 2.5, 5, 0.6], [0.5, 2.0, 0.3, 3.3, 2, 0.8]], np.float32
    )
    with torch.no_grad():
        want = model(torch.tensor(fixed)).squeeze(1).numpy()
    pred = RejectionPredictor(path)
    assert pred.p_accept(fixed) == pytest.approx(want, abs=1e-6)
    assert pred.threshold == pytest.approx(0.42) and pred.meta["pair"] == "a__b"
    # raw features in (scaling is inside the graph), and it learned something
    assert tp.auc(pred.p_accept(xv), yv) > 0.75
    assert want[0] > want[1]


def test_auc_and_operating_point_metrics():
    y = np.array([1, 1, 1, 0, 0])
    assert tp.auc(np.array([0.9, 0.8, 0.7, 0.2, 0.1]), y) == 1.0
    assert tp.auc(np.array([0.1, 0.2, 0.3, 0.8, 0.9]), y) == 0.0
    m = tp.at_threshold(np.array([0.9, 0.8, 0.3, 0.6, 0.1]), y, 0.5)
    # accepted let through: 2 of 3; rejected caught: 1 of 2 (the 0.6 one slips through)
    assert m["rec1"] == pytest.approx(2 / 3) and m["spec"] == 0.5 and m["fpr"] == 0.5
    assert m["balanced_accuracy"] == pytest.approx((2 / 3 + 0.5) / 2)


def test_replay_of_traced_rounds():
    # one round: positions 0, 1 accepted, 2 the first rejection; another: 0..3 all accepted
    x = np.zeros((7, len(FEATURES)), np.float32)
    x[:, 4] = [0, 1, 2, 0, 1, 2, 3]
    y = np.array([1, 1, 0, 1, 1, 1, 1])
    rnd = np.array([0, 0, 0, 1, 1, 1, 1])
    never = tp.simulate(np.ones(7), y, x, rnd, 0.5, gamma=4, L=0.5)
    # no stop: round 0 drafts 4 (past the rejection), commits 3; round 1 drafts 4, commits 5
    assert never["tokens_per_cost"] == pytest.approx(8 / 6) and never["acceptance"] == pytest.approx(6 / 8)
    perfect = tp.simulate(y.astype(float), y, x, rnd, 0.5, gamma=4, L=0.5)
    # stop exactly at the rejection: round 0 drafts 2, commits 3
    assert perfect["tokens_per_cost"] == pytest.approx(8 / 5) and perfect["acceptance"] == 1.0


def test_split_is_by_session():
    sid = np.repeat(np.arange(20), 5)
    tr, val, te = tp.split(sid, seed=0)
    assert not (tr & val).any() and not (tr & te).any() and not (val & te).any()
    assert (tr | val | te).all()
    for part in (tr, val, te):
        assert set(sid[part]).isdisjoint(set(sid[~part]))


def test_shipped_predictors_match_this_agent():
    from agent.decoding.predictor import PREDICTORS

    shipped = sorted(PREDICTORS.glob("*.onnx"))
    assert shipped, "models/predictors should hold a trained predictor per bundled pair"
    for path in shipped:
        pred = RejectionPredictor(path)
        meta = pred.meta
        assert 0.0 < pred.threshold < 1.0
        assert float(meta["test_auc"]) > 0.6, path
        assert json.loads(meta["features"]) == list(FEATURES)
