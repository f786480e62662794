"""The gateway's Prometheus metrics: latencies and token counts as clients see them.

Measured per completion (a request with n > 1 is n completions, as in vLLM, where each is an
engine request), from the request's arrival at the gateway: TTFT to its first token, ITL
between consecutive token chunks (a chunk holds several tokens only when the decode node
accepted speculative tokens), e2e to its finish, time per output token = (last - first token)
/ (tokens - 1). finished_reason is what the client was told ("stop", "length"), "abort" when
the client left first, "error" when the completion failed. The same samples feed the status
page's live windows (gateway/live_stats.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from prometheus_client import Counter, Gauge, Histogram

from pdserve.common.metrics import (
    REQUEST_LATENCY_BUCKETS_S,
    TOKEN_LATENCY_BUCKETS_S,
    TTFT_BUCKETS_S,
    VllmNames,
    name,
    new_registry,
    token_count_buckets,
)
from pdserve.gateway.live_stats import LiveStats

LABELS = ("role", "model_name")
VLLM_NAMES = {
    "time_to_first_token_seconds": ("time_to_first_token_seconds",),
    "inter_token_latency_seconds": (
        "inter_token_latency_seconds",
        "time_per_output_token_seconds",  # vLLM's older name of the same histogram
    ),
    "request_time_per_output_token_seconds": ("request_time_per_output_token_seconds",),
    "e2e_request_latency_seconds": ("e2e_request_latency_seconds",),
    "request_prompt_tokens": ("request_prompt_tokens",),
    "request_generation_tokens": ("request_generation_tokens",),
    "prompt_tokens": ("prompt_tokens",),
    "generation_tokens": ("generation_tokens",),
    "request_success": ("request_success",),
}
"""Request series also exposed under vLLM's names (pdserve name -> vLLM names)."""


class GatewayMetrics:
    """The gateway's registry and the live windows of its status page."""

    def __init__(self, model_name: str, num_in_flight: Callable[[], int]) -> None:
        self.registry = new_registry()
        self.live = LiveStats()
        labels = {"role": "gateway", "model_name": model_name}
        self._labels = labels

        families: list[Histogram | Counter] = []

        def histogram(metric: str, text: str, buckets: tuple[float, ...] | list[float]):
            family = Histogram(name(metric), text, LABELS, buckets=buckets, registry=self.registry)
            families.append(family)
            return family.labels(**labels)

        def counter(metric: str, text: str):
            family = Counter(name(metric), text, LABELS, registry=self.registry)
            families.append(family)
            return family.labels(**labels)

        self.ttft = histogram(
            "time_to_first_token_seconds", "From arrival to the first token.", TTFT_BUCKETS_S
        )
        self.itl = histogram(
            "inter_token_latency_seconds",
            "Between consecutive token chunks of a completion.",
            TOKEN_LATENCY_BUCKETS_S,
        )
        self.tpot = histogram(
            "request_time_per_output_token_seconds",
            "(last token - first token) / (output tokens - 1) of a completion.",
            TOKEN_LATENCY_BUCKETS_S,
        )
        self.e2e = histogram(
            "e2e_request_latency_seconds",
            "From arrival to a completion's finish.",
            REQUEST_LATENCY_BUCKETS_S,
        )
        self.prompt_tokens_per_request = histogram(
            "request_prompt_tokens", "Prompt tokens of a completion.", token_count_buckets()
        )
        self.generation_tokens_per_request = histogram(
            "request_generation_tokens", "Tokens generated for a completion.", token_count_buckets()
        )
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of finished completions.")
        self.generation_tokens = counter(
            "generation_tokens", "Tokens streamed to clients (the usage they are told)."
        )
        self.request_success = Counter(
            name("request_success"),
            "Completions finished, by finished_reason (stop, length, abort, error).",
            [*LABELS, "finished_reason"],
            registry=self.registry,
        )
        families.append(self.request_success)
        self.completions_by_version = Counter(
            name("model_version_completions"),
            "Completions finished, by the model_version of the decode node that produced them "
            "(a rolling update moves the count from one version to the next).",
            [*LABELS, "model_version"],
            registry=self.registry,
        )
        self.registry.register(VllmNames(families, VLLM_NAMES))
        in_flight = Gauge(
            name("gateway_requests_in_flight"),
            "Requests admitted and not yet answered.",
            LABELS,
            registry=self.registry,
        )
        in_flight.labels(**labels).set_function(num_in_flight)

    def sequence(self, arrival_s: float, num_prompt_tokens: int) -> SequenceTimer:
        """The timer of one completion of a request that arrived at arrival_s (monotonic)."""
        return SequenceTimer(self, arrival_s, num_prompt_tokens)

    def finished(self, finished_reason: str) -> None:
        self.request_success.labels(**self._labels, finished_reason=finished_reason).inc()

    def produced_by(self, model_version: str) -> None:
        self.completions_by_version.labels(**self._labels, model_version=model_version).inc()


class SequenceTimer:
    """One completion's latencies. on_tokens() per token chunk, finish() once."""

    def __init__(self, metrics: GatewayMetrics, arrival_s: float, num_prompt_tokens: int) -> None:
        self._metrics = metrics
        self.arrival_s = arrival_s
        self.num_prompt_tokens = num_prompt_tokens
        self.first_token_s: float | None = None
        self.last_token_s: float | None = None
        self.num_tokens = 0
        self.node = ""
        """The decode node of the latest chunk."""
        self._finished = False

    def on_tokens(self, num_tokens: int, node: str) -> None:
        now = time.monotonic()
        metrics, live = self._metrics, self._metrics.live
        node_live = live.node(node)
        if self.last_token_s is None:
            ttft = now - self.arrival_s
            self.first_token_s = now
            metrics.ttft.observe(ttft)
            live.total.ttft.add(now, ttft)
            node_live.ttft.add(now, ttft)
        else:
            itl = now - self.last_token_s
            metrics.itl.observe(itl)
            live.total.itl.add(now, itl)
            node_live.itl.add(now, itl)
        live.total.tokens.add(now, num_tokens)
        node_live.tokens.add(now, num_tokens)
        self.last_token_s = now
        self.num_tokens += num_tokens
        self.node = node

    def finish(self, finished_reason: str) -> None:
        """Record the completion's totals (only the first call counts)."""
        if self._finished:
            return
        self._finished = True
        now = time.monotonic()
        metrics = self._metrics
        e2e = now - self.arrival_s
        metrics.e2e.observe(e2e)
        metrics.prompt_tokens.inc(self.num_prompt_tokens)
        metrics.generation_tokens.inc(self.num_tokens)
        metrics.prompt_tokens_per_request.observe(self.num_prompt_tokens)
        metrics.generation_tokens_per_request.observe(self.num_tokens)
        metrics.finished(finished_reason)
        if self.first_token_s is not None and self.last_token_s is not None and self.num_tokens > 1:
            metrics.tpot.observe((self.last_token_s - self.first_token_s) / (self.num_tokens - 1))
        for scope in (metrics.live.total, metrics.live.node(self.node) if self.node else None):
            if scope is not None:
                scope.e2e.add(now, e2e)
                scope.finished.add(now)
