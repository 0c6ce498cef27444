"""Server counters, and /metrics: their Prometheus text page.

`ServerMetrics` is where the server counts (the `count_*` methods, the error Counter). `render` turns
the counters into the Prometheus text format (0.0.4) with `prometheus_client`, as vLLM does: a custom
collector yields each family at scrape time into a private `CollectorRegistry` (never the global one:
one process may run many servers, as the tests do) and `generate_latest` writes the page.

Every sample carries a `replica` label, the replica id of the server process (`replica_id`; HOST:PORT
by default), so one Prometheus can scrape every replica directly, without a balancer in between, and
sum or compare them. A render without a replica id labels its samples replica="" (Prometheus reads an
empty label as no label): the label is always there, so a consumer can rely on it.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from .engines.types import EngineInfo

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


def _label(slo: float) -> str:
    """An SLO class as a metrics label: 8.0 -> '8', 2.5 -> '2.5', 0 -> '0' (best effort)."""
    return f"{slo:g}"


@dataclass
class ServerMetrics:
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    committed: int = 0  # tokens committed by verify rounds and ar steps
    target_forward_passes: int = 0
    verify_ms_sum: float = 0.0
    ar_tokens: int = 0
    sessions_opened: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    errors: Counter = field(default_factory=Counter)
    exits_sent: int = 0  # early-exit messages sent
    exits_dropped: int = 0  # dropped by a full per-connection outbox
    exits_purged: int = 0  # still pending when their round's result went out
    exit_ms_sum: float = 0.0  # time in exit heads (part of verify_ms_sum)
    exit_rounds: int = 0  # rounds that ran exits
    exit_layer_sum: int = 0  # over those rounds: the earliest exit that agreed with the result
    residuals_sent: int = 0  # split rejections answered with the target's p_j
    # Peers (server_bridge/peers.py): connections closed or refused before or at hello, by reason
    # (address_cap, evicted, hello_timeout, error_before_hello, busy, unauthorized), log lines held back
    refused: Counter = field(default_factory=Counter)
    log_lines_suppressed: int = 0
    # Batched verification (server_bridge/batcher.py)
    batches: int = 0  # forward passes run by the batcher
    batch_sessions: int = 0  # sessions over those passes (mean batch size = batch_sessions / batches)
    batch_size_max: int = 0
    batch_sizes: Counter = field(default_factory=Counter)  # histogram: le bucket -> passes
    pass_ms_sum: float = 0.0  # time in those passes
    engine_cpu_s: float = 0.0  # the model thread's CPU inside them (Verifier.engine_cpu_s, copied at a scrape)
    model_cpu_s: float = 0.0  # the model thread's CPU in all (Verifier.model_cpu_s): passes, checks, verdicts
    queue_wait_s: float = 0.0  # time requests waited for a batch, summed
    slo_requests: Counter = field(default_factory=Counter)  # class (tokens/s) -> requests served
    slo_late: Counter = field(default_factory=Counter)  # class -> served after their deadline
    slo_shed: Counter = field(default_factory=Counter)  # class -> shed (`overloaded`)
    slo_generations: Counter = field(default_factory=Counter)  # class -> generations ended (close or a new open)
    slo_violations: Counter = field(default_factory=Counter)  # class -> of those, slower than their class

    def count_batch(self, size: int, ms: float) -> None:
        self.batches += 1
        self.target_forward_passes += 1  # a batch is one pass, however many sessions ride in it
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

    def count_round(
        self, drafted: int, accepted: int, ms: float, exit_layer: int | None = None, exit_ms: float = 0.0
    ) -> None:
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

    def render(
        self,
        sessions: SessionCounts,
        connections: int,
        queue_length: int = 0,
        engine: EngineGauges | None = None,
        *,
        replica: str = "",
        draining: bool = False,
        unauthenticated: int = 0,
    ) -> str:
        """The /metrics page: sessions needs len() and .evicted_total; engine (or None) .info, .kv_capacity
        and .kv_used; replica labels every sample; draining is bridge_draining's 0/1; connections counts
        the authenticated ones, unauthenticated those still before hello."""
        registry = CollectorRegistry()  # one per scrape, private: no global state, no duplicates
        registry.register(
            _Scrape(self, sessions, connections, queue_length, engine, replica, draining, unauthenticated)
        )
        return generate_latest(registry).decode()


class SessionCounts(Protocol):
    """What a scrape reads of the session table."""

    evicted_total: int

    def __len__(self) -> int: ...


class EngineGauges(Protocol):
    """What a scrape reads of the engine."""

    info: EngineInfo
    kv_capacity: int

    @property
    def kv_used(self) -> int: ...


F = TypeVar("F", GaugeMetricFamily, CounterMetricFamily)


class _Scrape(Collector):
    """One scrape's families, in the page's order, every sample labelled with the replica."""

    def __init__(
        self,
        metrics: ServerMetrics,
        sessions: SessionCounts,
        connections: int,
        queue_length: int,
        engine: EngineGauges | None,
        replica: str,
        draining: bool,
        unauthenticated: int = 0,
    ):
        self.m, self.sessions, self.connections, self.queue_length = metrics, sessions, connections, queue_length
        self.engine, self.replica, self.draining = engine, replica, draining
        self.unauthenticated = unauthenticated

    def _one(self, family: F, value: float) -> F:
        family.add_metric([self.replica], value)
        return family

    def _gauge(self, name: str, help_text: str, value: float) -> GaugeMetricFamily:
        return self._one(GaugeMetricFamily(name, help_text, labels=["replica"]), value)

    def _counter(self, name: str, help_text: str, value: float) -> CounterMetricFamily:
        # CounterMetricFamily strips `_total` from the family's name and writes it back on the sample
        return self._one(CounterMetricFamily(name.removesuffix("_total"), help_text, labels=["replica"]), value)

    def _by(self, name: str, help_text: str, label: str, counts: Iterable[tuple[str, float]]) -> CounterMetricFamily:
        family = CounterMetricFamily(name.removesuffix("_total"), help_text, labels=[label, "replica"])
        for key, n in counts:
            family.add_metric([key, self.replica], n)
        return family

    def collect(self) -> Iterator[Metric]:
        """Every metric, in the order /metrics lists them."""
        yield from self._engine_info()
        yield from self._peer_metrics()
        yield from self._round_metrics()
        yield from self._pass_metrics()
        yield from self._slo_metrics()
        yield from self._ratio_metrics()

    def _engine_info(self) -> Iterator[Metric]:
        """The engine that serves, as an info metric (value 1)."""
        engine = self.engine
        if engine is not None:  # an info metric, as Prometheus exporters name their build
            info = {k: str(v) for k, v in engine.info.as_dict().items() if k != "replica"}
            family = GaugeMetricFamily(
                "bridge_engine_info", "the engine that serves (value 1)", labels=[*info, "replica"]
            )
            family.add_metric([*info.values(), self.replica], 1)
            yield family

    def _peer_metrics(self) -> Iterator[Metric]:
        """Sessions, connections and what was refused."""
        m = self.m
        yield self._gauge("bridge_sessions_active", "open sessions", len(self.sessions))
        yield self._counter(
            "bridge_sessions_evicted_total", "sessions evicted (idle or table full)", self.sessions.evicted_total
        )
        yield self._counter("bridge_sessions_opened_total", "open and re-open requests served", m.sessions_opened)
        yield self._gauge("bridge_connections_active", "authenticated connections (past hello)", self.connections)
        yield self._gauge(
            "bridge_draining",
            "1 while the replica drains after SIGTERM: no new robots, rounds in flight finish",
            int(self.draining),
        )
        yield self._gauge(
            "bridge_connections_unauthenticated", "connections before hello (TCP accepted)", self.unauthenticated
        )
        yield self._by(
            "bridge_connections_refused_total",
            "connections closed or refused before or at hello, by reason",
            "reason",
            sorted(m.refused.items()),
        )
        yield self._counter(
            "bridge_log_lines_suppressed_total",
            "log lines held back by the per-connection (and unauthenticated peers') rate limit",
            m.log_lines_suppressed,
        )

    def _round_metrics(self) -> Iterator[Metric]:
        """Rounds, tokens, verification time, early exits, split residuals."""
        m = self.m
        yield self._counter("bridge_rounds_total", "verification rounds", m.rounds)
        yield self._counter("bridge_draft_tokens_total", "draft tokens received for verification", m.drafted)
        yield self._counter("bridge_accepted_tokens_total", "draft tokens accepted", m.accepted)
        yield self._counter("bridge_committed_tokens_total", "tokens committed (rounds and ar)", m.committed)
        yield self._counter("bridge_ar_tokens_total", "target-only tokens streamed", m.ar_tokens)
        yield self._counter("bridge_target_forward_passes_total", "target forward passes", m.target_forward_passes)
        yield self._counter(
            "bridge_verify_seconds_total",
            "verification time summed over rounds and ar tokens (a "
            "batched pass counts once per session in it; bridge_batch_verify_seconds_total counts "
            "it once)",
            m.verify_ms_sum / 1e3,
        )
        yield self._counter("bridge_exits_sent_total", "early-exit messages sent", m.exits_sent)
        yield self._counter(
            "bridge_exits_dropped_total", "early-exit messages dropped by a full outbox", m.exits_dropped
        )
        yield self._counter(
            "bridge_exits_purged_total", "early-exit messages still pending when their result went out", m.exits_purged
        )
        yield self._counter(
            "bridge_exit_seconds_total", "time in early-exit heads (part of verify time)", m.exit_ms_sum / 1e3
        )
        yield self._counter(
            "bridge_split_residuals_total",
            "split rounds rejected: p_j sent for the robot to resample",
            m.residuals_sent,
        )

    def _pass_metrics(self) -> Iterator[Metric]:
        """The queue, the batched passes, the bytes, the KV memory and the errors."""
        m, engine = self.m, self.engine
        yield self._gauge("bridge_queue_length", "requests waiting for the target", self.queue_length)
        yield self._counter("bridge_batches_total", "batched forward passes", m.batches)
        yield self._counter("bridge_batch_sessions_total", "sessions verified in batched passes", m.batch_sessions)
        yield self._gauge("bridge_batch_size_max", "largest batch so far", m.batch_size_max)
        yield self._counter("bridge_batch_verify_seconds_total", "time in batched forward passes", m.pass_ms_sum / 1e3)
        yield self._counter(
            "bridge_engine_cpu_seconds_total", "the model thread's CPU time inside the passes", m.engine_cpu_s
        )
        yield self._counter(
            "bridge_model_thread_cpu_seconds_total",
            "the model thread's CPU time: the passes, each request's checks, verdicts and commits",
            m.model_cpu_s,
        )
        yield self._counter(
            "bridge_process_cpu_seconds_total",
            "the server process's CPU time, every thread (minus the engine's: the server's own work)",
            time.process_time(),
        )
        yield self._counter("bridge_queue_wait_seconds_total", "time requests waited for a batch", m.queue_wait_s)
        yield self._counter("bridge_bytes_in_total", "websocket payload bytes received", m.bytes_in)
        yield self._counter("bridge_bytes_out_total", "websocket payload bytes sent", m.bytes_out)
        if engine is not None:
            yield self._gauge("bridge_kv_tokens_capacity", "KV memory of the engine, in tokens", engine.kv_capacity)
            yield self._gauge("bridge_kv_tokens_used", "KV tokens held by open sessions", engine.kv_used)
        yield self._by("bridge_errors_total", "error messages sent, by code", "code", sorted(m.errors.items()))
        running, buckets = 0, []
        for bucket in BATCH_BUCKETS:  # cumulative, as Prometheus histograms are
            running += m.batch_sizes[bucket]
            buckets.append((str(bucket), running))
        histogram = HistogramMetricFamily("bridge_batch_size", "sessions per batched forward pass", labels=["replica"])
        histogram.add_metric([self.replica], buckets + [("+Inf", m.batches)], sum_value=m.batch_sessions)
        yield histogram  # _bucket{le=...}, _count (the +Inf bucket) and _sum

    def _slo_metrics(self) -> Iterator[Metric]:
        """Requests and generations by SLO class."""
        m = self.m
        for name, help_text, counts in (
            ("bridge_slo_requests_total", "requests served, by SLO class (tokens/s; 0 = none)", m.slo_requests),
            (
                "bridge_slo_late_total",
                "requests served after their deadline (the round's expected tokens at its "
                "class's speed, from the previous result), by class",
                m.slo_late,
            ),
            ("bridge_slo_shed_total", "requests shed (overloaded), by class", m.slo_shed),
            (
                "bridge_slo_generations_total",
                "generations ended (close, or an open starting another), by class",
                m.slo_generations,
            ),
            (
                "bridge_slo_violations_total",
                "generations that ran below their class's tokens/s (generated tokens "
                "over open to last result), by class",
                m.slo_violations,
            ),
        ):
            yield self._by(name, help_text, "class", sorted(counts.items(), key=lambda kv: float(kv[0])))

    def _ratio_metrics(self) -> Iterator[Metric]:
        """Acceptance, tau and the mean exit layer, once there is something to divide by."""
        m = self.m
        if m.drafted:
            yield self._gauge("bridge_acceptance_rate", "accepted / drafted since start", m.accepted / m.drafted)
        if m.rounds:
            yield self._gauge(
                "bridge_tau", "tokens committed per verification round", (m.accepted + m.rounds) / m.rounds
            )
        if m.exit_rounds:
            yield self._gauge(
                "bridge_avg_exit_layer",
                "earliest exit agreeing with the result, mean over rounds with "
                "exits (the layer count when none agreed)",
                m.exit_layer_sum / m.exit_rounds,
            )
