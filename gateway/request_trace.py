"""RequestTrace: the root span of one client request at the gateway.

One trace per request: the root span (SERVER) is opened when the REST or gRPC handler starts,
under the client's own traceparent if it sent one, and ended when the response is complete
(for a stream: when the stream closes). Below it: gateway.prepare (validation, chat template,
tokenization) here, then per completion gateway.completion > gateway.route and
gateway.decode (the Generate call whose context the decode node continues) in generation.py.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace

from opentelemetry.context import Context
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.util.types import AttributeValue

from pdserve.common import tracing
from pdserve.gateway.errors import ApiError
from pdserve.gateway.generation import GenerationRequest


class RequestTrace:
    """The root span of a request and its arrival time (latencies count from here)."""

    def __init__(
        self, span_name: str, parent: Context | None, attributes: dict[str, AttributeValue]
    ) -> None:
        self.arrival_s = time.monotonic()
        self.span = tracing.start_span(span_name, parent, SpanKind.SERVER, attributes)
        self.context = tracing.context_of(self.span)
        self._ended = False

    def prepare(self, prepare: Callable[[], GenerationRequest]) -> GenerationRequest:
        """Run prepare (check, template, tokenize) in a gateway.prepare span; the request it
        returns carries this trace and the arrival time."""
        span = tracing.start_span("gateway.prepare", self.context)
        try:
            request = prepare()
        except BaseException as exc:
            tracing.end_span(span, exc)
            raise
        tracing.end_span(span)
        if self.span.is_recording():
            self.span.set_attributes(
                {
                    "pdserve.request_id": request.request_id,
                    "pdserve.prompt_tokens": len(request.prompt_token_ids),
                    "pdserve.n": request.n,
                    "pdserve.max_tokens": request.params.max_tokens,
                }
            )
        return replace(request, arrival_s=self.arrival_s, trace_context=self.context)

    def fail(self, error: BaseException) -> None:
        """Mark the request failed (the span ends later, with end())."""
        if self.span.is_recording():
            self.span.set_status(Status(StatusCode.ERROR, str(error)))
            self.span.set_attribute("error.type", type(error).__name__)
            if isinstance(error, ApiError):
                self.span.set_attribute("http.response.status_code", int(error.status))

    def end(self) -> None:
        """End the root span; later calls do nothing (error paths may end defensively)."""
        if not self._ended:
            self._ended = True
            tracing.end_span(self.span)
