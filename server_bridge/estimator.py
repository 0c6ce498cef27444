"""How long a batched verification pass takes: WISP's estimator (Eq. 19), fitted to this machine.

    T(B) = a * N_linear + b_c * N_interactions + b_r * N_cached + c          [ms]

A batch is a list of members (L_cached, L_new): the tokens a session already
has in its KV cache and the tokens the pass appends (its uncached committed
ids and its draft). WISP sums over members: N_linear = sum L_new (tokens
through the linear layers), N_interactions = sum L_total * L_new (query-key
products, L_total = L_cached + L_new), N_cached = sum L_cached (KV read).

This engine pads a batch to a rectangle (server_bridge.target: every row's
cache left-padded to the longest cache, its new tokens right-padded to the
longest run), and a padded row costs what a real one does on a CPU. So each
sum is taken over the batch *as it runs*: B rows of L_new = max L_new and
L_cached = max L_cached. For a batch of one, or of equal shapes, that is
WISP's sum exactly; for a cold prompt beside warm drafts it charges the
warm rows the padding they really pay, which is what the scheduler must see.

A long run of new tokens (a prompt's prefill) pads every other row of its
pass to its length, so the batcher may run a chosen batch as a few passes
instead of one: `split_passes` groups the members, by their number of new
tokens, into the passes whose estimated times sum least, and the scheduler
prices a batch by that sum (`VerifyTimeModel.batch_ms`).

Pure: the scheduler calls it in the event loop, several times for every token
of a stream, so pricing a batch is plain float arithmetic (a few microseconds
less each time than numpy); `server-bridge profile` (ops/profile.py) fits it with numpy and
writes the coefficients the server loads.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

Member = tuple[int, int]  # (L_cached, L_new) of one session in a batch
TERMS = ("a", "b_c", "b_r", "c")  # coefficient names, in the order of features()' columns


def features(members: Sequence[Member]) -> np.ndarray:
    """[4] (N_linear, N_interactions, N_cached, 1) of one batch as the padded engine runs it."""
    return np.array(_terms(members), dtype=np.float64)


def _terms(members: Sequence[Member]) -> tuple[int, int, int, int]:
    """features() as a tuple of ints."""
    if not members:
        return 0, 0, 0, 1
    rows = len(members)
    cached = max(m[0] for m in members)
    new = max(m[1] for m in members)
    return rows * new, rows * (cached + new) * new, rows * cached, 1


def batch_memory_bytes(
    members: Sequence[Member], kv_bytes_per_token: int, logits_row_bytes: int, max_rows: int = 17
) -> int:
    """Peak extra memory of one padded pass: the batch's KV [B, max L_cached + max L_new] and its logits.

    A member gets logits for at most `max_rows` positions (its draft and the bonus row; a prefill none).
    """
    if not members:
        return 0
    width = max(m[0] for m in members) + max(m[1] for m in members)
    rows = sum(min(m[1], max_rows) for m in members)
    return len(members) * width * kv_bytes_per_token + rows * logits_row_bytes


@dataclass
class VerifyTimeModel:
    """T(B) in milliseconds; `scale` is the online correction (measured / predicted, smoothed)."""

    a: float = 4.0  # ms per new token (linear layers)
    b_c: float = 2e-5  # ms per query-key interaction (attention)
    b_r: float = 5e-3  # ms per cached token read
    c: float = 40.0  # ms per pass (fixed overheads: the LM head's weights, dispatch)
    target: str = ""  # what it was fitted on
    device: str = ""
    fitted: bool = False  # False: the defaults above, a rough guess for the f32 SmolLM2 on 2 cores
    report: dict = field(default_factory=dict)  # the profiler's R2, MAPE, confidence intervals
    scale: float = 1.0
    smoothing: float = 0.1  # weight of one new measurement in `scale`

    def predict_ms(self, members: Sequence[Member]) -> float:
        """scale * max(0, features(members) @ (a, b_c, b_r, c)), without numpy (see the module's note)."""
        n_linear, n_interactions, n_cached, one = _terms(members)
        return self.scale * max(0.0, self.a * n_linear + self.b_c * n_interactions + self.b_r * n_cached + self.c * one)

    def batch_ms(self, members: Sequence[Member]) -> float:
        """A whole batch, run as split_passes groups it: the sum of its passes' estimates."""
        return sum(self.predict_ms([members[i] for i in group]) for group in split_passes(members, self))

    def observe(self, members: Sequence[Member], measured_ms: float) -> None:
        """Track this machine's drift from the fitted model (load, another CPU): a bounded EWMA of the ratio."""
        raw = self.predict_ms(members) / self.scale
        if raw > 0 and math.isfinite(measured_ms) and measured_ms > 0:
            ratio = min(4.0, max(0.25, measured_ms / raw))
            self.scale += self.smoothing * (ratio - self.scale)

    def save(self, path: str | Path) -> None:
        d = {k: v for k, v in asdict(self).items() if k not in ("scale", "smoothing")}
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(d, indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> "VerifyTimeModel":
        d = json.loads(Path(path).read_text())
        missing = [t for t in TERMS if not isinstance(d.get(t), (int, float))]
        if missing:
            raise ValueError(f"{path}: estimator coefficients {missing} missing or not numbers")
        known = {k: d[k] for k in ("a", "b_c", "b_r", "c", "target", "device", "report") if k in d}
        return cls(**known, fitted=True)


def split_passes(members: Sequence[Member], model: "VerifyTimeModel") -> list[list[int]]:
    """Indices of members grouped into passes, shortest runs of new tokens first, least estimated time.

    Groups are contiguous in the order of L_new (a pass pads to its longest run,
    so a member never gains from sharing a pass with a longer one while a shorter
    one waits for a later pass). Dynamic programme over that order: best[j] =
    min over i < j of best[i] + T(members i..j-1).
    """
    order = sorted(range(len(members)), key=lambda i: (members[i][1], members[i][0]))
    n = len(order)
    best = [0.0] + [math.inf] * n
    cut = [0] * (n + 1)
    for j in range(1, n + 1):
        for i in range(j):
            t = best[i] + model.predict_ms([members[k] for k in order[i:j]])
            if t < best[j]:
                best[j], cut[j] = t, i
    groups, j = [], n
    while j > 0:
        groups.append(order[cut[j] : j])
        j = cut[j]
    return groups[::-1]


# ----------------------------------------------------------------------------- fitting (the profiler's)


def fit(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with non-negative coefficients: x [n, 4] from features(), y [n] ms -> [4].

    A term whose plain least-squares coefficient comes out negative (collinear
    with the others on the profiled grid) is dropped and the rest refitted: a
    negative cost would let the scheduler believe a bigger batch is cheaper.
    """
    x = np.asarray(x, dtype=np.float64)
    y = np.asarray(y, dtype=np.float64)
    if x.ndim != 2 or x.shape[1] != len(TERMS) or y.shape != (x.shape[0],):
        raise ValueError(f"fit needs x [n, {len(TERMS)}] and y [n], got {x.shape} and {y.shape}")
    active = list(range(x.shape[1]))
    while True:
        coef = np.zeros(x.shape[1])
        sol, *_ = np.linalg.lstsq(x[:, active], y, rcond=None)
        coef[active] = sol
        neg = [i for i in active if coef[i] < 0]
        if not neg:
            return coef
        active.remove(min(neg, key=lambda i: coef[i]))


def r2(y: np.ndarray, pred: np.ndarray) -> float:
    ss_res = float(np.sum((y - pred) ** 2))
    ss_tot = float(np.sum((y - np.mean(y)) ** 2))
    return 1.0 - ss_res / ss_tot if ss_tot > 0 else float("nan")


def mape(y: np.ndarray, pred: np.ndarray) -> float:
    """Mean absolute percentage error, in percent."""
    return float(np.mean(np.abs(pred - y) / np.abs(y)) * 100)


def bootstrap_ci(
    x: np.ndarray, y: np.ndarray, n: int = 1000, level: float = 0.95, rng: np.random.Generator | None = None
) -> np.ndarray:
    """[4, 2] percentile intervals of each coefficient over n resamples of the rows."""
    rng = rng or np.random.default_rng(0)
    draws = np.array([fit(x[idx], y[idx]) for idx in (rng.integers(0, len(y), len(y)) for _ in range(n))])
    lo = (1 - level) / 2
    return np.quantile(draws, [lo, 1 - lo], axis=0).T
