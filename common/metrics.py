"""Prometheus metrics shared by every pdserve process: names, bucket edges, registries and the
HTTP server of a node's /metrics.

Names are prefixed ``pdserve:`` and mirror vLLM's where the meaning matches. Every series has
the labels ``role`` ("gateway", "prefill", "decode") and ``model_name``; node series also
``node_id``. Each meaning is measured in exactly one place, so a sum over targets never counts
a thing twice:

- gateway: what clients see, per completion: time_to_first_token_seconds,
  inter_token_latency_seconds, request_time_per_output_token_seconds,
  e2e_request_latency_seconds, request_prompt_tokens, request_generation_tokens,
  prompt_tokens, generation_tokens, request_success{finished_reason} (gateway/metrics.py).
- decode node: its engine (num_requests_running/waiting, remote/local_prefill_backlog_tokens,
  kv_cache_usage_perc, tokens computed, num_preemptions, prefix cache, spec decode) and, per
  request, the phases at the node:
  request_queue_time_seconds (arrival to blocks reserved), request_prefill_time_seconds
  (to the first token, remote or local), request_decode_time_seconds (first to last token),
  request_success{finished_reason}; KV transfers received (pdserve/node_metrics.py).
- prefill node: its engine, queue and prefill compute time per request, KV transfers sent.

Engine series are read at scrape time; the engine thread does no metrics work per token.

Beside them, VllmNames re-exposes the series that vLLM also has under vLLM's own names and
labels (``vllm:time_to_first_token_seconds{model_name}``, ...), read from the same samples at
scrape time, so dashboards, autoscalers and routers built for vLLM work unchanged. Request
series come from the gateway, engine series from the nodes (deploy/README.md lists them).
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Iterable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    GCCollector,
    PlatformCollector,
    ProcessCollector,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

logger = logging.getLogger(__name__)

PREFIX = "pdserve:"
VLLM_PREFIX = "vllm:"
VLLM_LABELS = frozenset({"model_name", "finished_reason", "le"})
"""The labels vLLM's series carry (le: histogram buckets); role and node_id are dropped."""
CONTENT_TYPE = CONTENT_TYPE_LATEST

# The *_created series double every counter and histogram and no dashboard reads them.
disable_created_metrics()

TTFT_BUCKETS_S = (
    0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0,
)  # fmt: skip
"""Time to first token: 1 ms (a GPU, short prompt) to 160 s (a CPU, long prompt, queued)."""
TOKEN_LATENCY_BUCKETS_S = (
    0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1,
    0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
"""Inter-token latency and time per output token."""
REQUEST_LATENCY_BUCKETS_S = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
    10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0,
)  # fmt: skip
"""Whole requests and their phases (queue, prefill, decode)."""
KV_TRANSFER_BUCKETS_S = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
    1.0, 2.5, 5.0, 10.0,
)  # fmt: skip
"""One request's KV transfer: from its first message to its last."""
MAX_TOKEN_COUNT_BUCKET = 200_000


def name(metric: str) -> str:
    """The exposed name of a metric: "ttft" -> "pdserve:ttft"."""
    return PREFIX + metric


class VllmNames(Collector):
    """Re-exposes some of sources' families under vLLM's names: pdserve:X becomes vllm:Y for
    each Y in names[X], samples and values unchanged, labels cut to VLLM_LABELS. Reads the
    sources at scrape time (they must not be this registry itself)."""

    def __init__(self, sources: Iterable[Collector], names: dict[str, tuple[str, ...]]) -> None:
        self._sources = list(sources)
        self._names = names

    def collect(self) -> Iterator[Metric]:
        for source in self._sources:
            for family in source.collect():
                for target in self._names.get(family.name.removeprefix(PREFIX), ()):
                    yield _renamed(family, VLLM_PREFIX + target)


def _renamed(family: Metric, new_name: str) -> Metric:
    out = Metric(new_name, family.documentation, family.type, family.unit)
    for sample in family.samples:
        labels = {k: v for k, v in sample.labels.items() if k in VLLM_LABELS}
        suffix = sample.name[len(family.name) :]  # _total, _bucket, _sum, _count
        out.add_sample(new_name + suffix, labels, sample.value, sample.timestamp)
    return out


def token_count_buckets(max_value: int = MAX_TOKEN_COUNT_BUCKET) -> list[float]:
    """1, 2, 5, 10, 20, 50, ... up to max_value (vLLM's build_1_2_5_buckets)."""
    buckets: list[float] = []
    exponent = 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > max_value:
                return buckets
            buckets.append(value)
        exponent += 1


def new_registry() -> CollectorRegistry:
    """A registry of one process's metrics, with the standard process_* and python_* series.
    Each gateway or node owns its own (several may live in one test process)."""
    registry = CollectorRegistry()
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    GCCollector(registry=registry)
    return registry


def exposition(registry: CollectorRegistry) -> bytes:
    """The registry in Prometheus text format (serve it with CONTENT_TYPE)."""
    return generate_latest(registry)


def advertised_address(host: str, port: int) -> str:
    """host:port as others reach it: a wildcard bind is advertised by the host's name."""
    if host in ("", "0.0.0.0", "::"):
        host = socket.getfqdn()
    return f"{host}:{port}"


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True


class _HTTPServer6(_HTTPServer):
    address_family = socket.AF_INET6


def _handler(registry: CollectorRegistry) -> type[BaseHTTPRequestHandler]:
    class MetricsHandler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            if self.path.split("?")[0] != "/metrics":
                self.send_error(404, "only /metrics is served here")
                return
            body = exposition(registry)
            self.send_response(200)
            self.send_header("Content-Type", CONTENT_TYPE)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            pass  # one line per scrape would drown the node's log

    return MetricsHandler


class MetricsServer:
    """A node's /metrics on a port of its own, served from a thread of its own: a scrape
    runs neither on the event loop nor on the engine thread.

    Always the classic text format: prometheus_client's OpenMetrics writer (what its own
    server negotiates with Prometheus) turns the colon of `pdserve:` into `_` in sample lines.
    """

    def __init__(self, registry: CollectorRegistry, host: str, port: int) -> None:
        self._registry = registry
        self._host = host
        self._port = port
        self._server: _HTTPServer | None = None
        self.address = ""
        """host:port once started ("" while stopped)."""

    def start(self) -> str:
        """Listen (port 0: any free one); returns the advertised host:port."""
        server_class = _HTTPServer6 if ":" in self._host else _HTTPServer
        server = server_class((self._host, self._port), _handler(self._registry))
        threading.Thread(target=server.serve_forever, name="metrics", daemon=True).start()
        self._server = server
        self.address = advertised_address(self._host, server.server_port)
        logger.info("Prometheus metrics on http://%s/metrics", self.address)
        return self.address

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
            self.address = ""
