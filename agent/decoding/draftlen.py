"""How long to draft, and whether to draft at all (TK-SLT Theorem 2 / Algorithms 1-2).

The paper's model of one draft-verify round with draft length gamma:

    E[tokens]  = (1 - a^(gamma+1)) / (1 - a)             a: per-token acceptance
    T_round    = T_q * (1 + gamma * L),   L = b + c       c = T_p / T_q, b = T_c / T_q
    S(gamma)   = (1 - a^(gamma+1)) / ((1 + gamma L)(1 - a))   speedup over the target alone

with T_p the draft's time per token, T_c the transfer time per drafted token and
T_q the target's time per round. Its optimum (Theorem 2) is

    gamma_0 = [W_-1(-a^(1/L - 1) / e) + 1] / ln a - 1/L

rounded to whichever neighbour has the larger S (Algorithm 1, ODLD).

A robot's link adds a fixed cost per round the paper leaves out: the round
trip. Here T_q is the fixed part of a round (the target's pass over one
position plus the network round trip), and everything that grows with gamma
(drafting, the target's extra positions, the bytes) is in L. Maximising
(1 - a^(gamma+1)) / (1 + gamma L) is the same problem, so gamma* is the paper's.
The speedup over target-only streaming, which pays neither the round trip
per token nor the draft, is S(gamma) * rho with rho = T_ar / T_q: on a
slow link rho falls below 1/S and speculation loses (AS2, `As2`).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Any

import numpy as np

LINK_JITTER_MS = 5.0  # a trip this close to the running one is the same link, whatever the ratio


def speedup(alpha: float, L: float, gamma: int | np.ndarray) -> float | np.ndarray:
    """S(gamma) of TK-SLT Theorem 1: the expected tokens per round over the round's relative cost."""
    if alpha >= 1.0:
        return (np.asarray(gamma) + 1.0) / (1.0 + np.asarray(gamma) * L)
    return (1.0 - alpha ** (np.asarray(gamma) + 1.0)) / ((1.0 + np.asarray(gamma) * L) * (1.0 - alpha))


def gamma_zero(alpha: float, L: float) -> float:
    """The real maximiser of S (Theorem 2); -inf where S only falls with gamma (L >= 1)."""
    if L >= 1.0:  # -a ln a <= 1 - a, so S'(0) <= 0 and S is unimodal: falls everywhere
        return -math.inf
    # W_-1(x) for x = -a^(1/L - 1) / e, in (-1/e, 0) for 0 < a < 1, 0 < L < 1; via ln(-x), as x
    # underflows for small a and L (a = 0.02, L = 0.002: x ~ 1e-849)
    log_neg_x = -1.0 + (1.0 / L - 1.0) * math.log(alpha)
    return (_lambert_wm1(log_neg_x) + 1.0) / math.log(alpha) - 1.0 / L


def _lambert_wm1(log_neg_x: float) -> float:
    """W_-1(x) for x = -exp(log_neg_x) in [-1/e, 0): scipy where x is a normal float, else Newton on
    w + ln(-w) = ln(-x), which is w e^w = x taken in logs."""
    if log_neg_x >= -1.0:
        return -1.0
    if log_neg_x > -700.0:
        from scipy.special import lambertw

        return float(lambertw(-math.exp(log_neg_x), k=-1).real)
    w = log_neg_x - math.log(-log_neg_x)
    for _ in range(50):
        step = (w + math.log(-w) - log_neg_x) / (1.0 + 1.0 / w)
        w -= step
        if abs(step) < 1e-12 * abs(w):
            break
    return w


def optimal_gamma(alpha: float, L: float, lo: int = 1, hi: int = 64) -> tuple[int, float]:
    """(gamma*, S(gamma*)) by ODLD (TK-SLT Algorithm 1), kept within [lo, hi].

    S is unimodal in gamma, so the bounded optimum is the unbounded one clipped.
    Degenerate estimates are handled rather than fed to W: a >= 1 or L <= 0 -> hi, a <= 0 -> lo.
    """
    if not (lo >= 1 and hi >= lo):
        raise ValueError(f"need 1 <= lo <= hi, got lo={lo} hi={hi}")
    if not (math.isfinite(alpha) and math.isfinite(L)):
        raise ValueError(f"alpha and L must be finite, got alpha={alpha} L={L}")
    if alpha <= 0.0:
        g = lo
    elif alpha >= 1.0 or L <= 0.0:
        g = hi
    else:
        g0 = gamma_zero(alpha, L)
        if g0 < 1.0:
            g = 1
        else:
            down, up = math.floor(g0), math.ceil(g0)
            g = up if speedup(alpha, L, down) <= speedup(alpha, L, up) else down
        g = min(max(g, lo), hi)
    return g, float(speedup(min(max(alpha, 0.0), 1.0), max(L, 0.0), g))


