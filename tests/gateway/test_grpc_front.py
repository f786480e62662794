"""The public gRPC front through the generated stubs: Generate, ListModels, health and
reflection."""

from __future__ import annotations

import time
from collections.abc import Iterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from pdserve.engine.tokenizer import Tokenizer
from pdserve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from tests.gateway.fake_nodes import expected_tokens
from tests.gateway.harness import MODEL_NAME, Cluster

TIMEOUT_S = 10.0


@pytest.fixture
def channel(gw: Cluster) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(gw.grpc_address) as ch:
        yield ch


def generate(channel: grpc.Channel, **fields: object) -> list[gateway_pb2.GenerateResponse]:
    stub = gateway_pb2_grpc.GatewayStub(channel)
    request = gateway_pb2.GenerateRequest(model=MODEL_NAME, **fields)  # type: ignore[arg-type]
    return list(stub.Generate(request, timeout=TIMEOUT_S))


def test_list_models(channel: grpc.Channel) -> None:
    stub = gateway_pb2_grpc.GatewayStub(channel)
    response = stub.ListModels(gateway_pb2.ListModelsRequest(), timeout=TIMEOUT_S)
    assert [(m.id, m.max_model_len) for m in response.models] == [(MODEL_NAME, 512)]


def test_generate_text(channel: grpc.Channel, tokenizer: Tokenizer, script: list[int]) -> None:
    prompt_ids = tokenizer.encode("Hello")
    params = common_pb2.SamplingParams(max_tokens=9, seed=4, logprobs=1)
    responses = generate(channel, text="Hello", sampling_params=params, request_id="r1")
    want = expected_tokens(script, len(prompt_ids), 4, 9)
    assert "".join(r.text for r in responses) == tokenizer.decode(want)
    assert [t for r in responses for t in r.token_ids] == want
    assert [lp.token_id for r in responses for lp in r.logprobs] == want
    assert {r.request_id for r in responses} == {"r1"}
    last = responses[-1]
    assert last.finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert (last.prompt_tokens, last.completion_tokens) == (len(prompt_ids), 9)
    assert all(r.finish_reason == common_pb2.FINISH_REASON_UNSPECIFIED for r in responses[:-1])


def test_generate_prompt_logprobs_on_the_first_message(channel: grpc.Channel) -> None:
    params = common_pb2.SamplingParams(max_tokens=3, seed=1, prompt_logprobs=2)
    responses = generate(
        channel, token_ids=gateway_pb2.TokenIds(ids=[5, 6, 7, 8]), sampling_params=params
    )
    assert [lp.token_id for lp in responses[0].prompt_logprobs] == [6, 7, 8]
    assert all(len(lp.top) == 2 for lp in responses[0].prompt_logprobs)
    assert all(not r.prompt_logprobs for r in responses[1:])
    too_many = common_pb2.SamplingParams(max_tokens=3, prompt_logprobs=21)
    with pytest.raises(grpc.RpcError) as err:
        generate(channel, token_ids=gateway_pb2.TokenIds(ids=[5, 6]), sampling_params=too_many)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "prompt_logprobs" in (err.value.details() or "")


def test_generate_chat_n2_with_stop_string(
    channel: grpc.Channel, tokenizer: Tokenizer, script: list[int]
) -> None:
    chat = gateway_pb2.ChatMessages(messages=[gateway_pb2.ChatMessage(role="user", content="Hi")])
    params = common_pb2.SamplingParams(max_tokens=30, temperature=0, stop=["fox"])
    responses = generate(channel, chat=chat, sampling_params=params, n=2)
    prompt_len = len(
        tokenizer.encode(
            tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}]),
            add_special_tokens=False,
        )
    )
    full = tokenizer.decode(expected_tokens(script, prompt_len, 0, 30))
    for index in (0, 1):
        mine = [r for r in responses if r.index == index]
        assert "".join(r.text for r in mine) == full[: full.index("fox")]
        assert mine[-1].finish_reason == common_pb2.FINISH_REASON_STOP
        assert mine[-1].stop_reason == "fox"


def test_generate_token_ids(channel: grpc.Channel, tokenizer: Tokenizer, script: list[int]) -> None:
    params = common_pb2.SamplingParams(max_tokens=3, seed=1)
    responses = generate(
        channel, token_ids=gateway_pb2.TokenIds(ids=[5, 6, 7, 8]), sampling_params=params
    )
    assert "".join(r.text for r in responses) == tokenizer.decode(expected_tokens(script, 4, 1, 3))
    assert responses[0].request_id.startswith("gen-")


