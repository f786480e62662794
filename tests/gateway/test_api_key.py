"""--api-key: Bearer auth on the REST routes (the openai client's api_key), open probes and
metrics, internal addresses only with the key; the gRPC Gateway service wants it too."""

from __future__ import annotations

import grpc
import httpx
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from tests.gateway.harness import MODEL_NAME

KEY = "sk-test-123"


def test_rest_routes_need_the_key_probes_do_not(make_cluster) -> None:
    cluster = make_cluster(api_key=KEY)
    base = cluster.base_url
    good = openai.OpenAI(base_url=f"{base}/v1", api_key=KEY, max_retries=0)
    assert good.completions.create(model=MODEL_NAME, prompt="Hello", max_tokens=3).choices
    bad = openai.OpenAI(base_url=f"{base}/v1", api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as info:
        bad.completions.create(model=MODEL_NAME, prompt="Hello", max_tokens=3)
    assert info.value.body["code"] == "invalid_api_key"  # OpenAI's error shape
    for path in ("/health", "/metrics", "/version", "/dashboard"):
        assert httpx.get(base + path, timeout=10).status_code == 200, path
    for path in ("/v1/models", "/dashboard/data", "/metrics/targets", "/openapi.json"):
        assert httpx.get(base + path, timeout=10).status_code == 401, path
        assert (
            httpx.get(base + path, timeout=10, headers={"Authorization": "Bearer x"}).status_code
            == 401
        )
        reply = httpx.get(base + path, timeout=10, headers={"Authorization": f"Bearer {KEY}"})
        assert reply.status_code == 200, path
    assert httpx.post(f"{base}/tokenize", json={"prompt": "hi"}, timeout=10).status_code == 401


def test_grpc_gateway_service_needs_the_key(make_cluster) -> None:
    cluster = make_cluster(api_key=KEY)
    request = gateway_pb2.GenerateRequest(
        model=MODEL_NAME, text="Hello", sampling_params=common_pb2.SamplingParams(max_tokens=3)
    )
    with grpc.insecure_channel(cluster.grpc_address) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        for metadata in ((), (("authorization", "Bearer nope"),)):
            with pytest.raises(grpc.RpcError) as info:
                list(stub.Generate(request, timeout=10, metadata=metadata))
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
            with pytest.raises(grpc.RpcError) as info:
                stub.ListModels(gateway_pb2.ListModelsRequest(), timeout=10, metadata=metadata)
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        auth = (("authorization", f"Bearer {KEY}"),)
        assert list(stub.Generate(request, timeout=10, metadata=auth))
        health = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(), timeout=10
        )
        assert health.status == health_pb2.HealthCheckResponse.SERVING
