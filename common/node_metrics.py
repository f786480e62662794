"""A prefill or decode node's Prometheus metrics (what each one means: pdserve/metrics.py).

Engine gauges and counters are read from the engine at scrape time by EngineCollector: plain
int and float reads from the scrape thread (at worst one step stale), so the engine thread
does no metrics work. Per-request histograms are observed once per request on the event loop;
KV transfer series once per transfer.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import Counter, Histogram
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from pdserve.common.metrics import (
    KV_TRANSFER_BUCKETS_S,
    REQUEST_LATENCY_BUCKETS_S,
    VllmNames,
    name,
    new_registry,
)
from pdserve.common.request_times import RequestTimes
from pdserve.engine.llm_engine import LLMEngine
from pdserve.kvtransfer.transport import TransferStats

LABELS = ("role", "model_name", "node_id")
VLLM_NAMES = {
    "num_requests_running": ("num_requests_running",),
    "num_requests_waiting": ("num_requests_waiting",),
    "kv_cache_usage_perc": ("kv_cache_usage_perc", "gpu_cache_usage_perc"),
    "num_preemptions": ("num_preemptions",),
    "prefix_cache_queries": ("prefix_cache_queries",),
    "prefix_cache_hits": ("prefix_cache_hits",),
}
"""Engine series also exposed under vLLM's names (pdserve name -> vLLM names; the gateway
exposes the request series)."""
_SPEC_COUNTERS = (
    ("num_drafts", "Speculative verifications (requests x steps that verified drafts)."),
    ("num_draft_tokens", "Draft tokens verified."),
    ("num_accepted_tokens", "Draft tokens accepted."),
)


class EngineCollector(Collector):
    """The engine's own gauges and counters, read when Prometheus scrapes."""

    def __init__(self, engine: LLMEngine, labels: dict[str, str]) -> None:
        self._engine = engine
        self._values = [labels[n] for n in LABELS]

    def collect(self) -> Iterator[Metric]:
        engine = self._engine
        load = engine.load()
        yield self._gauge(
            "num_requests_running", "Requests in the running batch.", load.num_running
        )
        yield self._gauge(
            "num_requests_waiting", "Requests queued for admission.", load.num_waiting
        )
        yield self._gauge(
            "num_requests_waiting_for_remote_kv",
            "Decode role: admitted requests waiting for their KV from a prefill node.",
            load.num_awaiting_kv,
        )
        yield self._gauge(
            "remote_prefill_backlog_tokens",
            "Decode role: uncached prompt tokens of requests waiting for KV from prefill nodes.",
            load.remote_prefill_backlog,
        )
        yield self._gauge(
            "local_prefill_backlog_tokens",
            "Prompt tokens of running requests still to be computed on this node.",
            load.local_prefill_backlog,
        )
        yield self._gauge(
            "kv_cache_usage_perc",
            "Fraction of KV blocks held by requests (0 to 1).",
            load.kv_cache_usage,
        )
        yield self._counter(
            "prompt_tokens",
            "Prompt tokens computed by this engine (prefix-cache hits and KV received excluded).",
            load.num_prompt_tokens,
        )
        yield self._counter(
            "generation_tokens",
            "Tokens sampled by this engine (decode: remote first tokens included).",
            load.num_generation_tokens,
        )
        yield self._counter("num_preemptions", "Requests preempted.", load.num_preemptions)
        yield self._counter(
            "prefix_cache_queries",
            "Tokens looked up in the prefix cache.",
            load.prefix_cache_queries,
        )
        yield self._counter(
            "prefix_cache_hits", "Tokens found in the prefix cache.", load.prefix_cache_hits
        )
        # Present only once the engine has speculative decoding (and only when it is on).
        spec = getattr(engine, "spec_stats", None)
        if spec is not None:
            for field, text in _SPEC_COUNTERS:
                yield self._counter(f"spec_decode_{field}", text, getattr(spec, field, 0))

    def _gauge(self, metric: str, text: str, value: float) -> GaugeMetricFamily:
        family = GaugeMetricFamily(name(metric), text, labels=LABELS)
        family.add_metric(self._values, value)
        return family

    def _counter(self, metric: str, text: str, value: float) -> CounterMetricFamily:
        family = CounterMetricFamily(name(metric), text, labels=LABELS)
        family.add_metric(self._values, value)
        return family


class NodeMetrics:
    """The registry of one node: engine series plus per-request phases and KV transfers."""

    def __init__(self, engine: LLMEngine, role: str, model_name: str, node_id: str) -> None:
        self.role = role
        self.registry = new_registry()
        labels = {"role": role, "model_name": model_name, "node_id": node_id}
        engine_collector = EngineCollector(engine, labels)
        self.registry.register(engine_collector)
        self.registry.register(VllmNames([engine_collector], VLLM_NAMES))
        self.queue_time = self._histogram(
            "request_queue_time_seconds",
            "From the request's arrival at this node to its first scheduling.",
            REQUEST_LATENCY_BUCKETS_S,
        ).labels(**labels)
        self.prefill_time = self._histogram(
            "request_prefill_time_seconds",
            "From first scheduling to the first token (decode: remote prefill and KV included).",
            REQUEST_LATENCY_BUCKETS_S,
        ).labels(**labels)
        self.decode_time = self._histogram(
            "request_decode_time_seconds",
            "From the first token to the last (decode role).",
            REQUEST_LATENCY_BUCKETS_S,
        )
        self.request_success = Counter(
            name("request_success"),
            "Requests finished at this node (decode role), by finished_reason.",
            [*LABELS, "finished_reason"],
            registry=self.registry,
        )
        self._labels = labels
        self.kv_bytes = Counter(
            name("kv_transfer_bytes"),
            "KV payload bytes sent (prefill role) or received (decode role).",
            LABELS,
            registry=self.registry,
        ).labels(**labels)
        self.kv_seconds = self._histogram(
            "kv_transfer_seconds",
            "One request's KV transfer, from its first message to its last.",
            KV_TRANSFER_BUCKETS_S,
        ).labels(**labels)
        self.kv_failures = Counter(
            name("kv_transfer_failures"),
            "KV transfers that failed (error, timeout, layout mismatch).",
            LABELS,
            registry=self.registry,
        ).labels(**labels)

    def _histogram(self, metric: str, text: str, buckets: tuple[float, ...]) -> Histogram:
        return Histogram(name(metric), text, LABELS, buckets=buckets, registry=self.registry)

    def observe_phases(self, times: RequestTimes) -> None:
        """The phases of a request that reached them (queue, prefill; decode if finished)."""
        if times.queue_s is not None:
            self.queue_time.observe(times.queue_s)
        if times.prefill_s is not None:
            self.prefill_time.observe(times.prefill_s)
        if times.decode_s is not None:
            self.decode_time.labels(**self._labels).observe(times.decode_s)

    def observe_finished(self, finished_reason: str) -> None:
        self.request_success.labels(**self._labels, finished_reason=finished_reason).inc()

    def observe_transfer(self, stats: TransferStats) -> None:
        self.kv_bytes.inc(stats.bytes)
        self.kv_seconds.observe(stats.seconds)

    def transfer_failed(self) -> None:
        self.kv_failures.inc()
