"""A prefill node's per-request telemetry: the phase and KV transfer metrics and the spans.

Spans of one request here (children of the decode node's decode.remote_prefill call, whose
context arrives in the gRPC metadata):

    prefill.prefill         the whole Prefill call (SERVER); event "first_token"
      prefill.queue         arrival -> first scheduled (dated from RequestTimes)
      prefill.compute       first scheduled -> first token sampled (all prompt chunks)
      kv.send               first KV message sent -> last one delivered

The KV header carries prefill.prefill's context, so the decode node's kv.receive span hangs
under it too.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from opentelemetry.trace import SpanKind

from pdserve.common import tracing
from pdserve.common.node_metrics import NodeMetrics
from pdserve.common.request_times import RequestTimes
from pdserve.kvtransfer.transport import TransferStats


class PrefillRequestTelemetry:
    """One Prefill call's timestamps and root span."""

    def __init__(
        self,
        telemetry: PrefillTelemetry,
        request_id: str,
        num_prompt_tokens: int,
        metadata: Iterable[tuple[str, str | bytes]] | None,
    ) -> None:
        self._metrics = telemetry.metrics
        self.times = RequestTimes(arrival_s=time.monotonic())
        self.num_prompt_tokens = num_prompt_tokens
        self.num_cached_tokens = 0
        attributes = {
            "pdserve.request_id": request_id,
            "pdserve.node_id": telemetry.node_id,
            "pdserve.prompt_tokens": num_prompt_tokens,
        }
        parent = tracing.context_from_grpc(metadata)
        self.span = tracing.start_span("prefill.prefill", parent, SpanKind.SERVER, attributes)
        self.context = tracing.context_of(self.span)

    def push_context(self) -> dict[str, str]:
        """The W3C context the KV headers carry ({} when tracing is off)."""
        return tracing.inject(self.context)

    def first_token(self, num_cached_tokens: int, scheduled_s: float | None) -> None:
        """The first token is sampled; the request was first scheduled at scheduled_s."""
        self.times.first_token_s = time.monotonic()
        self.times.scheduled_s = scheduled_s
        self.num_cached_tokens = num_cached_tokens
        self._metrics.observe_phases(self.times)
        if self.span.is_recording():
            self.span.set_attribute("pdserve.cached_tokens", num_cached_tokens)
            self.span.add_event("first_token", timestamp=tracing.wall_ns(self.times.first_token_s))

    def sent(self, stats: TransferStats, target: str) -> None:
        """Every KV message was delivered."""
        self._metrics.observe_transfer(stats)
        if not self.span.is_recording():
            return
        end_s = time.monotonic()
        attributes = {
            "pdserve.kv_bytes": stats.bytes,
            "pdserve.kv_messages": stats.num_messages,
            "pdserve.kv_target": target,
        }
        tracing.record_span("kv.send", self.context, end_s - stats.seconds, end_s, attributes)
        self.span.set_attribute("pdserve.kv_bytes", stats.bytes)

    def transfer_failed(self) -> None:
        self._metrics.transfer_failed()

    def end(self, error: BaseException | str | None = None) -> None:
        if not self.span.is_recording():
            return
        times = self.times
        if times.scheduled_s is not None:
            tracing.record_span("prefill.queue", self.context, times.arrival_s, times.scheduled_s)
            if times.first_token_s is not None:
                computed = self.num_prompt_tokens - self.num_cached_tokens
                tracing.record_span(
                    "prefill.compute",
                    self.context,
                    times.scheduled_s,
                    times.first_token_s,
                    {"pdserve.computed_tokens": computed},
                )
        tracing.end_span(self.span, error)


class PrefillTelemetry:
    """Telemetry of a prefill node's requests: metrics and spans."""

    def __init__(self, metrics: NodeMetrics, node_id: str) -> None:
        self.metrics = metrics
        self.node_id = node_id

    def begin(
        self,
        request_id: str,
        num_prompt_tokens: int,
        metadata: Iterable[tuple[str, str | bytes]] | None,
    ) -> PrefillRequestTelemetry:
        return PrefillRequestTelemetry(self, request_id, num_prompt_tokens, metadata)
