"""OpenTelemetry across processes: one chat request through `pdserve serve` is one trace, with
spans from the gateway, the decode node and the prefill node (KV send and receive included),
exported over OTLP/gRPC to a receiver run by the test; a node flushes its spans on SIGTERM."""

from __future__ import annotations

import grpc
import openai

from pdserve.common.protocol import sampling_params_to_proto
from pdserve.engine import SamplingParams
from pdserve.v1 import node_pb2, node_pb2_grpc
from tests.integration.procs import Proc, free_port, wait_grpc_serving
from tests.observability.otlp_receiver import ReceivedSpan

TIMEOUT_S = 60.0
SPAN_TIMEOUT_S = 20.0
SERVER_KIND = 2  # opentelemetry.proto.trace.v1.Span.SPAN_KIND_SERVER
EXPECTED_SPANS = {
    "pdserve-gateway": {
        "POST /v1/chat/completions",
        "gateway.prepare",
        "gateway.completion",
        "gateway.route",
        "gateway.decode",
    },
    "pdserve-decode": {
        "decode.generate",
        "decode.admission",
        "decode.remote_prefill",
        "kv.receive",
        "decode.prefill",
        "decode.decode",
    },
    "pdserve-prefill": {"prefill.prefill", "prefill.queue", "prefill.compute", "kv.send"},
}


def _complete(request_id: str):
    """A predicate: the trace whose gateway root names request_id has every expected span."""

    def done(spans: list[ReceivedSpan]) -> bool:
        roots = [s for s in spans if s.attributes.get("pdserve.request_id") == request_id]
        if not roots:
            return False
        trace = [s for s in spans if s.trace_id == roots[0].trace_id]
        names = {s.name for s in trace}
        return all(expected <= names for expected in EXPECTED_SPANS.values())

    return done


def _chain_to_root(span: ReceivedSpan, by_id: dict[str, ReceivedSpan]) -> ReceivedSpan:
    seen = set()
    while span.parent_span_id:
        assert span.span_id not in seen, "parent cycle"
        seen.add(span.span_id)
        assert span.parent_span_id in by_id, f"{span.name}'s parent is not in the trace"
        span = by_id[span.parent_span_id]
    return span


def test_one_chat_request_is_one_trace_across_every_process(stack, otlp):
    client = openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key="none", timeout=TIMEOUT_S)
    # Long enough to go to the prefill node (remote prefill from 16 uncached tokens).
    prompt = "Tell me about disaggregated serving. " * 12
    response = client.chat.completions.create(
        model=stack.model,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=6,
        temperature=0.0,
    )
    spans = otlp.wait_for(_complete(response.id), SPAN_TIMEOUT_S)

    tagged = [s for s in spans if str(s.attributes.get("pdserve.request_id", "")) == response.id]
    trace_ids = {s.trace_id for s in tagged}
    assert len(trace_ids) == 1, f"request {response.id} spread over traces {trace_ids}"
    trace = [s for s in spans if s.trace_id in trace_ids]
    by_id = {s.span_id: s for s in trace}
    assert len(by_id) == len(trace), "duplicate span ids"

    for service, names in EXPECTED_SPANS.items():
        got = {s.name for s in trace if s.service_name == service}
        assert names <= got, f"{service} is missing {names - got}"
    roots = [s for s in trace if not s.parent_span_id]
    assert len(roots) == 1, [s.name for s in roots]
    root = roots[0]
    assert root.service_name == "pdserve-gateway" and root.name == "POST /v1/chat/completions"
    assert root.kind == SERVER_KIND
    for span in trace:
        assert _chain_to_root(span, by_id) is root
        assert span.start_ns <= span.end_ns, span.name

    def one(name: str) -> ReceivedSpan:
        [span] = [s for s in trace if s.name == name]
        return span

    usage = response.usage
    assert root.attributes["pdserve.prompt_tokens"] == usage.prompt_tokens
    generate = one("decode.generate")
    assert generate.attributes["pdserve.generated_tokens"] == usage.completion_tokens
    assert str(generate.attributes["pdserve.prefilled_by"]).startswith("remote:")
    assert by_id[generate.parent_span_id].name == "gateway.decode"
    prefill = one("prefill.prefill")
    assert by_id[prefill.parent_span_id].name == "decode.remote_prefill"
    # The KV header carried prefill.prefill's context: the receive hangs under it.
    send, receive = one("kv.send"), one("kv.receive")
    assert send.parent_span_id == prefill.span_id == receive.parent_span_id
    assert send.attributes["pdserve.kv_bytes"] == receive.attributes["pdserve.kv_bytes"] > 0
    assert one("gateway.completion").attributes["pdserve.generated_tokens"] == (
        usage.completion_tokens
    )
    instances = {s.service_name: s.service_instance_id for s in trace}
    assert instances["pdserve-decode"] == stack.load("decode-0").node_id
    assert instances["pdserve-prefill"] == stack.load("prefill-0").node_id
    assert instances["pdserve-gateway"].startswith("gateway-")


def test_a_node_flushes_its_spans_on_sigterm(tiny_llama, tmp_path, otlp):
    """With a batch delay far longer than the test, the spans can only come from the flush at
    shutdown."""
    port = free_port()
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": otlp.endpoint, "OTEL_BSP_SCHEDULE_DELAY": "600000"}
    argv = ["decode", "--model", tiny_llama, "--port", str(port), "--node-id", "flush-decode"]
    argv += ["--block-size", "16", "--num-blocks", "64", "--dtype", "float32"]
    argv += ["--kv-transport", "tcp", "--num-threads", "1"]
    proc = Proc(argv, tmp_path / "decode.log", env=env)
    try:
        wait_grpc_serving(f"127.0.0.1:{port}", proc)
        request = node_pb2.DecodeRequest(
            request_id="flush-1",
            prompt_token_ids=[5, 6, 7, 8, 9],
            sampling_params=sampling_params_to_proto(SamplingParams(max_tokens=3)),
        )
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            chunks = list(node_pb2_grpc.DecodeNodeStub(channel).Generate(request, timeout=30))
        assert chunks[-1].finish_reason
        assert not [s for s in otlp.spans if s.service_instance_id == "flush-decode"]
        assert proc.stop() == 0
        spans = otlp.wait_for(
            lambda got: any(s.attributes.get("pdserve.request_id") == "flush-1" for s in got),
            SPAN_TIMEOUT_S,
        )
    finally:
        proc.stop()
    mine = [s for s in spans if s.service_instance_id == "flush-decode"]
    assert {s.service_name for s in mine} == {"pdserve-decode"}
    assert {"decode.generate", "decode.admission", "decode.prefill", "decode.decode"} <= {
        s.name for s in mine
    }
