"""What the uplink carries of the draft's distributions: the payload modes.

  none   greedy: token ids only (q is a point mass at the argmax)
  full   q for every drafted position, fp16 [k, V]: the plain distributed-SD baseline
  topk   TK-SLT: the draft samples from its top-K renormalized distribution and
         sends those K ids and fp16 probabilities per position; verifying
         against that sparse q is exact, it is the distribution drawn from
  split  DSSD: only q(x_i) of each drafted token (fixed point, 3 bytes); on a
         rejection at j the server sends p_j down and the robot draws the
         correction from norm(max(0, p_j - q_j)) with the q_j it kept

The robot draws with `draw` (one position) and collects the rows in a
`DraftQ`; the server turns the received payload back into q with `dense_q`
(full, topk) or `split_qx` (split), refusing anything malformed before any
model work. Pure numpy, imported by the agent: no torch, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from . import sampling
from .sampling import SamplingError, SamplingParams

KINDS = ("none", "full", "topk", "split")
DEFAULT_KIND = "topk"  # 256 ids and probabilities a token: ~6 KB a round up, against ~393 KB full
MAX_TOPK = 4096  # the largest K a session may declare
DEFAULT_TOPK = 256  # the smallest K of docs/payload.md within 2 % of full's acceptance at T 0.7
# and 1.0 for both pairs (worst: Q4_1 at T 1.0, 1.7 %; K = 16 there: 8.3 %)
MASS_TOLERANCE = 0.01  # a q row must sum to 1 within this (fp16 rounding of 49k entries is < 0.2 %)


@dataclass(frozen=True)
class PayloadSpec:
    """A session's payload mode, declared in `open`; every `verify` of it must match."""

    kind: str = DEFAULT_KIND
    k: int = DEFAULT_TOPK  # topk: ids per position; always 0 for the other kinds

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"payload must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if self.kind != "topk":
            object.__setattr__(self, "k", 0)
        elif not isinstance(self.k, int) or not 1 <= self.k <= MAX_TOPK:
            raise ValueError(f"topk needs 1 <= k <= {MAX_TOPK}, got {self.k!r}")

    @classmethod
    def parse(cls, kind: str, k: int = DEFAULT_TOPK) -> "PayloadSpec":
        """From the CLI / config: `k` is kept for topk and ignored otherwise."""
        return cls(kind, k)

    def for_params(self, params: SamplingParams) -> "PayloadSpec":
        """Greedy decoding has nothing to send but ids: every mode is `none` at temperature 0."""
        return PayloadSpec("none") if params.greedy else self

    def to_wire(self) -> dict[str, Any]:
        return {"kind": self.kind, "k": self.k}

    def __str__(self) -> str:
        return f"topk(K={self.k})" if self.kind == "topk" else self.kind


# --------------------------------------------------------------------------- the robot's side


def draw(
    logits: np.ndarray,
    params: SamplingParams,
    spec: PayloadSpec,
    rng: np.random.Generator,
    mask: np.ndarray | None = None,
) -> tuple[int, np.ndarray | None, object]:
    """One drafted token at one position: (token, q [V] float64 it was drawn from, the row to send).

    The row is spec-specific: full an fp16 [V] table, topk (ids int32 [K], fp16 [K]),
    split the fixed-point counts [V] (only the drawn token's count travels).
    Greedy (or `none`): the argmax, no q, no row. mask [V] bool: q restricted to it (a grammar's
    allowed tokens; greedy callers pass the masked argmax's logits instead, see Drafter.propose).
    """
    if params.greedy or spec.kind == "none":
        return int(np.argmax(logits if mask is None else np.where(mask, logits, -np.inf))), None, None
    probs = sampling.probs_from_logits(np.asarray(logits)[None], params, None if mask is None else mask[None])[0]
    if spec.kind == "full":
        q16, q = sampling.quantize_q(probs[None])
        return sampling.sample(q[0], rng), q[0], q16[0]
    if spec.kind == "topk":
        k = min(spec.k, len(probs))
        ids = np.argpartition(probs, -k)[-k:].astype(np.int32)
        top16, top = sampling.quantize_q((probs[ids] / probs[ids].sum())[None])  # renormalized over the K
        q = np.zeros_like(probs)
        q[ids] = top[0]
        return int(ids[sampling.sample(top[0], rng)]), q, (ids, top16[0])
    counts = sampling.fixed_point(probs)
    return sampling.sample_fixed(counts, rng), counts / sampling.SPLIT_ONE, counts


