"""/metrics rendered by prometheus_client: the names, types and values of the hand-written page it replaced,
and a `replica` label on every sample. No model loads."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from server_bridge.engines import EngineInfo
from server_bridge.metrics import BATCH_BUCKETS, ServerMetrics

# The contract: every family of the page as the hand-written renderer wrote it (its `# TYPE` lines, in order,
# with every optional family present), plus bridge_draining. Dashboards and tools/bench/loadgen.py read these names.
FAMILIES = [
    ("bridge_engine_info", "gauge"),
    ("bridge_sessions_active", "gauge"),
    ("bridge_sessions_evicted_total", "counter"),
    ("bridge_sessions_opened_total", "counter"),
    ("bridge_connections_active", "gauge"),
    ("bridge_rounds_total", "counter"),
    ("bridge_draft_tokens_total", "counter"),
    ("bridge_accepted_tokens_total", "counter"),
    ("bridge_committed_tokens_total", "counter"),
    ("bridge_ar_tokens_total", "counter"),
    ("bridge_target_forward_passes_total", "counter"),
    ("bridge_verify_seconds_total", "counter"),
    ("bridge_exits_sent_total", "counter"),
    ("bridge_exits_dropped_total", "counter"),
    ("bridge_exits_purged_total", "counter"),
    ("bridge_exit_seconds_total", "counter"),
    ("bridge_split_residuals_total", "counter"),
    ("bridge_queue_length", "gauge"),
    ("bridge_batches_total", "counter"),
    ("bridge_batch_sessions_total", "counter"),
    ("bridge_batch_size_max", "gauge"),
    ("bridge_batch_verify_seconds_total", "counter"),
    ("bridge_engine_cpu_seconds_total", "counter"),
    ("bridge_model_thread_cpu_seconds_total", "counter"),
    ("bridge_process_cpu_seconds_total", "counter"),
    ("bridge_queue_wait_seconds_total", "counter"),
    ("bridge_bytes_in_total", "counter"),
    ("bridge_bytes_out_total", "counter"),
    ("bridge_kv_tokens_capacity", "gauge"),
    ("bridge_kv_tokens_used", "gauge"),
    ("bridge_errors_total", "counter"),
    ("bridge_batch_size", "histogram"),
    ("bridge_slo_requests_total", "counter"),
    ("bridge_slo_late_total", "counter"),
    ("bridge_slo_shed_total", "counter"),
    ("bridge_slo_generations_total", "counter"),
    ("bridge_slo_violations_total", "counter"),
    ("bridge_acceptance_rate", "gauge"),
    ("bridge_tau", "gauge"),
    ("bridge_avg_exit_layer", "gauge"),
]
NEW = [
    ("bridge_draining", "gauge"),
    ("bridge_connections_unauthenticated", "gauge"),  # peers before hello (server_bridge/peers.py)
    ("bridge_connections_refused_total", "counter"),
    ("bridge_log_lines_suppressed_total", "counter"),
]
OPTIONAL = {
    "bridge_engine_info",
    "bridge_kv_tokens_capacity",
    "bridge_kv_tokens_used",  # with an engine
    "bridge_acceptance_rate",
    "bridge_tau",
    "bridge_avg_exit_layer",
}  # once there is data


class Sessions:
    evicted_total = 5

    def __len__(self):
        return 3


class Engine:
    info = EngineInfo("llamacpp", "cpu", "float32", {"n_gpu_layers": 0})
    kv_capacity = 16384
    kv_used = 640


def counted() -> ServerMetrics:
    m = ServerMetrics()
    m.count_round(4, 3, 20.0, exit_layer=12, exit_ms=2.0)
    m.count_round(4, 1, 30.0, exit_layer=18, exit_ms=3.0)
    m.count_round(2, 2, 10.0)
    m.count_ar_token(5.0)
    for size in (1, 3, 3, 8, 9, 1000):
        m.count_batch(size, 4.0)
    m.errors["overloaded"] += 2
    m.errors["bad_token"] += 1
    m.count_request(8.0, late=True)
    m.count_request(8.0, late=False)
    m.count_request(2.5, late=False)
    m.count_shed(8.0)
    m.count_generation(8.0, tokens=10, seconds=2.0)  # 5 tok/s < 8: a violation
    m.count_generation(2.5, tokens=10, seconds=2.0)
    m.sessions_opened, m.bytes_in, m.bytes_out = 4, 1000, 2000
    return m


def families(text: str) -> dict:
    return {f.name: f for f in text_string_to_metric_families(text)}


def type_lines(text: str) -> list[tuple[str, str]]:
    return [tuple(line.split()[2:4]) for line in text.splitlines() if line.startswith("# TYPE ")]


def value(fams: dict, sample: str, **labels) -> float:
    name = sample.removesuffix("_total")
    for suffix in ("_bucket", "_count", "_sum"):
        if name not in fams and name.endswith(suffix):
            name = name.removesuffix(suffix)
    [v] = [
        s.value for s in fams[name].samples if s.name == sample and all(s.labels.get(k) == x for k, x in labels.items())
    ]
    return v


def test_every_family_of_the_old_page_with_its_type_and_the_replica_on_every_sample():
    text = counted().render(Sessions(), 2, 7, Engine(), replica="r1")
    assert type_lines(text) == FAMILIES[:5] + NEW + FAMILIES[5:]
    fams = families(text)
    assert len(fams) == len(FAMILIES) + len(NEW)
    for name, kind in FAMILIES + NEW:
        assert fams[name.removesuffix("_total") if kind == "counter" else name].type == kind
    samples = [s for f in fams.values() for s in f.samples]
    assert samples and all(s.labels["replica"] == "r1" for s in samples)
    assert not any(s.name.endswith("_created") for s in samples)


def test_the_values_are_the_counted_ones():
    m = counted()
    fams = families(m.render(Sessions(), 2, 7, Engine(), replica="r1"))
    assert value(fams, "bridge_rounds_total") == 3 and value(fams, "bridge_ar_tokens_total") == 1
    assert value(fams, "bridge_draft_tokens_total") == 10 and value(fams, "bridge_accepted_tokens_total") == 6
    assert value(fams, "bridge_committed_tokens_total") == 6 + 3 + 1
    assert value(fams, "bridge_verify_seconds_total") == pytest.approx(0.065)
    assert value(fams, "bridge_exit_seconds_total") == pytest.approx(0.005)
    assert value(fams, "bridge_sessions_active") == 3 and value(fams, "bridge_sessions_evicted_total") == 5
    assert value(fams, "bridge_sessions_opened_total") == 4 and value(fams, "bridge_connections_active") == 2
    assert value(fams, "bridge_queue_length") == 7 and value(fams, "bridge_draining") == 0
    assert value(fams, "bridge_bytes_in_total") == 1000 and value(fams, "bridge_bytes_out_total") == 2000
    assert value(fams, "bridge_batches_total") == 6 == value(fams, "bridge_target_forward_passes_total")
    assert value(fams, "bridge_batch_sessions_total") == 1 + 3 + 3 + 8 + 9 + 1000
    assert value(fams, "bridge_batch_size_max") == 1000
    assert value(fams, "bridge_batch_verify_seconds_total") == pytest.approx(0.024)
    assert value(fams, "bridge_errors_total", code="overloaded") == 2
    assert value(fams, "bridge_errors_total", code="bad_token") == 1
    assert value(fams, "bridge_slo_requests_total", **{"class": "8"}) == 2
    assert value(fams, "bridge_slo_requests_total", **{"class": "2.5"}) == 1
    assert value(fams, "bridge_slo_late_total", **{"class": "8"}) == 1
    assert value(fams, "bridge_slo_shed_total", **{"class": "8"}) == 1
    assert value(fams, "bridge_slo_generations_total", **{"class": "8"}) == 1
    assert value(fams, "bridge_slo_violations_total", **{"class": "8"}) == 1
    assert value(fams, "bridge_slo_violations_total", **{"class": "2.5"}) == 0
    assert value(fams, "bridge_acceptance_rate") == pytest.approx(0.6)
    assert value(fams, "bridge_tau") == pytest.approx((6 + 3) / 3)
    assert value(fams, "bridge_avg_exit_layer") == pytest.approx(15)
    assert value(fams, "bridge_kv_tokens_capacity") == 16384 and value(fams, "bridge_kv_tokens_used") == 640
    [info] = fams["bridge_engine_info"].samples
    assert info.value == 1 and info.labels == {
        "engine": "llamacpp",
        "device": "cpu",
        "dtype": "float32",
        "n_gpu_layers": "0",
        "replica": "r1",
    }


def test_the_batch_size_histogram_is_cumulative_with_sum_and_count():
    fams = families(counted().render(Sessions(), 0, replica="r1"))
    buckets = [
        (s.labels["le"], s.value) for s in fams["bridge_batch_size"].samples if s.name == "bridge_batch_size_bucket"
    ]
    assert [le for le, _ in buckets] == [str(b) for b in BATCH_BUCKETS] + ["+Inf"]
    # sizes 1, 3, 3, 8, 9, 1000: le=1 holds 1, le=2 1, le=4 3, le=8 4, le=16 .. 512 5, le=1024 and +Inf 6
    assert [v for _, v in buckets] == [1, 1, 3, 4, 5, 5, 5, 5, 5, 5, 6, 6]
    assert value(fams, "bridge_batch_size_count") == 6 and value(fams, "bridge_batch_size_sum") == 1024


def test_a_fresh_server_without_an_engine_or_data_renders_the_rest_and_labels_replica_empty():
    text = ServerMetrics().render(Sessions(), 0)
    assert type_lines(text) == [f for f in FAMILIES[:5] + NEW + FAMILIES[5:] if f[0] not in OPTIONAL]
    samples = [s for f in text_string_to_metric_families(text) for s in f.samples]
    assert all(s.labels["replica"] == "" for s in samples)
    assert 'bridge_rounds_total{replica=""} 0.0' in text
    fams = families(text)
    assert fams["bridge_errors"].samples == [] and fams["bridge_slo_requests"].samples == []
    assert [s.value for s in fams["bridge_batch_size"].samples] == [0] * (len(BATCH_BUCKETS) + 1) + [0, 0]


def test_draining_is_a_gauge_of_one():
    fams = families(ServerMetrics().render(Sessions(), 0, replica="r1", draining=True))
    assert fams["bridge_draining"].type == "gauge" and value(fams, "bridge_draining") == 1


def test_each_render_has_its_own_registry():
    """Many servers in one process (the tests) each render their own page: nothing global, no duplicates."""
    a, b = counted(), ServerMetrics()
    for _ in range(3):
        assert value(families(a.render(Sessions(), 0, replica="a")), "bridge_rounds_total") == 3
        assert value(families(b.render(Sessions(), 0, replica="b")), "bridge_rounds_total") == 0
