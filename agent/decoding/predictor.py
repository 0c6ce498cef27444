"""Stop drafting at the first likely rejection (WISP's intelligent drafting controller).

Each drafted token is described by what the draft model itself shows about it
(its logits at that position) and where it stands: `FEATURES`. A small MLP,
trained offline on traces of real rounds (tools/train/predictor.py) and run
here by onnxruntime, gives the probability that the target accepts it; the
draft stops at the first token below the threshold. The stop never changes
the output (a shorter draft is still a draft), only what is drafted.

Traces (`TraceWriter`) hold one JSON line per drafted token that reached a
verdict: accepted (1), or the first rejected of its round (0). Tokens after
the first rejection are left out; the target never judged them.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import numpy as np

log = logging.getLogger(__name__)

FEATURES = ("max_prob", "entropy", "margin", "logit_std", "position", "running_acceptance")
PREDICTORS = Path(__file__).resolve().parents[2] / "models" / "predictors"


def logit_features(logits: np.ndarray) -> tuple[float, float, float, float]:
    """(max probability, entropy in nats, top-1 minus top-2 probability, logit std) of softmax(logits).

    logits: [vocab]. Always at temperature 1: the model's own uncertainty, whatever the sampling.
    Whole-vocabulary passes only (max, exp, dot, sum), no sort: ~0.1 ms for 49,152 float32 logits.
    """
    z = np.asarray(logits, dtype=np.float32)
    top = int(np.argmax(z))
    m = float(z[top])
    d = z - m  # <= 0
    e = np.exp(d)
    s = float(e.sum())
    # H = -sum p ln p = ln s - sum p (z - m)
    entropy = float(np.log(s) - np.dot(e, d) / s)
    e[top] = 0.0
    p1 = 1.0 / s
    p2 = float(e.max()) / s
    mean = float(d.mean())
    std = float(np.sqrt(max(0.0, float(np.dot(d, d)) / d.size - mean * mean)))
    return p1, max(0.0, entropy), p1 - p2, std


def running_acceptance(accepted: int, rejected: int) -> float:
    """The session's acceptance so far, smoothed (Laplace) so the first round has a value."""
    return (accepted + 1.0) / (accepted + rejected + 2.0)


def feature_row(logits: np.ndarray, position: int, accepted: int, rejected: int) -> np.ndarray:
    """One predictor input [len(FEATURES)] float32."""
    return np.array([*logit_features(logits), position, running_acceptance(accepted, rejected)], np.float32)


def predictor_path(draft: str, target: str) -> Path:
    return PREDICTORS / f"{draft}__{target}.onnx"


class RejectionPredictor:
    """An ONNX model: features [n, 6] float32 -> p_accept [n, 1], loaded once, one thread."""

    def __init__(self, path: str | Path, threshold: float | None = None):
        import onnxruntime as ort

        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"no rejection predictor at {self.path} (train one with tools/train/predictor.py)")
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = 1
        opts.inter_op_num_threads = 1
        opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        self.session = ort.InferenceSession(str(self.path), opts, providers=["CPUExecutionProvider"])
        meta = self.session.get_modelmeta().custom_metadata_map
        features = tuple(json.loads(meta.get("features", "[]")))
        if features != FEATURES:
            raise ValueError(f"{self.path} was trained on features {features}, this agent computes {FEATURES}")
        self.input = self.session.get_inputs()[0].name
        self.meta = meta
        self.threshold = float(meta.get("threshold", 0.5)) if threshold is None else float(threshold)
        if not 0.0 <= self.threshold <= 1.0:
            raise ValueError(f"predictor threshold must be in [0, 1], got {self.threshold}")
        self.calls = 0
        self.ms = 0.0

    def p_accept(self, features: np.ndarray) -> np.ndarray:
        """features [n, 6] float32 -> [n] probabilities that the target accepts each token."""
        x = np.ascontiguousarray(features, dtype=np.float32).reshape(-1, len(FEATURES))
        p: np.ndarray = self.session.run(None, {self.input: x})[0].reshape(-1)
        return p

    def should_stop(self, features: np.ndarray) -> bool:
        """True when this token is a predicted rejection (do not draft it)."""
        t0 = time.perf_counter()
        p = float(self.p_accept(features)[0])
        self.ms += (time.perf_counter() - t0) * 1e3
        self.calls += 1
        return not p >= self.threshold  # a NaN output stops too: the safe side


class TraceWriter:
    """Appends labelled feature rows, one JSON object per line, flushed every round."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.file = self.path.open("a", encoding="utf-8")
        self.rows = 0

    def round(self, pair: str, session: str, number: int, features: list[np.ndarray], accepted: int) -> None:
        """features: one row per drafted token of the round; `accepted` of them were accepted."""
        judged = features[: accepted + 1]  # the accepted ones and the first rejected, if any
        for pos, row in enumerate(judged):
            rec = {"pair": pair, "session": session, "round": number, "label": int(pos < accepted)}
            rec.update({name: round(float(v), 6) for name, v in zip(FEATURES, row, strict=True)})
            self.file.write(json.dumps(rec) + "\n")
            self.rows += 1
        self.file.flush()

    def close(self) -> None:
        self.file.close()