@dataclass
class DraftQ:
    """The draft distributions of one draft, as its payload mode sends them.

    full: probs fp16 [k, V]; topk: ids int32 [k, K] and probs fp16 [k, K];
    split: counts int64 [k, V] kept on the robot, px (the drawn tokens' counts) sent.
    """

    kind: str
    probs: np.ndarray | None = None
    ids: np.ndarray | None = None
    counts: np.ndarray | None = None
    px: np.ndarray | None = None

    @classmethod
    def stack(cls, kind: str, tokens: list[int], rows: list[Any]) -> "DraftQ | None":
        if kind == "none" or not rows:
            return None
        if kind == "full":
            return cls(kind, probs=np.stack(rows))
        if kind == "topk":
            return cls(kind, ids=np.stack([r[0] for r in rows]), probs=np.stack([r[1] for r in rows]))
        counts = np.stack(rows)
        return cls(kind, counts=counts, px=counts[np.arange(len(tokens)), tokens])

    def head(self, n: int) -> "DraftQ":
        def cut(a: np.ndarray | None) -> np.ndarray | None:
            return None if a is None else a[:n]

        return DraftQ(self.kind, cut(self.probs), cut(self.ids), cut(self.counts), cut(self.px))

    def to_wire(self) -> dict[str, Any]:
        """Verify.q for these rows."""
        if self.kind == "full":
            return {"kind": "full", "probs": self.probs}
        if self.kind == "topk":
            return {"kind": "topk", "ids": self.ids, "probs": self.probs}
        return {"kind": "split", "px": self.px}

    def row(self, j: int) -> np.ndarray:
        """Split: q_j [V] float64, the whole row the robot drew from (its residual needs it)."""
        if self.counts is None:
            raise ValueError(f"row() is for split drafts, not {self.kind}")
        q: np.ndarray = self.counts[j] / sampling.SPLIT_ONE
        return q


def correction(
    residual_logits: np.ndarray,
    residual_ids: np.ndarray | None,
    q_row: np.ndarray,
    params: SamplingParams,
    rng: np.random.Generator,
) -> int:
    """Split, after a rejection: draw the correction from norm(max(0, p_j - q_j)).

    p_j is rebuilt from the target's float32 logits with the server's own code
    (`probs_from_logits`), so it is the distribution the server judged by. Sparse
    logits (`residual_ids`, sent when the session samples with top_k or top_p) stand
    for a p_j that is zero elsewhere.
    """
    p = target_probs(residual_logits, residual_ids, len(q_row), params)
    return sampling.sample(sampling.residual(p, q_row), rng)


def target_probs(logits: np.ndarray, ids: np.ndarray | None, vocab: int, params: SamplingParams) -> np.ndarray:
    """The target's p_j [V] from the residual's logits (dense [V], or sparse at `ids`)."""
    if ids is None:
        if len(logits) != vocab:
            raise SamplingError(f"residual logits cover {len(logits)} tokens, the vocabulary has {vocab}")
        p: np.ndarray = sampling.probs_from_logits(logits[None], params)[0]
        return p
    if len(ids) != len(logits) or not len(ids) or ids.min() < 0 or ids.max() >= vocab:
        raise SamplingError("sparse residual ids and logits differ in length or leave the vocabulary")
    p = np.zeros(vocab)
    # the ids are p_j's whole support (top-k, top-p and a mask already applied on the server): a plain softmax
    # over their logits is p_j renormalised there, which is p_j itself
    p[ids] = sampling.probs_from_logits(logits[None], SamplingParams(params.temperature, 0, params.seed, 1.0))[0]
    return p


