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

An engine that packs a batch's tokens instead (llama.cpp: each token with its
own sequence and position, no padding) pays for its rows as they are, so
there each sum is WISP's own, over the members as they are
(`VerifyTimeModel.packed`, set from the engine's `packed`), and a batch
runs as one pass: a split would save no padding and cost each extra pass
the server's own work around it (the batcher's hop to the model thread,
the pass's checks, its replies' wake-ups), which a fleet of small passes
multiplies (issue 51: a chosen batch of 35 split into ten).

A long run of new tokens (a prompt's prefill) pads every other row of its
pass to its length, so the batcher may run a chosen batch as a few passes
instead of one: `split_passes` groups the members, by their number of new
tokens, into the passes whose estimated times sum least, and the scheduler
prices a batch by that sum (`VerifyTimeModel.batch_ms`). It does so in
O(n log n + n S) for n members (S: the passes' distinct padded caches in
play at once, a few), so pricing a batch of 1,024 stays under the event
loop's millisecond budget where the plain dynamic programme took seconds.

Pure: the scheduler calls it in the event loop, for every dispatch, so pricing
a batch is plain float arithmetic (a few microseconds less each time than
numpy); `server-bridge profile` (ops/profile.py) fits it with numpy and writes
the coefficients the server loads.
"""

from __future__ import annotations

import bisect
import json
import math
from collections import deque
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

Member = tuple[int, int]  # (L_cached, L_new) of one session in a batch
TERMS = ("a", "b_c", "b_r", "c")  # coefficient names, in the order of features()' columns


def features(members: Sequence[Member], packed: bool = False) -> np.ndarray:
    """[4] (N_linear, N_interactions, N_cached, 1) of one batch as the engine runs it: padded to a rectangle,
    or packed (each member as it is)."""
    return np.array(_terms(members, packed), dtype=np.float64)


def _terms(members: Sequence[Member], packed: bool = False) -> tuple[int, int, int, int]:
    """features() as a tuple of ints."""
    if not members:
        return 0, 0, 0, 1
    if packed:
        return (
            sum(new for _, new in members),
            sum((cached + new) * new for cached, new in members),
            sum(cached for cached, _ in members),
            1,
        )
    rows = len(members)
    cached = max(m[0] for m in members)
    new = max(m[1] for m in members)
    return rows * new, rows * (cached + new) * new, rows * cached, 1


def batch_memory_bytes(
    members: Sequence[Member], kv_bytes_per_token: int, logits_row_bytes: int, max_rows: int = 17, packed: bool = False
) -> int:
    """Peak extra memory of one padded pass: the batch's KV [B, max L_cached + max L_new] and its logits.

    A member gets logits for at most `max_rows` positions (its draft and the bonus row; a prefill none).
    packed: the engine writes the pass's KV into its own preallocated cache (llama.cpp), so only the logits.
    """
    if not members:
        return 0
    rows = sum(min(m[1], max_rows) for m in members)
    if packed:
        return rows * logits_row_bytes
    width = max(m[0] for m in members) + max(m[1] for m in members)
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
    packed: bool = False  # the engine packs a batch's tokens (llama.cpp): no padding, and a batch is one pass
    scale: float = 1.0
    smoothing: float = 0.1  # weight of one new measurement in `scale`

    def __post_init__(self) -> None:
        if min(self.a, self.b_c, self.b_r, self.c) < 0 or not self.scale > 0:
            # a negative cost would let the scheduler believe a bigger batch is cheaper (and split_passes'
            # pruning and the scheduler's search both rest on a batch never costing less than a part of it)
            raise ValueError(
                f"estimator coefficients must be >= 0 and scale > 0, got a {self.a}, b_c {self.b_c}, "
                f"b_r {self.b_r}, c {self.c}, scale {self.scale}"
            )

    def predict_ms(self, members: Sequence[Member]) -> float:
        """scale * max(0, features(members) @ (a, b_c, b_r, c)), without numpy (see the module's note)."""
        n_linear, n_interactions, n_cached, one = _terms(members, self.packed)
        return self.scale * max(0.0, self.a * n_linear + self.b_c * n_interactions + self.b_r * n_cached + self.c * one)

    def member_ms(self, member: Member) -> float:
        """predict_ms([member]) to the last bit, without building a batch: the scheduler prices every waiting
        request at every dispatch."""
        cached, new = member
        return self.scale * max(0.0, self.a * new + self.b_c * ((cached + new) * new) + self.b_r * cached + self.c)

    def batch_ms(self, members: Sequence[Member]) -> float:
        """A whole batch, run as split_passes groups it: the sum of its passes' estimates."""
        if self.packed:
            return self.predict_ms(members)
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
        known = {k: d[k] for k in ("a", "b_c", "b_r", "c", "target", "device", "report", "packed") if k in d}
        return cls(**known, fitted=True)


def pass_ms(model: "VerifyTimeModel", rows: int, cached: int, new: int) -> float:
    """predict_ms of a pass of `rows` members padded to (cached, new), to the last bit, from its shape alone."""
    return model.scale * max(
        0.0, model.a * (rows * new) + model.b_c * (rows * (cached + new) * new) + model.b_r * (rows * cached) + model.c
    )


def passes_ms(model: "VerifyTimeModel", rows: np.ndarray, cached: np.ndarray, new: np.ndarray | int) -> np.ndarray:
    """pass_ms of many passes at once: rows, cached, new [n] (int64) -> [n], each to the last bit."""
    return model.scale * np.maximum(
        0.0, model.a * (rows * new) + model.b_c * (rows * (cached + new) * new) + model.b_r * (rows * cached) + model.c
    )


def split_passes(members: Sequence[Member], model: "VerifyTimeModel") -> list[list[int]]:
    """Indices of members grouped into passes, shortest runs of new tokens first, least estimated time.

    Groups are contiguous in the order of (L_new, L_cached) (a pass pads to its longest run,
    so a member never gains from sharing a pass with a longer one while a shorter
    one waits for a later pass). Dynamic programme over that order: best[j] =
    min over i < j of best[i] + T(members i..j-1), the smallest such i on a tie;
    `_pass_starts` finds it without trying every i (tests/server_bridge/test_estimator.py
    checks it against trying every i). A packed engine's batch is one pass (the module's note).
    """
    if model.packed:
        return [list(range(len(members)))] if members else []
    order, _, passes = _split(members, model)
    return [order[i:j] for i, j, *_ in passes]


def _split(
    members: Sequence[Member] | np.ndarray, model: "VerifyTimeModel"
) -> tuple[list[int], list[tuple[int, int]], list[tuple[int, int, int, int]]]:
    """split_passes as positions: the order of (L_new, L_cached), those keys in it, and each pass's [i, j)
    in it with its padded (L_cached, L_new). members: (L_cached, L_new) pairs, or their array [n, 2]."""
    if isinstance(members, np.ndarray):  # [n, 2] int64: sorted in numpy (the scheduler's queue)
        order = np.lexsort((members[:, 0], members[:, 1])).tolist()
        keys = list(zip(members[order, 1].tolist(), members[order, 0].tolist(), strict=True))
    else:
        keys = [(new, cached) for cached, new in members]
        order = sorted(range(len(members)), key=keys.__getitem__)
        keys = [keys[k] for k in order]
    cut, padded = _pass_starts(keys, model)
    passes, j = [], len(order)
    while j > 0:
        passes.append((cut[j], j, padded[j], keys[j - 1][0]))
        j = cut[j]
    return order, keys, passes[::-1]


# How _pass_starts finds best[j] = min over i < j of best[i] + T(members i..j-1) without trying every i.
#
# A pass over members i..j-1 (sorted by (L_new, L_cached)) costs s ((j - i) g(N, C) + c), with N = L_new
# of its last member, C = the largest L_cached among them and g(N, C) = a N + b_c (C + N) N + b_r C.
# Seen from j, C is a step function of i: the starts form segments, one per cache maximum looking left
# from j - 1 (a stack; a new member merges the segments whose maximum it reaches, `_Starts.merge`,
# smaller into larger). Inside a segment, best[i] + s (j - i) g + s c = (best[i] - i X) + j X + s c
# with X = s g(N, C): the cheapest start there is the lowest of the lines X -> best[i] - i X at X, so a
# segment keeps only their lower envelope. Its X never shrinks (N is sorted, a merge only raises C), so
# a line that loses at X loses for good: queries cost O(1) amortized. Per member: O(S), S the segments
# in play, a handful (the caches that are maxima looking left, within reach of the pruning below).
#
# Pruning: a start i' more than c / (g(N, 0) - g(N', 0)) rows below the first member s with this N (N'
# the one before) loses to starting at s, for this j and every later one: best[s] <= best[i'] + the pass
# i'..s-1 alone, and padded to N with the rest the rows i'..s-1 pay (s - i') (g(N, C) - g(N', C)) more
# than in that pass, more than the c it saves.


def _pass_starts(keys: list[tuple[int, int]], model: "VerifyTimeModel") -> tuple[list[int], list[int]]:
    """cut[j]: where the last pass of the best split of the first j members starts, and padded[j]: that
    pass's L_cached; keys: the members' (L_new, L_cached), sorted. The smallest such start on a tie, as
    the plain dynamic programme (see the note above)."""
    a, b_c, b_r, c, scale = model.a, model.b_c, model.b_r, model.c, model.scale
    best = [0.0] * (len(keys) + 1)
    cut = [0] * (len(keys) + 1)
    padded = [0] * (len(keys) + 1)
    top: _Starts | None = None  # the segment of the starts nearest j
    below: list[_Starts] = []  # the segments under it, bottom (smallest starts, largest cache) first
    lower: list[tuple[float, float, int, int]] = []  # of each of those: (best[i] - i X, X, i, C) at this N
    slope_n = slope_c = 0.0  # X = slope_n + slope_c * C at this N
    previous = -1  # the N of the member before
    for j, (new, cached) in enumerate(keys, start=1):
        p = j - 1
        if new != previous:  # a new N: every segment's X changes, and the starts too far below go
            slope_n, slope_c = scale * (a * new + b_c * new * new), scale * (b_c * new + b_r)
            if top is not None:
                below.append(top)
                _prune(below, p, previous, new, model)
                top = below.pop() if below else None
            lower = [segment.query(slope_n + slope_c * segment.cached, best) for segment in below]
            previous = new
        if top is not None and top.cached <= cached:  # p reaches the top's cache (mostly: sorted)
            starts = top.starts  # _push_back(starts, p, best), inlined: it runs for every member
            while len(starts) > 1:
                i1, i2 = starts[-1], starts[-2]
                if (best[p] - best[i2]) * (i1 - i2) > (best[i1] - best[i2]) * (p - i2):
                    break
                starts.pop()
            starts.append(p)
            top.cached = cached
            while below and below[-1].cached <= cached:  # and these too
                top = below.pop().merge(top, best)
                lower.pop()
        else:
            if top is not None:  # the old top is below the new one now
                below.append(top)
                lower.append(top.query(slope_n + slope_c * top.cached, best))
            top = _Starts(cached, p)
        bv, bi, bc = math.inf, -1, cached
        for h, x, i, seg_cached in lower:  # bottom first, smaller starts first: a tie keeps the smaller
            if h + j * x < bv:
                bv, bi, bc = h + j * x, i, seg_cached
        x = slope_n + slope_c * cached
        starts = top.starts  # top.query(x, best), inlined
        i, h = starts[0], best[starts[0]] - starts[0] * x
        while len(starts) > 1 and h > best[starts[1]] - starts[1] * x:
            starts.popleft()
            i, h = starts[0], best[starts[0]] - starts[0] * x
        if h + j * x < bv:
            bi, bc = i, cached
        rows = j - bi  # pass_ms inlined, to the last bit (never below 0 with a, b_c, b_r, c >= 0: no max)
        best[j] = best[bi] + scale * (a * (rows * new) + b_c * (rows * (bc + new) * new) + b_r * (rows * bc) + c)
        cut[j], padded[j] = bi, bc
    return cut, padded


def _prune(segments: list["_Starts"], s: int, before: int, new: int, model: "VerifyTimeModel") -> None:
    """Drop the starts that lose to starting at s for good (see _pass_starts: more than c / delta rows below s)."""
    delta = model.a * (new - before) + model.b_c * (new * new - before * before)
    if delta <= 0:
        return
    lowest = s - (model.c + 1e-6) / delta  # 1e-6 ms: a margin far above rounding, so no tie is dropped
    while segments and segments[0].starts[0] < lowest:
        starts = segments[0].starts
        while starts and starts[0] < lowest:
            starts.popleft()
        if not starts:
            segments.pop(0)


class Passes:
    """A batch split into passes in split_passes' order, that members can then join one by one, cheaply.

    A member joins where it adds least without breaking the order of (L_new, L_cached): the pass whose
    range holds it, or, between two passes, the end of the one before, the start of the one after, or a
    pass of its own. So `ms` is always what some split in split_passes' order costs, never less than
    batch_ms of the members so far, and `floor` never more: bounds the scheduler keeps while it grows a
    batch, to price exactly only where they do not decide. Exact (both batch_ms) from `best`.
    """

    def __init__(
        self,
        model: "VerifyTimeModel",
        firsts: list[tuple[int, int]],
        lasts: list[tuple[int, int]],
        shapes: list[tuple[int, int, int]],
    ):
        self.model = model
        self.firsts = firsts  # per pass, in order: the (L_new, L_cached) it starts at
        self.lasts = lasts  # ... it ends at
        self.shapes = shapes  # ... and its (rows, largest L_cached, L_new of its last)
        self.costs = [pass_ms(model, *shape) for shape in shapes]
        self.ms = sum(self.costs)  # batch_ms to the last bit when the split is split_passes' own
        self.floor = self.ms * (1 - 1e-9)  # a lower bound of batch_ms, a hair under so that rounding never lifts it

    @classmethod
    def best(cls, members: Sequence[Member] | np.ndarray, model: "VerifyTimeModel") -> "Passes":
        """split_passes' own split: ms is batch_ms. members: (L_cached, L_new) pairs, or their array [n, 2]."""
        _, keys, passes = _split(members, model)
        shapes = [(j - i, cached, new) for i, j, cached, new in passes]
        return cls(model, [keys[i] for i, *_ in passes], [keys[j - 1] for _, j, *_ in passes], shapes)

    @classmethod
    def cheap(cls, shapes: np.ndarray, model: "VerifyTimeModel") -> "Passes":
        """The cheapest split into one or two passes of shapes [n, 2] (L_cached, L_new), n >= 1, in numpy.

        floor: the lesser of its ms and three passes' fixed cost with every row unpadded (what three or
        more passes cost at least)."""
        sort = np.lexsort((shapes[:, 0], shapes[:, 1]))
        cached, new = shapes[sort, 0], shapes[sort, 1]
        n = len(sort)
        rows = np.arange(1, n + 1)
        head_cached, tail_cached = np.maximum.accumulate(cached), np.maximum.accumulate(cached[::-1])[::-1]
        head = passes_ms(model, rows, head_cached, new)  # [n] the first k as one pass
        tail = passes_ms(model, rows[::-1], tail_cached, new[-1])  # [n] from member k on as one pass
        two = head[:-1] + tail[1:]  # [n - 1] cut before member k = 1 .. n - 1
        cut = int(np.argmin(two)) + 1 if n > 1 and two.min() < head[-1] else n
        bounds = [(0, cut), (cut, n)] if cut < n else [(0, n)]
        passes = cls(
            model,
            [(int(new[i]), int(cached[i])) for i, _ in bounds],
            [(int(new[k - 1]), int(cached[k - 1])) for _, k in bounds],
            [(k - i, int(tail_cached[i] if k == n else head_cached[k - 1]), int(new[k - 1])) for i, k in bounds],
        )
        unpadded = model.scale * float(np.sum(model.a * new + model.b_c * ((cached + new) * new) + model.b_r * cached))
        passes.floor = min(passes.ms, unpadded + 3 * model.scale * model.c) * (1 - 1e-9)
        return passes

    def add(self, member: Member) -> float:
        """Join member where it adds least; the new ms. floor grows by its row, unpadded: T(B + r) >= T(B) + that,
        as taking r out of the best split of B + r leaves a split of B cheaper by at least r's row."""
        self.floor += (pass_ms(self.model, 1, *member) - self.model.scale * self.model.c) * (1 - 1e-9)
        key = (member[1], member[0])
        g = bisect.bisect_left(self.lasts, key)  # lasts[g - 1] < key <= lasts[g]
        if g < len(self.lasts) and self.firsts[g] < key:  # inside pass g: the only place that keeps the order
            self._join(g, key, member)
        else:  # between passes g - 1 and g: the end of one, the start of the other, or a pass of its own
            added = {
                h: pass_ms(self.model, *self._joined(h, member)) - self.costs[h]
                for h in (g - 1, g)
                if 0 <= h < len(self.lasts)
            }
            own = pass_ms(self.model, 1, *member)
            h = min(added, key=added.__getitem__, default=-1)
            if h < 0 or own < added[h]:
                self.firsts.insert(g, key)
                self.lasts.insert(g, key)
                self.shapes.insert(g, (1, *member))
                self.costs.insert(g, own)
            else:
                self._join(h, key, member)
        self.ms = sum(self.costs)
        return self.ms

    def _joined(self, g: int, member: Member) -> tuple[int, int, int]:
        """Pass g's shape with member in it."""
        rows, cached, new = self.shapes[g]
        return rows + 1, max(cached, member[0]), max(new, member[1])

    def _join(self, g: int, key: tuple[int, int], member: Member) -> None:
        self.firsts[g], self.lasts[g] = min(self.firsts[g], key), max(self.lasts[g], key)
        self.shapes[g] = self._joined(g, member)
        self.costs[g] = pass_ms(self.model, *self.shapes[g])


class _Starts:
    """One segment of start positions sharing a pass's padded cache: the lower envelope of best[i] - i X.

    `starts` is increasing (so slopes -i decreasing); a start whose line is nowhere strictly lowest (or
    lowest only where a smaller start ties it) is not kept, so a tie goes to the smaller start, as the
    plain dynamic programme's does."""

    __slots__ = ("cached", "starts")

    def __init__(self, cached: int, start: int):
        self.cached = cached
        self.starts: deque[int] = deque((start,))

    def query(self, x: float, best: list[float]) -> tuple[float, float, int, int]:
        """(best[i] - i x, x, i, cached) of the cheapest start at x; drops those that lose at x (x only grows)."""
        starts = self.starts
        i = starts[0]
        while len(starts) > 1 and best[i] - i * x > best[starts[1]] - starts[1] * x:
            starts.popleft()
            i = starts[0]
        return best[i] - i * x, x, i, self.cached

    def merge(self, right: "_Starts", best: list[float]) -> "_Starts":
        """This segment (smaller starts) and the one right of it, as one with right's cache: smaller into larger."""
        if len(self.starts) >= len(right.starts):
            for k in right.starts:
                _push_back(self.starts, k, best)
            self.cached = right.cached
            return self
        for k in reversed(self.starts):
            _push_front(right.starts, k, best)
        return right


def _push_back(starts: deque[int], k: int, best: list[float]) -> None:
    """Add start k > every start kept: drop the last while the lines before and k leave it nowhere lowest."""
    while len(starts) > 1:
        i1, i2 = starts[-1], starts[-2]
        if (best[k] - best[i2]) * (i1 - i2) <= (best[i1] - best[i2]) * (k - i2):
            starts.pop()
        else:
            break
    starts.append(k)


def _push_front(starts: deque[int], k: int, best: list[float]) -> None:
    """Add start k < every start kept: drop the first while k and the line after leave it nowhere lowest."""
    while len(starts) > 1:
        i1, i2 = starts[0], starts[1]
        if (best[i2] - best[k]) * (i1 - k) <= (best[i1] - best[k]) * (i2 - k):
            starts.popleft()
        else:
            break
    starts.appendleft(k)


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
