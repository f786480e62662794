"""OpenTelemetry tracing, configured only by the standard OTEL_* environment variables.

Each process calls setup(role, instance_id) once at start and shutdown() on its way out (which
flushes the spans still batched). Tracing is on when OTEL_TRACES_EXPORTER names an exporter
("otlp", "console"; comma-separated), or, when it is unset, when an OTLP endpoint is set
(OTEL_EXPORTER_OTLP_ENDPOINT / OTEL_EXPORTER_OTLP_TRACES_ENDPOINT). Otherwise (and with
OTEL_TRACES_EXPORTER=none or OTEL_SDK_DISABLED=true) the global tracer stays OpenTelemetry's
no-op one and every helper here returns at its first line: no exporter thread, no context
propagation, a few no-op span objects per request and nothing per token.

The SDK reads the rest itself: OTEL_EXPORTER_OTLP_PROTOCOL ("grpc", the default here, or
"http/protobuf"), OTEL_EXPORTER_OTLP_HEADERS, OTEL_TRACES_SAMPLER(_ARG), OTEL_BSP_* (batch
delay and sizes), OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES. A process reports
service.name "pdserve-<role>" and service.instance.id <node id> unless those say otherwise.

Context travels as W3C trace context (traceparent, tracestate; OTEL_PROPAGATORS applies) in
gRPC metadata (grpc_metadata / context_from_grpc), HTTP headers, and the KV TransferHeader
(inject / extract).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterable, Mapping

from opentelemetry import propagate, trace
from opentelemetry.context import Context
from opentelemetry.trace import Span, SpanKind, Status, StatusCode
from opentelemetry.util.types import AttributeValue

logger = logging.getLogger(__name__)

_TRACER_NAME = "pdserve"
_enabled = False
_provider: object | None = None  # opentelemetry.sdk.trace.TracerProvider once set up
_tracer: trace.Tracer = trace.NoOpTracer()
# time.monotonic() -> wall-clock ns, for spans dated after the fact from monotonic stamps.
_WALL_OFFSET_NS = time.time_ns() - time.monotonic_ns()

Attributes = Mapping[str, AttributeValue]


def enabled() -> bool:
    """Whether spans are recorded and exported in this process."""
    return _enabled


def _exporter_names() -> list[str]:
    if os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return []
    names = os.environ.get("OTEL_TRACES_EXPORTER")
    if names is None:
        endpoint_vars = ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
        return ["otlp"] if any(os.environ.get(v) for v in endpoint_vars) else []
    return [n.strip().lower() for n in names.split(",") if n.strip() and n.strip() != "none"]


def _otlp_exporter() -> object:
    protocol = os.environ.get(
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
    ).strip()
    if protocol.startswith("http"):
        if protocol != "http/protobuf":
            logger.warning("OTLP protocol %r is not supported; using http/protobuf", protocol)
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        return OTLPSpanExporter()
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
        OTLPSpanExporter as GrpcSpanExporter,
    )

    return GrpcSpanExporter()


def _exporter(exporter_name: str) -> object | None:
    if exporter_name == "otlp":
        return _otlp_exporter()
    if exporter_name == "console":
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter

        return ConsoleSpanExporter()
    logger.warning("OTEL_TRACES_EXPORTER %r is not supported (otlp, console, none)", exporter_name)
    return None


def setup(role: str, instance_id: str) -> bool:
    """Install the process's tracer provider if the environment asks for tracing; returns
    whether tracing is on. Call once, before any span."""
    global _enabled, _provider, _tracer
    exporters = [e for e in map(_exporter, _exporter_names()) if e is not None]
    if not exporters:
        return False
    from opentelemetry.sdk.resources import (
        SERVICE_INSTANCE_ID,
        SERVICE_NAME,
        OTELResourceDetector,
        Resource,
    )
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    # Ours are defaults: OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES win.
    defaults = {SERVICE_NAME: f"pdserve-{role}", SERVICE_INSTANCE_ID: instance_id}
    resource = Resource.create(defaults).merge(OTELResourceDetector().detect())
    provider = TracerProvider(resource=resource)  # the sampler comes from OTEL_TRACES_SAMPLER
    for exporter in exporters:
        provider.add_span_processor(BatchSpanProcessor(exporter))  # type: ignore[arg-type]
    trace.set_tracer_provider(provider)
    _provider = provider
    _tracer = provider.get_tracer(_TRACER_NAME)
    _enabled = True
    logger.info(
        "tracing on: %s as %s", ", ".join(_exporter_names()), resource.attributes[SERVICE_NAME]
    )
    return True


def shutdown() -> None:
    """Export the spans still batched and stop the exporters (bounded by the SDK's timeouts)."""
    global _enabled, _provider, _tracer
    if _provider is not None:
        _provider.shutdown()  # type: ignore[attr-defined]
    _provider = None
    _tracer = trace.NoOpTracer()
    _enabled = False


def start_span(
    span_name: str,
    parent: Context | None,
    kind: SpanKind = SpanKind.INTERNAL,
    attributes: Attributes | None = None,
    start_s: float | None = None,
) -> Span:
    """A span under parent (None: a new trace), started now or at monotonic time start_s.
    The caller ends it. Returns a non-recording span when tracing is off."""
    if not _enabled:
        return trace.INVALID_SPAN
    start_ns = wall_ns(start_s) if start_s is not None else None
    return _tracer.start_span(
        span_name, context=parent, kind=kind, attributes=attributes, start_time=start_ns
    )


def record_span(
    span_name: str,
    parent: Context | None,
    start_s: float,
    end_s: float,
    attributes: Attributes | None = None,
    kind: SpanKind = SpanKind.INTERNAL,
) -> None:
    """A span dated after the fact from monotonic times (a phase measured by timestamps)."""
    if not _enabled:
        return
    span = start_span(span_name, parent, kind, attributes, start_s)
    span.end(end_time=wall_ns(max(end_s, start_s)))


def end_span(
    span: Span, error: BaseException | str | None = None, end_s: float | None = None
) -> None:
    """End span, marking it failed when error is given."""
    if not span.is_recording():
        return
    if error is not None:
        span.set_status(Status(StatusCode.ERROR, str(error)))
        if isinstance(error, BaseException):
            span.set_attribute("error.type", type(error).__name__)
    span.end(end_time=wall_ns(end_s) if end_s is not None else None)


def context_of(span: Span) -> Context | None:
    """A context whose current span is span (the parent argument of child spans)."""
    if not _enabled:
        return None
    return trace.set_span_in_context(span)


def wall_ns(monotonic_s: float) -> int:
    """A time.monotonic() reading as wall-clock nanoseconds (OpenTelemetry's timestamps)."""
    return _WALL_OFFSET_NS + int(monotonic_s * 1e9)


# -- propagation ------------------------------------------------------------------------------


def inject(context: Context | None) -> dict[str, str]:
    """The W3C trace context of context as a string map ({} when off or context is None)."""
    if not _enabled or context is None:
        return {}
    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=context)
    return carrier


def extract(carrier: Mapping[str, str] | None) -> Context | None:
    """The remote parent carried by a string map (None when off or nothing is carried)."""
    if not _enabled or not carrier:
        return None
    return propagate.extract(carrier)


def grpc_metadata(context: Context | None) -> tuple[tuple[str, str], ...] | None:
    """gRPC call metadata carrying context (None when there is nothing to carry)."""
    carrier = inject(context)
    return tuple(carrier.items()) if carrier else None


def context_from_grpc(metadata: Iterable[tuple[str, str | bytes]] | None) -> Context | None:
    """The remote parent in a call's invocation metadata (None when off or absent)."""
    if not _enabled or metadata is None:
        return None
    return extract({k: v for k, v in metadata if isinstance(v, str)})
