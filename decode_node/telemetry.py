"""A decode node's per-request telemetry: the phase metrics and the request's spans.

Spans of one request here (children of the gateway's decode call, whose context arrives in
the gRPC metadata):

    decode.generate               the whole Generate call (SERVER)
      decode.admission            arrival -> blocks reserved (dated from RequestTimes)
      decode.remote_prefill       one Prefill call to a prefill node + waiting for the KV
                                  (CLIENT; see remote_prefill.py), with kv.receive below the
                                  prefill node's span whose context the KV header carries
      decode.prefill              blocks reserved -> first token (remote or local)
      decode.decode               first token -> last token

Per update the servicer calls on_update(): two int additions, no span work.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from opentelemetry.context import Context
from opentelemetry.trace import SpanKind

from pdserve.common import tracing
from pdserve.common.node_metrics import NodeMetrics
from pdserve.common.request_times import RequestTimes
from pdserve.engine.outputs import RequestUpdate


class DecodeRequestTelemetry:
    """One request's timestamps, counters and root span at this node."""

    def __init__(
        self,
        telemetry: DecodeTelemetry,
        request_id: str,
        num_prompt_tokens: int,
        parent: Context | None,
    ) -> None:
        self._telemetry = telemetry
        self.times = RequestTimes(arrival_s=time.monotonic())
        self.num_generated_tokens = 0
        self.num_accepted_spec_tokens = 0
        self.num_cached_tokens = 0
        attributes = {
            "pdserve.request_id": request_id,
            "pdserve.node_id": telemetry.node_id,
            "pdserve.prompt_tokens": num_prompt_tokens,
        }
        # dated from the same monotonic clock as its end (times.finished_s) and its phase
        # spans: a wall-clock start could land after the end when the VM's clock is stepped
        self.span = tracing.start_span(
            "decode.generate", parent, SpanKind.SERVER, attributes, self.times.arrival_s
        )
        self.context = tracing.context_of(self.span)
        """Parent of this request's child spans (None when tracing is off)."""

    def on_update(self, update: RequestUpdate) -> None:
        if self.times.first_token_s is None:
            self.times.first_token_s = time.monotonic()
            self.times.scheduled_s = update.scheduled_s
            self.num_cached_tokens = update.num_cached_tokens
        elif len(update.new_token_ids) > 1:
            # After the first token, a step emits 1 + the speculative tokens it accepted.
            self.num_accepted_spec_tokens += len(update.new_token_ids) - 1
        self.num_generated_tokens += len(update.new_token_ids)

    def end(
        self,
        finished_reason: str,
        prefilled_by: str,
        kv_bytes: int,
        error: BaseException | str | None = None,
    ) -> None:
        """The request is over (finished_reason "stop", "length" or "abort")."""
        times = self.times
        times.finished_s = time.monotonic()
        metrics = self._telemetry.metrics
        metrics.observe_phases(times)
        metrics.observe_finished(finished_reason)
        if not self.span.is_recording():
            return
        self._record_phases(prefilled_by)
        self.span.set_attributes(
            {
                "pdserve.finished_reason": finished_reason,
                "pdserve.prefilled_by": prefilled_by,
                "pdserve.cached_tokens": self.num_cached_tokens,
                "pdserve.generated_tokens": self.num_generated_tokens,
                "pdserve.kv_bytes": kv_bytes,
            }
        )
        if self._telemetry.speculative:
            self.span.set_attribute("pdserve.spec_accepted_tokens", self.num_accepted_spec_tokens)
        tracing.end_span(self.span, error, times.finished_s)

    def _record_phases(self, prefilled_by: str) -> None:
        times, parent = self.times, self.context
        if times.scheduled_s is not None:
            tracing.record_span("decode.admission", parent, times.arrival_s, times.scheduled_s)
            if times.first_token_s is not None:
                attributes = {
                    "pdserve.prefilled_by": prefilled_by,
                    "pdserve.cached_tokens": self.num_cached_tokens,
                }
                tracing.record_span(
                    "decode.prefill", parent, times.scheduled_s, times.first_token_s, attributes
                )
        if times.first_token_s is not None and times.finished_s is not None:
            attributes = {"pdserve.generated_tokens": self.num_generated_tokens}
            if self._telemetry.speculative:
                attributes["pdserve.spec_accepted_tokens"] = self.num_accepted_spec_tokens
            tracing.record_span(
                "decode.decode", parent, times.first_token_s, times.finished_s, attributes
            )


class DecodeTelemetry:
    """Telemetry of a decode node's requests: metrics and spans."""

    def __init__(self, metrics: NodeMetrics, node_id: str, speculative: bool) -> None:
        self.metrics = metrics
        self.node_id = node_id
        self.speculative = speculative
        """Whether the engine speculates (spans then carry accepted speculative tokens)."""

    def begin(
        self,
        request_id: str,
        num_prompt_tokens: int,
        metadata: Iterable[tuple[str, str | bytes]] | None,
    ) -> DecodeRequestTelemetry:
        """Start a request's telemetry on arrival; metadata is the call's, carrying its parent."""
        parent = tracing.context_from_grpc(metadata)
        return DecodeRequestTelemetry(self, request_id, num_prompt_tokens, parent)