# ---------------------------------------------------------------------------- online estimates


def _fit(points: deque[Any], min_spread: float = 0.5, min_points: int = 8) -> tuple[float, float] | None:
    """Least-squares (intercept >= 0, slope >= 0) of y on x, or None until there are enough points
    with enough spread to tell: a slope from a handful of noisy rounds extrapolates to a nonsense
    intercept (20 ms for a 90 ms pass, seen; -207 ms for drafting where pre-drafted rounds cost
    nothing, seen, which made every round look free)."""
    x = np.fromiter((p[0] for p in points), float, len(points))
    y = np.fromiter((p[1] for p in points), float, len(points))
    if x.size < min_points or x.std() < min_spread:
        return None
    slope = float(np.cov(x, y, bias=True)[0, 1] / x.var())
    intercept = float(y.mean() - slope * x.mean())
    if slope >= 0.0 and intercept >= 0.0:
        return intercept, slope
    # the optimum under the constraints lies on an edge: a flat line at the mean, or a line
    # through the origin; take the one with the smaller squared error
    flat = (max(0.0, float(y.mean())), 0.0)
    origin = (0.0, max(0.0, float(x @ y / (x @ x))))
    return min(flat, origin, key=lambda f: float(np.sum((y - f[0] - f[1] * x) ** 2)))


def _line(points: deque[Any]) -> tuple[float, float]:
    """The fit, or a flat line at the mean (which errs on the side of speculating)."""
    fit = _fit(points)
    if fit is None:
        return float(np.mean([p[1] for p in points])), 0.0
    return fit


@dataclass
class Costs:
    """The round model's inputs, in ms, as estimated now."""

    alpha: float  # per-token acceptance (censored MLE, decayed)
    t_draft: float  # T_p: the draft's time per drafted token (what the loop waited)
    draft_0: float  # drafting time per round whatever its length (re-reading the
    # committed tokens, the look-ahead a predictor stop costs)
    verify_0: float  # target pass cost independent of positions
    verify_per_token: float  # target pass cost per position
    net_0: float  # network time per round (the round trip)
    net_per_token: float  # network time per drafted token (bytes)

    @property
    def t_fixed(self) -> float:  # T_q: one round's fixed cost (a pass over one position + the trip)
        return max(1e-3, self.verify_0 + self.verify_per_token + self.net_0 + self.draft_0)

    @property
    def t_ar(self) -> float:  # the target's time per streamed token (a pass over one position)
        return max(1e-3, self.verify_0 + self.verify_per_token)

    @property
    def c(self) -> float:
        return (self.t_draft + self.verify_per_token) / self.t_fixed

    @property
    def b(self) -> float:
        return self.net_per_token / self.t_fixed

    @property
    def L(self) -> float:
        return self.b + self.c

    @property
    def rho(self) -> float:
        return self.t_ar / self.t_fixed


