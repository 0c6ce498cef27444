"""Draft policies: how many tokens each round drafts, and whether to speculate at all.

    fixed               gamma tokens every round (the baseline)
    predictor           up to gamma, stopping at the first predicted rejection (agent/decoding/predictor.py)
    optimal             gamma* from the running cost estimates (agent/decoding/draftlen.py), and AS2:
                        target-only streaming while speculation cannot win
    predictor+optimal   gamma* as the cap, the predictor inside it, and AS2

Every policy keeps the output exact: a policy only chooses the draft's length.
The estimates (and gamma*, S) are kept under every policy, so a fixed-gamma
run reports what the optimal policy would have chosen.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from .draftlen import As2, As2Config, CostEstimator, Costs, optimal_gamma
from .metrics import Metrics
from .predictor import RejectionPredictor, TraceWriter, feature_row

log = logging.getLogger(__name__)

POLICIES = ("fixed", "predictor", "optimal", "predictor+optimal")
MAX_SWITCHES = 64  # Metrics.as2_switches kept per generation


@dataclass(frozen=True)
class DraftPolicy:
    kind: str = "fixed"
    min_len: int = 1  # the predictor never stops a draft shorter than this
    max_len: int | None = None  # None: gamma (fixed, predictor); the server's limit (optimal)
    predictor: str = "auto"  # an .onnx path, or auto: models/predictors/<draft>__<target>.onnx
    threshold: float | None = None  # stop below this p_accept; None: the model's own (chosen in training)
    as2: bool = True  # optimal kinds: fall back to target-only streaming when S <= 1
    as2_config: As2Config = field(default_factory=As2Config)
    stream_chunk: int = 8  # target-only tokens per request while AS2 has speculation off

    def __post_init__(self) -> None:
        if self.kind not in POLICIES:
            raise ValueError(f"draft policy must be one of {POLICIES}, got {self.kind!r}")
        if self.min_len < 0 or (self.max_len is not None and self.max_len < max(1, self.min_len)):
            raise ValueError(f"need 0 <= min_len <= max_len and max_len >= 1, got {self.min_len}, {self.max_len}")
        if self.threshold is not None and not 0.0 <= self.threshold <= 1.0:
            raise ValueError(f"predictor threshold must be in [0, 1], got {self.threshold}")
        if self.stream_chunk < 1:
            raise ValueError("stream_chunk must be >= 1")

    @property
    def uses_predictor(self) -> bool:
        return "predictor" in self.kind

    @property
    def uses_optimal(self) -> bool:
        return "optimal" in self.kind


class DraftController:
    """One generation's drafting decisions, and the one place the draft length is decided: the decoder asks
    `plan()` before each round (how many tokens to draft), hands the drafter `watch()` (the predictor's
    stop), and tells `observe()` what the round showed (drafted, accepted, timings); streamed tokens and
    pings feed the estimates too. True from `observe()` (AS2) turns speculation off; `decide_streaming()`
    turns it back on.

    The cost estimates and AS2's state describe the link and the model pair, not
    one prompt, so a decoder passes the same `estimator` and `as2` to each of its
    generations: only the first one warms up, and a robot on a slow link starts
    its next instruction already streaming. The running acceptance (a predictor
    feature) is the session's own.
    """

    def __init__(
        self,
        policy: DraftPolicy,
        gamma: int,
        server_limit: int,
        predictor: RejectionPredictor | None = None,
        trace: TraceWriter | None = None,
        session: str = "",
        pair: str = "",
        estimator: CostEstimator | None = None,
        as2: As2 | None = None,
    ):
        if policy.uses_predictor and predictor is None:
            raise ValueError(f"draft policy {policy.kind} needs a rejection predictor")
        self.policy = policy
        self.predictor = predictor if policy.uses_predictor else None
        self.trace = trace
        self.session = session
        self.pair = pair  # "draft->target", for the trace
        cap = policy.max_len if policy.max_len is not None else (server_limit if policy.uses_optimal else gamma)
        self.max_len = max(0, min(cap, server_limit))
        self.gamma = min(gamma, self.max_len)
        self.estimator = estimator if estimator is not None else CostEstimator()
        self.as2 = as2 if as2 is not None else As2(policy.as2_config)
        self.accepted = 0  # the session's judged tokens (running acceptance)
        self.rejected = 0
        self.gamma_star: int | None = None
        self.expected_speedup: float | None = None  # S(gamma*) * rho: over target-only streaming
        self.feature_ms = 0.0
        self.stops = 0  # rounds the predictor cut short
        self.lengths: dict[str, int] = {}  # str(k) -> rounds that drafted k tokens
        self.switches: list[dict[str, Any]] = []  # AS2's switches, at most MAX_SWITCHES
        self._rows: list[np.ndarray] = []  # this round's feature rows
        self._stopped = False
        self._estimate()  # from earlier generations' rounds, if any

    @property
    def speculating(self) -> bool:
        return self.as2.speculating

    # ------------------------------------------------------------------ per round

    def plan(self, remaining: int | None = None) -> int:
        """How many tokens to draft this round (the predictor may stop before it, `watch`).

        `remaining`: the tokens the generation may still commit; a round commits at most k + 1, so
        k <= remaining - 1. Without it, the length a round would draft now (FSD pre-drafts the next
        round at that length before this one's result is known).
        """
        if self.policy.uses_optimal and self.gamma_star is not None:
            k = max(self.gamma_star, min(self.policy.min_len, self.max_len))
        else:
            k = self.gamma
        return k if remaining is None else min(k, remaining - 1)

    def watch(self) -> Callable[[int, np.ndarray], bool] | None:
        """A callback for Drafter.propose: (position, logits [vocab]) -> draft this token? None if not needed."""
        self._rows = []
        self._stopped = False
        if self.predictor is None and self.trace is None:
            return None

        def keep(position: int, logits: np.ndarray) -> bool:
            t0 = time.perf_counter()
            row = feature_row(logits, position, self.accepted, self.rejected)
            self.feature_ms += (time.perf_counter() - t0) * 1e3
            if self.predictor is not None and position >= self.policy.min_len and self.predictor.should_stop(row):
                self._stopped = True
                return False
            self._rows.append(row)
            return True

        return keep

    def observe(self, number: int, k: int, accepted: int, draft_ms: float, verify_ms: float, network_ms: float) -> bool:
        """Record verified round `number`: k tokens drafted (in draft_ms as the loop waited), `accepted` of them
        accepted, the server's verify_ms and the rest of the round trip; True when AS2 says to stop
        speculating now."""
        self.lengths[str(k)] = self.lengths.get(str(k), 0) + 1
        self.stops += self._stopped
        if self.trace is not None and self._rows:
            self.trace.round(self.pair, self.session, number, self._rows[:k], accepted)
        self.accepted += accepted
        self.rejected += int(accepted < k)
        self.estimator.observe_round(k, accepted, draft_ms, verify_ms, network_ms)
        return self._update()

    def after_streamed(self, agreement: float, draft_ms: float | None, verify_ms: float) -> None:
        self.estimator.observe_streamed(agreement, draft_ms, verify_ms)

    def after_latency(self, rtt_ms: float) -> None:
        self.estimator.observe_latency(rtt_ms)

    def decide_streaming(self) -> bool:
        """While streaming target-only: True when AS2 says to speculate again now."""
        return self._update()

    def _estimate(self) -> bool:
        """Refresh gamma* and S(gamma*) * rho from the estimates; False while there are none."""
        costs = self.costs()
        if costs is None:
            return False
        lo = max(1, min(self.policy.min_len, self.max_len))
        self.gamma_star, s = optimal_gamma(costs.alpha, costs.L, lo=lo, hi=max(lo, self.max_len))
        self.expected_speedup = s * costs.rho
        return True

    def _update(self) -> bool:
        if not self._estimate() or not (self.policy.uses_optimal and self.policy.as2):
            return False
        assert self.expected_speedup is not None  # set by _estimate
        return self.as2.decide(self.expected_speedup, self.estimator.samples)

    def switched(self, to: str, rounds: int, committed: int) -> None:
        """Record (and log) an AS2 switch to `to` ("ar": target-only streaming, "sd": speculating again)
        after `rounds` rounds with `committed` tokens."""
        record = {"to": to, "round": rounds, "committed": committed, **self.summary()}
        bound = self.policy.as2_config.leave_below if to == "ar" else self.policy.as2_config.return_above
        record["reason"] = (
            f"speculation's expected speedup over the target alone {self.expected_speedup:.2f} "
            f"{'<=' if to == 'ar' else '>'} {bound} (acceptance {record['alpha']:.2f}, round trip "
            f"{record.get('network_ms_0', 0):.0f} ms, target {record.get('verify_ms_0', 0):.0f} ms "
            f"+ {record.get('verify_ms_per_token', 0):.1f} ms/position, draft "
            f"{record.get('t_draft_ms', 0):.1f} ms/token)"
        )
        log.info("AS2: %s: %s", "target-only streaming" if to == "ar" else "speculating again", record["reason"])
        if len(self.switches) < MAX_SWITCHES:
            self.switches.append(record)

    def fold(self, m: Metrics) -> None:
        """This generation's drafting figures into its metrics."""
        m.draft_policy = self.policy.kind
        m.draft_lengths = dict(self.lengths)
        m.as2_switches = list(self.switches)
        m.gamma_star = self.gamma_star
        m.expected_speedup = self.expected_speedup
        m.estimates = self.summary()
        m.predictor_stops = self.stops
        m.feature_ms = self.feature_ms
        if self.predictor is not None:
            m.predictor_calls = self.predictor.calls
            m.predictor_ms = self.predictor.ms

    def costs(self) -> Costs | None:
        return self.estimator.costs()

    def summary(self) -> dict[str, Any]:
        c = self.costs()
        return {
            "alpha": round(self.estimator.alpha, 4),
            "gamma_star": self.gamma_star,
            "expected_speedup": None if self.expected_speedup is None else round(self.expected_speedup, 3),
            **(
                {}
                if c is None
                else {
                    "L": round(c.L, 4),
                    "b": round(c.b, 4),
                    "c": round(c.c, 4),
                    "rho": round(c.rho, 4),
                    "t_draft_ms": round(c.t_draft, 2),
                    "draft_ms_0": round(c.draft_0, 2),
                    "verify_ms_0": round(c.verify_0, 2),
                    "verify_ms_per_token": round(c.verify_per_token, 2),
                    "network_ms_0": round(c.net_0, 2),
                    "network_ms_per_token": round(c.net_per_token, 3),
                }
            ),
        }