@pytest.mark.parametrize(
    "fields,code",
    [
        ({}, grpc.StatusCode.INVALID_ARGUMENT),
        ({"text": "a", "n": 17}, grpc.StatusCode.INVALID_ARGUMENT),
        ({"text": "a", "sampling_params": {"temperature": 5.0}}, grpc.StatusCode.INVALID_ARGUMENT),
        ({"text": "a", "sampling_params": {"max_tokens": 0}}, grpc.StatusCode.INVALID_ARGUMENT),
        ({"text": "a", "sampling_params": {"max_tokens": 600}}, grpc.StatusCode.INVALID_ARGUMENT),
        ({"text": "a", "sampling_params": {"logprobs": 21}}, grpc.StatusCode.INVALID_ARGUMENT),
        ({"token_ids": {"ids": []}}, grpc.StatusCode.INVALID_ARGUMENT),
        ({"token_ids": {"ids": [1, 5000]}}, grpc.StatusCode.INVALID_ARGUMENT),
        ({"chat": {"messages": []}}, grpc.StatusCode.INVALID_ARGUMENT),
        (
            {"chat": {"messages": [{"role": "bot", "content": "x"}]}},
            grpc.StatusCode.INVALID_ARGUMENT,
        ),
        ({"text": "a", "model": "nope"}, grpc.StatusCode.NOT_FOUND),
    ],
)
def test_bad_input(channel: grpc.Channel, fields: dict, code: grpc.StatusCode) -> None:
    stub = gateway_pb2_grpc.GatewayStub(channel)
    request = gateway_pb2.GenerateRequest(model=MODEL_NAME)
    request.MergeFrom(gateway_pb2.GenerateRequest(**fields))
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Generate(request, timeout=TIMEOUT_S))
    assert info.value.code() == code
    assert info.value.details()


def test_client_cancel_cancels_the_node_call(gw: Cluster, channel: grpc.Channel) -> None:
    for node in gw.decode_nodes:
        node.behaviour.token_delay_s = 0.02
    stub = gateway_pb2_grpc.GatewayStub(channel)
    request = gateway_pb2.GenerateRequest(
        model=MODEL_NAME, text="a", sampling_params=common_pb2.SamplingParams(max_tokens=400)
    )
    call = stub.Generate(request, timeout=TIMEOUT_S)
    next(call)
    call.cancel()
    deadline = time.monotonic() + 5
    calls = [c for node in gw.decode_nodes for c in node.calls]
    while not (calls and all(c.cancelled for c in calls)):
        assert time.monotonic() < deadline
        time.sleep(0.02)
        calls = [c for node in gw.decode_nodes for c in node.calls]


def test_health_service(channel: grpc.Channel) -> None:
    stub = health_pb2_grpc.HealthStub(channel)
    for service in ("", "pdserve.v1.Gateway"):
        response = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=TIMEOUT_S)
        assert response.status == health_pb2.HealthCheckResponse.SERVING


def test_reflection_lists_the_services(channel: grpc.Channel) -> None:
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    request = reflection_pb2.ServerReflectionRequest(list_services="")
    (response,) = list(stub.ServerReflectionInfo(iter([request]), timeout=TIMEOUT_S))
    names = {s.name for s in response.list_services_response.service}
    assert {"pdserve.v1.Gateway", "grpc.health.v1.Health"} <= names
    symbol = reflection_pb2.ServerReflectionRequest(file_containing_symbol="pdserve.v1.Gateway")
    (found,) = list(stub.ServerReflectionInfo(iter([symbol]), timeout=TIMEOUT_S))
    assert found.file_descriptor_response.file_descriptor_proto


def test_client_request_ids_are_echoed_not_used_as_internal_ids(channel: grpc.Channel) -> None:
    """Two concurrent calls with the same client id both succeed, each answered with it; an
    id longer than the bound is INVALID_ARGUMENT."""
    from concurrent.futures import ThreadPoolExecutor

    def call(request_id: str) -> list[gateway_pb2.GenerateResponse]:
        return generate(
            channel,
            text="Hello",
            request_id=request_id,
            sampling_params=common_pb2.SamplingParams(max_tokens=4, temperature=0.0),
        )

    with ThreadPoolExecutor(2) as pool:
        replies = list(pool.map(call, ["same-id", "same-id"]))
    for reply in replies:
        assert reply[-1].finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED
        assert {r.request_id for r in reply} == {"same-id"}
    with pytest.raises(grpc.RpcError) as info:
        call("x" * 20000)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_malformed_message_is_invalid_argument(channel: grpc.Channel) -> None:
    """Bytes that are no GenerateRequest (or ListModelsRequest): INVALID_ARGUMENT, not UNKNOWN;
    the front keeps serving."""
    for method in ("Generate", "ListModels"):
        call = (channel.unary_stream if method == "Generate" else channel.unary_unary)(
            f"/pdserve.v1.Gateway/{method}"
        )
        with pytest.raises(grpc.RpcError) as info:
            reply = call(b"\xff\xff\xff\xff garbage", timeout=TIMEOUT_S)
            if method == "Generate":
                list(reply)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value
        assert "malformed" in info.value.details()
    test_list_models(channel)