class CostEstimator:
    """Running estimates of the round model from what each round and each streamed token shows.

    Acceptance: a round that accepted n of k drafted tokens shows n acceptances
    and, when n < k, one rejection (later tokens were never judged); sums decay
    by `decay` per observation so the estimate follows the text. Verify time: a
    line against positions over the last `window` passes (rounds and streamed
    tokens alike; it does not change with the link). Network: the per-token part
    is a line's slope over the last rounds (the bytes); the round trip itself is a
    moving average of what rounds leave after that slope and of ping times, quick
    to follow (weight `link_weight`) because a robot's link changes fast.

    A new link (a trip under half or over twice the running one, and more than
    `LINK_JITTER_MS` away from it) restarts the per-token slope: rounds timed on
    the old link and the new one make a line that is neither's bytes (99 ms/token,
    seen). A ping shows it at once; rounds, which also carry queueing and spikes,
    only when two in a row land on the same side. A lone round off the link is
    left out of both estimates: at weight 0.5 one 1.4 s spike on a 0.4 s link would
    make the next ordinary round look like a new link.
    """

    def __init__(
        self,
        prior_alpha: float = 0.7,
        prior_weight: float = 4.0,
        decay: float = 0.98,
        window: int = 32,
        link_weight: float = 0.5,
    ):
        self.decay = decay
        self.link_weight = link_weight
        self.accepts = prior_alpha * prior_weight
        self.rejects = (1.0 - prior_alpha) * prior_weight
        self.verify: deque[tuple[float, float]] = deque(maxlen=window)  # (positions, ms)
        self.network: deque[tuple[float, float]] = deque(maxlen=window)  # (drafted tokens, ms) of rounds
        self.drafting: deque[tuple[float, float]] = deque(maxlen=window)  # (drafted tokens, ms) of rounds
        self.round_trip: float | None = None  # ms, moving average
        # the last round, when off the round trip: (side, round, trip, rt)
        self._off_link: tuple[Any, ...] | None = None
        self.draft_ms: float | None = None
        self.samples = 0  # rounds and streamed tokens seen

    def observe_acceptance(self, accepted: float, rejected: float) -> None:
        self.accepts = self.accepts * self.decay + accepted
        self.rejects = self.rejects * self.decay + rejected

    def observe_round(self, k: int, accepted: int, draft_ms: float, verify_ms: float, network_ms: float) -> None:
        self.observe_acceptance(accepted, 1.0 if accepted < k else 0.0)
        if k:
            self._draft(draft_ms / k)
        self.drafting.append((k, draft_ms))
        self.verify.append((k + 1, verify_ms))
        self.samples += 1
        if self._off_link is not None:
            side, held, held_trip, was = self._off_link
            self._off_link = None
            if self._link_side(network_ms - self._net_per_token() * k, was) == side:
                self.network.clear()  # the second in a row off the same way: a new link
                self.network.append(held)
                self.round_trip = held_trip
        trip = network_ms - self._net_per_token() * k
        side = self._link_side(trip, self.round_trip)
        if side:  # held until the next round tells a spike from a new link
            self._off_link = (side, (k, network_ms), trip, self.round_trip)
            return
        self.network.append((k, network_ms))
        self._round_trip(network_ms - self._net_per_token() * k)

    def observe_streamed(self, agreement: float, draft_ms: float | None, verify_ms: float) -> None:
        """One target-only token: agreement = P(the draft would have been accepted there)."""
        self.observe_acceptance(agreement, 1.0 - agreement)
        if draft_ms is not None:
            self._draft(draft_ms)
        self.verify.append((1, verify_ms))
        self.samples += 1

    def observe_latency(self, rtt_ms: float) -> None:
        """A measured round trip with nothing drafted (a ping while streaming); a new link
        shows at once, and the per-token part starts again from the rounds on it."""
        if self._link_side(rtt_ms, self.round_trip):
            self.network.clear()
            self._off_link = None
        self._round_trip(rtt_ms)

    @staticmethod
    def _link_side(trip_ms: float, rt: float | None) -> int:
        """+1 / -1 when a trip is a new link's, slower / faster than the round trip `rt`; 0 when it is rt's."""
        if rt is None or 0.5 * rt <= trip_ms <= 2.0 * rt or abs(trip_ms - rt) <= LINK_JITTER_MS:
            return 0
        return 1 if trip_ms > rt else -1

    def _round_trip(self, ms: float) -> None:
        ms = max(0.0, ms)
        w = self.link_weight
        self.round_trip = ms if self.round_trip is None else (1 - w) * self.round_trip + w * ms

    def _net_per_token(self) -> float:
        return _line(self.network)[1] if self.network else 0.0

    def _draft(self, ms: float) -> None:
        self.draft_ms = ms if self.draft_ms is None else 0.8 * self.draft_ms + 0.2 * ms

    @property
    def alpha(self) -> float:
        return self.accepts / (self.accepts + self.rejects)

    def costs(self) -> Costs | None:
        """None until a round has been seen."""
        if not self.verify or self.draft_ms is None:
            return None
        v0, v1 = _line(self.verify)
        # drafting: per round + per token once rounds of several lengths show both; until then all per token
        d0, d1 = _fit(self.drafting) or (0.0, self.draft_ms)
        return Costs(self.alpha, d1, d0, v0, v1, self.round_trip or 0.0, self._net_per_token())


# ---------------------------------------------------------------------------- AS2


@dataclass(frozen=True)
class As2Config:
    leave_below: float = 1.0  # speculate while S(gamma*) > this (TK-SLT Algorithm 2) ...
    return_above: float = 1.1  # ... and come back from target-only only above this (hysteresis)
    patience: int = 3  # consecutive decisions the other way before switching
    warmup: int = 8  # rounds before the first decision (the estimates start from priors)

    def __post_init__(self) -> None:
        if self.return_above < self.leave_below:
            raise ValueError("as2 return_above must be >= leave_below")
        if self.patience < 1 or self.warmup < 0:
            raise ValueError("as2 patience must be >= 1 and warmup >= 0")


class As2:
    """Adaptive speculative selection with hysteresis: speculate, or let the target stream alone."""

    def __init__(self, config: As2Config = As2Config()):
        self.config = config
        self.speculating = True
        self._against = 0

    def decide(self, expected_speedup: float, samples: int) -> bool:
        """Feed the current S(gamma*) * rho; True when the mode should switch now."""
        if samples < self.config.warmup:
            return False
        c = self.config
        wrong = expected_speedup <= c.leave_below if self.speculating else expected_speedup > c.return_above
        self._against = self._against + 1 if wrong else 0
        if self._against >= c.patience:
            self.speculating = not self.speculating
            self._against = 0
            return True
        return False