def sparse_residual(
    logits: np.ndarray, p: np.ndarray, params: SamplingParams, masked: bool = False
) -> tuple[np.ndarray | None, np.ndarray]:
    """What the server sends down for p_j (logits [V] float32, p [V] = p_j): (ids, logits) of p_j's
    support when the session samples with top_k or top_p or under a grammar's mask (p_j is zero elsewhere,
    so nothing is lost), else (None, all V logits). Under top_p the support must travel: the robot
    recomputing the nucleus from dense logits could round its edge differently from the server's p_j."""
    logits = np.asarray(logits, dtype=np.float32)
    if masked or 0 < params.top_k < len(logits) or params.top_p < 1.0:
        ids = np.flatnonzero(p).astype(np.int32)
        return ids, logits[ids]
    return None, logits


# --------------------------------------------------------------------------- the server's side


def dense_q(q: dict[str, Any], draft_ids: list[int], vocab: int, spec: PayloadSpec) -> np.ndarray:
    """Verify.q of a full or topk payload -> float64 q [k, V]; SamplingError names what is wrong."""
    _check_kind(q, spec)
    k = len(draft_ids)
    if spec.kind == "full":
        probs = q["probs"]
        if probs.shape[1] != vocab:
            raise SamplingError(f"q has vocabulary {probs.shape[1]}, the target has {vocab}")
        _check_rows(probs)
        out = sampling.dequantize_q(probs)
    else:
        ids, probs = q["ids"], q["probs"]
        if ids.shape[1] != spec.k:
            raise SamplingError(f"topk payload has K={ids.shape[1]} ids per position, the session declared K={spec.k}")
        if ids.size and (ids.min() < 0 or ids.max() >= vocab):
            raise SamplingError(
                f"topk ids must lie in the vocabulary [0, {vocab}), got {int(ids.min())}..{int(ids.max())}"
            )
        if any(len(np.unique(row)) != len(row) for row in ids):
            raise SamplingError("topk ids repeat within a position")
        _check_rows(probs)
        sparse = sampling.dequantize_q(probs)
        out = np.zeros((k, vocab))
        np.put_along_axis(out, ids.astype(np.int64), sparse, axis=1)
    drafted = out[np.arange(k), draft_ids]
    if np.any(drafted <= 0):
        i = int(np.flatnonzero(drafted <= 0)[0])
        raise SamplingError(f"draft token {draft_ids[i]} at position {i} has zero probability under its own q")
    return out


def split_qx(q: dict[str, Any], draft_ids: list[int], spec: PayloadSpec) -> np.ndarray:
    """Verify.q of a split payload -> q(x_i) [k] float64, each in (0, 1]."""
    _check_kind(q, spec)
    px = np.asarray(q["px"], dtype=np.int64)
    if len(px) != len(draft_ids):
        raise SamplingError(f"split payload has {len(px)} probabilities for {len(draft_ids)} draft tokens")
    if px.size and (px.min() <= 0 or px.max() > sampling.SPLIT_ONE):
        raise SamplingError(
            f"split q(x) must be in (0, 1] (counts 1..{sampling.SPLIT_ONE}), got counts "
            f"{int(px.min())}..{int(px.max())}"
        )
    return px / sampling.SPLIT_ONE


def _check_kind(q: dict[str, Any], spec: PayloadSpec) -> None:
    if q["kind"] != spec.kind:
        raise SamplingError(f"this session declared payload {spec.kind!r} at open, the round sent {q['kind']!r}")


def _check_rows(probs16: np.ndarray) -> None:
    """Every row finite, non-negative and summing to 1 (within fp16 rounding)."""
    p = np.asarray(probs16, dtype=np.float64)
    if not np.all(np.isfinite(p)):
        raise SamplingError("q holds NaN or infinity")
    if np.any(p < 0):
        raise SamplingError("q holds a negative probability")
    mass = p.sum(axis=-1)
    bad = np.flatnonzero(np.abs(mass - 1.0) > MASS_TOLERANCE)
    if bad.size:
        raise SamplingError(
            f"q at position {int(bad[0])} sums to {mass[bad[0]]:.4f}, not 1 (tolerance {MASS_TOLERANCE})"
        )
