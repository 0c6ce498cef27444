"""Server counters, rendered in the Prometheus text format for /metrics."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


def _label(slo: float) -> str:
    """An SLO class as a metrics label: 8.0 -> '8', 2.5 -> '2.5', 0 -> '0' (best effort)."""
    return f"{slo:g}"


@dataclass
class ServerMetrics:
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    committed: int = 0                  # tokens committed by verify rounds and ar steps
    target_forward_passes: int = 0
    verify_ms_sum: float = 0.0
    ar_tokens: int = 0
    sessions_opened: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    errors: Counter = field(default_factory=Counter)
    exits_sent: int = 0                 # early-exit messages sent
    exits_dropped: int = 0              # dropped by a full per-connection outbox
    exits_purged: int = 0               # still pending when their round's result went out
    exit_ms_sum: float = 0.0            # time in exit heads (part of verify_ms_sum)
    exit_rounds: int = 0                # rounds that ran exits
    exit_layer_sum: int = 0             # over those rounds: the earliest exit that agreed with the result
    residuals_sent: int = 0             # split rejections answered with the target's p_j
    # Batched verification (server_bridge/batcher.py)
    batches: int = 0                    # forward passes run by the batcher
    batch_sessions: int = 0             # sessions over those passes (mean batch size = batch_sessions / batches)
    batch_size_max: int = 0
    batch_sizes: Counter = field(default_factory=Counter)       # histogram: le bucket -> passes
    pass_ms_sum: float = 0.0            # time in those passes
    queue_wait_s: float = 0.0           # time requests waited for a batch, summed
    slo_requests: Counter = field(default_factory=Counter)      # class (tokens/s) -> requests served
    slo_late: Counter = field(default_factory=Counter)          # class -> served after their deadline
    slo_shed: Counter = field(default_factory=Counter)          # class -> shed (`overloaded`)
    slo_generations: Counter = field(default_factory=Counter)   # class -> generations ended (close or a new open)
    slo_violations: Counter = field(default_factory=Counter)    # class -> of those, slower than their class

    def count_batch(self, size: int, ms: float) -> None:
        self.batches += 1
        self.target_forward_passes += 1         # a batch is one pass, however many sessions ride in it
        self.batch_sessions += size
        self.batch_size_max = max(self.batch_size_max, size)
        self.batch_sizes[next(b for b in BATCH_BUCKETS if size <= b)] += 1
        self.pass_ms_sum += ms

    def count_request(self, slo: float, late: bool) -> None:
        self.slo_requests[_label(slo)] += 1
        self.slo_late[_label(slo)] += late

    def count_generation(self, slo: float, tokens: int, seconds: float) -> None:
        """A generation ended: it violated its SLO if it ran below its class's tokens/s."""
        if tokens > 0 and seconds > 0:
            self.slo_generations[_label(slo)] += 1
            self.slo_violations[_label(slo)] += slo > 0 and tokens / seconds < slo

    def count_shed(self, slo: float) -> None:
        self.slo_shed[_label(slo)] += 1

    def count_round(self, drafted: int, accepted: int, ms: float, exit_layer: int | None = None,
                    exit_ms: float = 0.0) -> None:
        self.rounds += 1
        self.drafted += drafted
        self.accepted += accepted
        self.committed += accepted + 1
        self.verify_ms_sum += ms
        self.exit_ms_sum += exit_ms
        if exit_layer is not None:
            self.exit_rounds += 1
            self.exit_layer_sum += exit_layer

    def count_ar_token(self, ms: float) -> None:
        self.ar_tokens += 1
        self.committed += 1
        self.verify_ms_sum += ms

    def render(self, sessions, connections: int, queue_length: int = 0, engine=None) -> str:
        rows = [
            ("bridge_sessions_active", "gauge", "open sessions", len(sessions)),
            ("bridge_sessions_evicted_total", "counter", "sessions evicted (idle or table full)",
             sessions.evicted_total),
            ("bridge_sessions_opened_total", "counter", "open and re-open requests served", self.sessions_opened),
            ("bridge_connections_active", "gauge", "open websocket connections", connections),
            ("bridge_rounds_total", "counter", "verification rounds", self.rounds),
            ("bridge_draft_tokens_total", "counter", "draft tokens received for verification", self.drafted),
            ("bridge_accepted_tokens_total", "counter", "draft tokens accepted", self.accepted),
            ("bridge_committed_tokens_total", "counter", "tokens committed (rounds and ar)", self.committed),
            ("bridge_ar_tokens_total", "counter", "target-only tokens streamed", self.ar_tokens),
            ("bridge_target_forward_passes_total", "counter", "target forward passes", self.target_forward_passes),
            ("bridge_verify_seconds_total", "counter", "verification time summed over rounds and ar tokens (a "
             "batched pass counts once per session in it; bridge_batch_verify_seconds_total counts it once)",
             self.verify_ms_sum / 1e3),
            ("bridge_exits_sent_total", "counter", "early-exit messages sent", self.exits_sent),
            ("bridge_exits_dropped_total", "counter", "early-exit messages dropped by a full outbox",
             self.exits_dropped),
            ("bridge_exits_purged_total", "counter", "early-exit messages still pending when their result went out",
             self.exits_purged),
            ("bridge_exit_seconds_total", "counter", "time in early-exit heads (part of verify time)",
             self.exit_ms_sum / 1e3),
            ("bridge_split_residuals_total", "counter", "split rounds rejected: p_j sent for the robot to resample",
             self.residuals_sent),
            ("bridge_queue_length", "gauge", "requests waiting for the target", queue_length),
            ("bridge_batches_total", "counter", "batched forward passes", self.batches),
            ("bridge_batch_sessions_total", "counter", "sessions verified in batched passes", self.batch_sessions),
            ("bridge_batch_size_max", "gauge", "largest batch so far", self.batch_size_max),
            ("bridge_batch_verify_seconds_total", "counter", "time in batched forward passes", self.pass_ms_sum / 1e3),
            ("bridge_queue_wait_seconds_total", "counter", "time requests waited for a batch", self.queue_wait_s),
            ("bridge_bytes_in_total", "counter", "websocket payload bytes received", self.bytes_in),
            ("bridge_bytes_out_total", "counter", "websocket payload bytes sent", self.bytes_out),
        ]
        if engine is not None:
            rows += [("bridge_kv_tokens_capacity", "gauge", "KV memory of the engine, in tokens", engine.kv_capacity),
                     ("bridge_kv_tokens_used", "gauge", "KV tokens held by open sessions", engine.kv_used)]
        lines = []
        if engine is not None:                    # an info metric, as Prometheus exporters name their build
            labels = ",".join(f'{k}="{v}"' for k, v in engine.info.as_dict().items())
            lines += ["# HELP bridge_engine_info the engine that serves (value 1)", "# TYPE bridge_engine_info gauge",
                      f"bridge_engine_info{{{labels}}} 1"]
        for name, kind, help_text, value in rows:
            lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", f"{name} {value}"]
        lines += ["# HELP bridge_errors_total error messages sent, by code", "# TYPE bridge_errors_total counter"]
        lines += [f'bridge_errors_total{{code="{code}"}} {n}' for code, n in sorted(self.errors.items())]
        lines += ["# HELP bridge_batch_size sessions per batched forward pass", "# TYPE bridge_batch_size histogram"]
        running = 0
        for bucket in BATCH_BUCKETS:
            running += self.batch_sizes[bucket]
            lines.append(f'bridge_batch_size_bucket{{le="{bucket}"}} {running}')
        lines += [f'bridge_batch_size_bucket{{le="+Inf"}} {self.batches}', f"bridge_batch_size_sum {self.batch_sessions}",
                  f"bridge_batch_size_count {self.batches}"]
        for name, help_text, counts in (
                ("bridge_slo_requests_total", "requests served, by SLO class (tokens/s; 0 = none)", self.slo_requests),
                ("bridge_slo_late_total", "requests served after their deadline (the round's expected tokens at its "
                 "class's speed, from the previous result), by class", self.slo_late),
                ("bridge_slo_shed_total", "requests shed (overloaded), by class", self.slo_shed),
                ("bridge_slo_generations_total", "generations ended (close, or an open starting another), by class",
                 self.slo_generations),
                ("bridge_slo_violations_total", "generations that ran below their class's tokens/s (generated tokens "
                 "over open to last result), by class", self.slo_violations)):
            lines += [f"# HELP {name} {help_text}", f"# TYPE {name} counter"]
            lines += [f'{name}{{class="{c}"}} {n}' for c, n in sorted(counts.items(), key=lambda kv: float(kv[0]))]
        tau = (self.accepted + self.rounds) / self.rounds if self.rounds else None
        if self.drafted:
            lines += ["# HELP bridge_acceptance_rate accepted / drafted since start", "# TYPE bridge_acceptance_rate gauge",
                      f"bridge_acceptance_rate {self.accepted / self.drafted:.6f}"]
        if tau is not None:
            lines += ["# HELP bridge_tau tokens committed per verification round", "# TYPE bridge_tau gauge",
                      f"bridge_tau {tau:.6f}"]
        if self.exit_rounds:
            help_text = ("earliest exit agreeing with the result, mean over rounds with exits "
                         "(the layer count when none agreed)")
            lines += [f"# HELP bridge_avg_exit_layer {help_text}", "# TYPE bridge_avg_exit_layer gauge",
                      f"bridge_avg_exit_layer {self.exit_layer_sum / self.exit_rounds:.6f}"]
        return "\n".join(lines) + "\n"
