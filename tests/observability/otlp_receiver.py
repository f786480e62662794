"""An OTLP/gRPC trace receiver on 127.0.0.1 for tests (and the tracing benchmark): what an
OpenTelemetry collector would get, kept as flat ReceivedSpan records."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1 import common_pb2


@dataclass(frozen=True)
class ReceivedSpan:
    trace_id: str
    span_id: str
    parent_span_id: str
    """"" for a root span."""
    name: str
    kind: int
    service_name: str
    service_instance_id: str
    start_ns: int
    end_ns: int
    attributes: dict[str, Any] = field(default_factory=dict)


def _value(v: common_pb2.AnyValue) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


def _attributes(items: Any) -> dict[str, Any]:
    return {kv.key: _value(kv.value) for kv in items}


class _TraceService(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, sink: Callable[[list[ReceivedSpan]], None]) -> None:
        self._sink = sink

    def Export(self, request, context):  # noqa: N802 - the generated servicer's name
        spans = []
        for resource_spans in request.resource_spans:
            resource = _attributes(resource_spans.resource.attributes)
            for scope_spans in resource_spans.scope_spans:
                for s in scope_spans.spans:
                    spans.append(
                        ReceivedSpan(
                            trace_id=s.trace_id.hex(),
                            span_id=s.span_id.hex(),
                            parent_span_id=s.parent_span_id.hex(),
                            name=s.name,
                            kind=s.kind,
                            service_name=resource.get("service.name", ""),
                            service_instance_id=resource.get("service.instance.id", ""),
                            start_ns=s.start_time_unix_nano,
                            end_ns=s.end_time_unix_nano,
                            attributes=_attributes(s.attributes),
                        )
                    )
        self._sink(spans)
        return trace_service_pb2.ExportTraceServiceResponse()


_EXPORT_METHOD = "Export"
_EMPTY_RESPONSE = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()


class OtlpReceiver:
    """A gRPC server implementing the OTLP TraceService; endpoint is what
    OTEL_EXPORTER_OTLP_ENDPOINT should say. keep_spans=False only counts the export calls and
    their bytes, without decoding them (a benchmark's receiver should cost next to nothing:
    a real collector runs elsewhere)."""

    def __init__(self, keep_spans: bool = True) -> None:
        self._lock = threading.Lock()
        self._spans: list[ReceivedSpan] = []
        self.num_exports = 0
        self.num_bytes = 0
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        if keep_spans:
            trace_service_pb2_grpc.add_TraceServiceServicer_to_server(
                _TraceService(self._add), self._server
            )
        else:
            self._server.add_generic_rpc_handlers([self._counting_handler()])
        port = self._server.add_insecure_port("127.0.0.1:0")
        self.endpoint = f"http://127.0.0.1:{port}"

    def _counting_handler(self) -> grpc.GenericRpcHandler:
        def export(request: bytes, context: grpc.ServicerContext) -> bytes:
            with self._lock:
                self.num_exports += 1
                self.num_bytes += len(request)
            return _EMPTY_RESPONSE

        service = trace_service_pb2.DESCRIPTOR.services_by_name["TraceService"].full_name
        handler = grpc.unary_unary_rpc_method_handler(export)  # bytes in, bytes out
        return grpc.method_handlers_generic_handler(service, {_EXPORT_METHOD: handler})

    def _add(self, spans: list[ReceivedSpan]) -> None:
        with self._lock:
            self._spans.extend(spans)

    def start(self) -> OtlpReceiver:
        self._server.start()
        return self

    def stop(self) -> None:
        self._server.stop(grace=1.0).wait(5.0)

    @property
    def spans(self) -> list[ReceivedSpan]:
        with self._lock:
            return list(self._spans)

    def trace(self, trace_id: str) -> list[ReceivedSpan]:
        return [s for s in self.spans if s.trace_id == trace_id]

    def wait_for(
        self, done: Callable[[list[ReceivedSpan]], bool], timeout_s: float
    ) -> list[ReceivedSpan]:
        """Poll until done(all spans so far) holds; returns the spans (raises on timeout)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            spans = self.spans
            if done(spans):
                return spans
            time.sleep(0.1)
        raise TimeoutError(f"spans not complete after {timeout_s} s: {len(self.spans)} received")
