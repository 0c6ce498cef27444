"""The rejection predictor on the robot: features, the ONNX session, the stop rule and traces."""

import json

import numpy as np
import pytest

from agent.decoding.policy import DraftController, DraftPolicy
from agent.decoding.predictor import FEATURES, RejectionPredictor, TraceWriter, feature_row, logit_features
from protocol.sampling import SamplingParams


def position_model(path, stop_from: float, features=FEATURES, threshold: float = 0.5):
    """A real ONNX graph: p_accept = sigmoid(10 * (stop_from - 0.5 - position)), whatever the logits say."""
    import onnx
    from onnx import TensorProto, helper

    w = np.zeros((len(FEATURES), 1), np.float32)
    w[FEATURES.index("position"), 0] = -10.0
    b = np.array([10.0 * (stop_from - 0.5)], np.float32)
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["features", "w"], ["z0"]),
            helper.make_node("Add", ["z0", "b"], ["z"]),
            helper.make_node("Sigmoid", ["z"], ["p_accept"]),
        ],
        "position_model",
        [helper.make_tensor_value_info("features", TensorProto.FLOAT, ["n", len(FEATURES)])],
        [helper.make_tensor_value_info("p_accept", TensorProto.FLOAT, ["n", 1])],
        [
            helper.make_tensor("w", TensorProto.FLOAT, w.shape, w.ravel()),
            helper.make_tensor("b", TensorProto.FLOAT, b.shape, b),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    for k, v in {"features": json.dumps(list(features)), "threshold": str(threshold)}.items():
        entry = model.metadata_props.add()
        entry.key, entry.value = k, v
    onnx.save(model, str(path))
    return path


def test_logit_features_match_their_definitions():
    rng = np.random.default_rng(0)
    logits = rng.normal(0, 3, 1000).astype(np.float32)
    p = np.exp(logits.astype(np.float64) - logits.max())
    p /= p.sum()
    top = np.sort(p)[::-1]
    max_prob, entropy, margin, std = logit_features(logits)
    assert max_prob == pytest.approx(top[0], rel=1e-5)
    assert entropy == pytest.approx(-(p * np.log(p)).sum(), rel=1e-4)
    assert margin == pytest.approx(top[0] - top[1], rel=1e-4)
    assert std == pytest.approx(logits.std(), rel=1e-5)
    # a one-hot distribution: certain, no entropy
    peaked = np.full(100, -1e4, np.float32)
    peaked[7] = 0.0
    assert logit_features(peaked)[:3] == pytest.approx((1.0, 0.0, 1.0), abs=1e-6)
    row = feature_row(logits, 3, accepted=8, rejected=1)
    assert row.dtype == np.float32 and row.shape == (len(FEATURES),)
    assert row[4] == 3 and row[5] == pytest.approx(9 / 11)


def test_predictor_session_threshold_and_bad_inputs(tmp_path):
    pred = RejectionPredictor(position_model(tmp_path / "p.onnx", stop_from=2, threshold=0.3))
    assert pred.threshold == pytest.approx(0.3)
    rows = np.zeros((4, len(FEATURES)), np.float32)
    rows[:, 4] = [0, 1, 2, 3]
    p = pred.p_accept(rows)
    assert p.shape == (4,) and (p[:2] > 0.99).all() and (p[2:] < 0.01).all()
    assert [pred.should_stop(r) for r in rows] == [False, False, True, True]
    assert pred.calls == 4 and pred.ms > 0
    nan_row = rows[0].copy()
    nan_row[0] = np.nan  # NaN in, NaN out: stop, the safe side
    assert pred.should_stop(nan_row)
    assert RejectionPredictor(tmp_path / "p.onnx", threshold=0.9).threshold == 0.9
    with pytest.raises(FileNotFoundError):
        RejectionPredictor(tmp_path / "missing.onnx")
    with pytest.raises(ValueError, match="features"):
        RejectionPredictor(position_model(tmp_path / "other.onnx", 2, features=("max_prob",) * 6))
    with pytest.raises(ValueError):
        RejectionPredictor(tmp_path / "p.onnx", threshold=1.5)


def test_trace_keeps_accepted_tokens_and_the_first_rejection(tmp_path):
    trace = TraceWriter(tmp_path / "t.jsonl")
    rows = [np.full(len(FEATURES), i, np.float32) for i in range(5)]
    trace.round("d->t", "s1", 0, rows, accepted=2)  # positions 0, 1 accepted; 2 rejected; 3, 4 never judged
    trace.round("d->t", "s1", 1, rows[:3], accepted=3)  # all accepted
    trace.close()
    lines = [json.loads(x) for x in (tmp_path / "t.jsonl").read_text().splitlines()]
    assert [(x["round"], x["position"], x["label"]) for x in lines] == [
        (0, 0, 1),
        (0, 1, 1),
        (0, 2, 0),
        (1, 0, 1),
        (1, 1, 1),
        (1, 2, 1),
    ]
    assert set(FEATURES) <= set(lines[0])


@pytest.mark.real
@pytest.mark.parametrize(
    "stop_from,min_len,gamma,want",
    [
        (2, 1, 6, 2),  # stops at the first predicted rejection
        (2, 4, 6, 4),  # ... but never before min_len
        (5, 1, 3, 3),  # ... and never past gamma
        (0, 1, 6, 1),  # every token predicted rejected: min_len still drafts one
        (0, 0, 6, 0),  # min_len 0 allows an empty draft (the round is then one target step)
    ],
)
def test_stop_rule_respects_min_and_max(drafter, tmp_path, stop_from, min_len, gamma, want):
    pred = RejectionPredictor(position_model(tmp_path / "p.onnx", stop_from))
    ctl = DraftController(DraftPolicy("predictor", min_len=min_len), gamma, server_limit=16, predictor=pred)
    ids = drafter.tokenize("Go to the kitchen and stop.", chat=True)
    draft = drafter.propose(ids, ctl.plan(), SamplingParams(), np.random.default_rng(0), watch=ctl.watch())
    assert len(draft.ids) == want
    full = drafter.propose(ids, gamma, SamplingParams(), np.random.default_rng(0))
    assert draft.ids == full.ids[:want]  # stopping early never changes what was drafted
    ctl.observe(0, len(draft.ids), len(draft.ids), draft.ms, 50.0, 5.0)
    assert ctl.stops == int(want < gamma)


def test_policy_validation():
    with pytest.raises(ValueError):
        DraftPolicy("sometimes")
    with pytest.raises(ValueError):
        DraftPolicy("fixed", min_len=5, max_len=2)
    with pytest.raises(ValueError, match="predictor"):
        DraftController(DraftPolicy("predictor"), 4, 16, predictor=None)
    ctl = DraftController(DraftPolicy("optimal"), 4, server_limit=16)
    assert ctl.max_len == 16 and ctl.plan() == 4  # gamma until estimates exist
    ctl = DraftController(DraftPolicy("fixed"), 20, server_limit=16)
    assert ctl.plan() == 16  # the server's limit wins
