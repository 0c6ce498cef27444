"""What a generation returns: its ids and text (`Generation`) and its figures (`Metrics`, named as in DESIGN.md)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class Metrics:
    """Per-generation figures, named as in DESIGN.md everywhere (CLI JSON, /metrics, benchmarks)."""

    tau: float | None = None  # tokens committed per verification round
    acceptance_rate: float | None = None  # accepted draft tokens / drafted
    rounds: int = 0
    target_forward_passes: int = 0
    draft_ms: float = 0.0  # time spent drafting (gamma * T_p per round)
    verify_ms: float = 0.0  # server time in target forward passes (T_q per round)
    network_ms: float = 0.0  # waiting time not explained by verify_ms (2 * T_c per round)
    wall_s: float = 0.0
    tokens_per_s: float = 0.0
    bytes_up: int = 0
    bytes_down: int = 0
    # the uplink payload (protocol/payload.py) and what the verify rounds cost on the link
    payload: str = "none"  # none | full | topk(K=256) | split; none when greedy, ar or local
    bytes_up_per_round: float | None = None  # verify frames, mean over rounds
    bytes_down_per_round: float | None = None  # result frames (split residuals included) and exits
    round_bytes_up: int = 0
    round_bytes_down: int = 0
    residuals: int = 0  # split rejections: p_j came down and the correction was drawn here
    drafted: int = 0
    accepted: int = 0
    wasted_draft_tokens: int = 0  # drafted tokens the server rejected
    reconnects: int = 0  # new connections after a lost link
    protocol_violations: int = 0  # of those lost links, replies that broke the protocol (agent/decoding/replies.py),
    # dropped with their link and nothing of them committed
    restarts: int = 0  # of those, after the server closed on purpose (a replica draining:
    # 1012), made at once without backing off
    replicas: list[Any] = field(default_factory=list)  # the replicas that held the session, in order (<= 16)
    reconnect_ms: float = 0.0  # from each lost link to the session re-opened on the next, summed
    reopens: int = 0  # sessions re-opened after the server lost them (evicted)
    session_switches: int = 0  # opens refused (session_taken) and redone at once under a fresh sid
    shed_retries: int = 0  # opens or rounds the verifier shed (overloaded), retried after a backoff
    prefill_ms: float = 0.0
    # FSD: a round's draft was pre-drafted (cached or in progress when the previous result came) or not
    predraft_hits: int = 0
    predraft_misses: int = 0
    predraft_miss_rate: float | None = None  # misses / (hits + misses); the first round has no predecessor
    predraft_failures: int = 0  # rounds the pre-draft worker failed; drafted afresh
    exits_received: int = 0  # early-exit verdicts that reached the robot
    avg_exit_layer: float | None = None  # mean over rounds of the earliest exit that matched the result
    exit_layer_sum: int = 0
    exit_ms: float = 0.0  # server time in early-exit heads (part of verify_ms)
    # draft policy (agent/decoding/policy.py)
    draft_policy: str = "fixed"
    draft_lengths: dict[str, Any] = field(default_factory=dict)  # str(k) -> rounds that drafted k tokens
    predictor_stops: int = 0  # rounds the rejection predictor ended early
    predictor_calls: int = 0
    predictor_ms: float = 0.0  # onnxruntime time, all calls
    feature_ms: float = 0.0  # computing the predictor's features from the logits
    gamma_star: int | None = None  # the optimal draft length by the last estimates
    expected_speedup: float | None = None  # S(gamma*) * rho over target-only streaming, last estimate
    estimates: dict[str, Any] = field(default_factory=dict)  # the cost model's last inputs (alpha, L, rho, ...)
    streamed_tokens: int = 0  # tokens the target streamed alone while AS2 had speculation off
    as2_switches: list[Any] = field(default_factory=list)  # {token, to, expected_speedup, ...}, at most 64

    def finish(self, n_out: int, mode: str, wall_s: float) -> None:
        """The ratios, once a generation of `n_out` tokens in `mode` has ended after `wall_s` seconds."""
        self.wall_s = wall_s
        self.tokens_per_s = n_out / wall_s if wall_s > 0 else 0.0
        if self.drafted:
            self.acceptance_rate = self.accepted / self.drafted
        if self.rounds:
            self.tau = (n_out - self.streamed_tokens) / self.rounds
            if mode != "ar":
                self.bytes_up_per_round = self.round_bytes_up / self.rounds
                self.bytes_down_per_round = self.round_bytes_down / self.rounds
        if self.predraft_hits + self.predraft_misses:
            self.predraft_miss_rate = self.predraft_misses / (self.predraft_hits + self.predraft_misses)
        if mode == "fsd" and self.rounds:
            self.avg_exit_layer = self.exit_layer_sum / self.rounds


@dataclass
class Generation:
    """What EdgeDecoder.generate returns: the generated text and ids, the mode, and the figures."""

    text: str
    token_ids: list[int]  # generated ids only (a final stop id included)
    mode: str
    metrics: Metrics = field(default_factory=Metrics)

    def to_json(self) -> dict[str, Any]:
        return {"text": self.text, "token_ids": self.token_ids, "mode": self.mode, "metrics": asdict(self.metrics)}
