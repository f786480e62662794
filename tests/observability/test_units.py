"""The observability pieces alone, on fakes and fixed clocks: bucket edges, the status page's
windows, the gateway's per-completion timer, the engine collector, and tracing switched
off."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from pdserve.common import tracing
from pdserve.common.metrics import new_registry, token_count_buckets
from pdserve.common.node_metrics import EngineCollector
from pdserve.engine.outputs import EngineLoad
from pdserve.gateway import metrics as gateway_metrics
from pdserve.gateway.live_stats import LatencyWindow, RateWindow
from pdserve.gateway.metrics import GatewayMetrics


class Clock:
    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_token_count_buckets_are_1_2_5():
    assert token_count_buckets(1000) == [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000]


def test_latency_window_nearest_rank_over_the_last_minute():
    window = LatencyWindow(window_s=60.0)
    window.add(0.0, 9.0)  # falls out of the window below
    for i in range(1, 11):
        window.add(10.0 + i, i / 10)
    assert window.summary(61.0) == {"count": 10, "p50": 0.5, "p90": 0.9, "p99": 1.0}
    assert window.summary(200.0) == {"count": 0, "p50": None, "p90": None, "p99": None}


def test_rate_window_counts_whole_seconds_only():
    rates = RateWindow(window_s=10)
    rates.add(100.2, 30)
    rates.add(100.9, 10)
    rates.add(101.5, 20)
    assert rates.per_second(101.7) == 4.0  # second 101 is still running
    assert rates.per_second(102.0) == 6.0
    assert rates.per_second(115.0) == 0.0


def test_sequence_timer_measures_what_the_client_sees(monkeypatch):
    clock = Clock(1.0)
    monkeypatch.setattr(gateway_metrics.time, "monotonic", clock)
    metrics = GatewayMetrics("m", lambda: 3)
    timer = metrics.sequence(arrival_s=0.5, num_prompt_tokens=7)
    for now, tokens in ((1.0, 1), (1.25, 1), (1.75, 2)):
        clock.now = now
        timer.on_tokens(tokens, "decode:1")
    clock.now = 2.0
    timer.finish("length")
    timer.finish("abort")  # only the first finish counts

    def value(name: str, **labels: str) -> float | None:
        return metrics.registry.get_sample_value(
            f"pdserve:{name}", {"role": "gateway", "model_name": "m", **labels}
        )

    assert value("time_to_first_token_seconds_sum") == 0.5
    assert value("inter_token_latency_seconds_count") == 2
    assert value("inter_token_latency_seconds_sum") == 0.75
    assert value("e2e_request_latency_seconds_sum") == 1.5
    assert value("request_time_per_output_token_seconds_sum") == 0.25  # 0.75 s / 3 gaps
    assert value("generation_tokens_total") == 4 and value("prompt_tokens_total") == 7
    assert value("request_success_total", finished_reason="length") == 1
    assert value("request_success_total", finished_reason="abort") is None
    assert value("gateway_requests_in_flight") == 3
    node = metrics.live.node("decode:1").summary(2.0)
    assert node["ttft_s"]["p50"] == 0.5 and node["e2e_s"]["count"] == 1


def fake_engine(spec_stats=None):
    """An engine whose load() reads the mutable `state` when called (as a scrape does)."""
    state = SimpleNamespace(
        num_running=2,
        num_waiting=1,
        num_awaiting_kv=1,
        remote_prefill_backlog=512,
        local_prefill_backlog=96,
        num_free_blocks=30,
        num_total_blocks=40,
        kv_cache_usage=0.25,
        num_preemptions=4,
        prefix_cache_queries=100,
        prefix_cache_hits=40,
        num_prompt_tokens=300,
        num_generation_tokens=50,
    )
    engine = SimpleNamespace(state=state, spec_stats=spec_stats)
    engine.load = lambda: EngineLoad(**vars(state))
    return engine


@pytest.mark.parametrize("speculative", [False, True])
def test_engine_collector_reads_the_engine_at_scrape_time(speculative):
    spec = SimpleNamespace(num_drafts=3, num_draft_tokens=9, num_accepted_tokens=5)
    engine = fake_engine(spec if speculative else None)
    registry = new_registry()
    labels = {"role": "decode", "model_name": "m", "node_id": "d0"}
    registry.register(EngineCollector(engine, labels))
    engine.state.num_running = 5  # read when scraped, not when registered
    expected = {
        "num_requests_running": 5,
        "num_requests_waiting": 1,
        "num_requests_waiting_for_remote_kv": 1,
        "remote_prefill_backlog_tokens": 512,
        "local_prefill_backlog_tokens": 96,
        "kv_cache_usage_perc": 0.25,
        "prompt_tokens_total": 300,
        "generation_tokens_total": 50,
        "num_preemptions_total": 4,
        "prefix_cache_queries_total": 100,
        "prefix_cache_hits_total": 40,
    }
    for name, value in expected.items():
        assert registry.get_sample_value(f"pdserve:{name}", labels) == value, name
    accepted = registry.get_sample_value("pdserve:spec_decode_num_accepted_tokens_total", labels)
    assert accepted == (5 if speculative else None)


def test_tracing_off_costs_nothing(monkeypatch):
    for name in ("OTEL_TRACES_EXPORTER", "OTEL_EXPORTER_OTLP_ENDPOINT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", raising=False)
    assert not tracing.setup("gateway", "g0") and not tracing.enabled()
    span = tracing.start_span("x", None)
    assert not span.is_recording()
    assert tracing.context_of(span) is None
    assert tracing.inject(None) == {} and tracing.grpc_metadata(None) is None
    assert tracing.extract({"traceparent": "00-" + "1" * 32 + "-" + "2" * 16 + "-01"}) is None
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "none")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:1")
    assert not tracing.setup("gateway", "g0")
