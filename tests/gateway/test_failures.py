"""Admission, disconnects, deadlines and decode node failures: every request ends, on time,
and every decode call the gateway gives up on is cancelled on its node."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from typing import Any

import grpc
import httpx
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.engine.tokenizer import Tokenizer
from tests.gateway.conftest import StartCluster
from tests.gateway.fake_nodes import CallRecord, expected_tokens
from tests.gateway.harness import MODEL_NAME, Cluster

TIMEOUT_S = 10.0


def wait_until(condition: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


def all_calls(cluster: Cluster) -> list[CallRecord]:
    return [call for node in cluster.decode_nodes for call in node.calls]


def stream_lines(cluster: Cluster, body: dict[str, Any], num_lines: int) -> list[str]:
    """Open a streaming completion, read num_lines SSE lines, then drop the connection."""
    lines = []
    with httpx.Client(base_url=cluster.base_url, timeout=TIMEOUT_S) as client:
        with client.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if line:
                    lines.append(line)
                if len(lines) == num_lines:
                    break
    return lines


def test_admission_limit_gives_429_with_retry_after(make_cluster: StartCluster) -> None:
    cluster = make_cluster(max_num_requests=2)
    for node in cluster.decode_nodes:
        node.behaviour.token_delay_s = 0.05
    body = {"model": MODEL_NAME, "prompt": "a", "max_tokens": 20}

    async def scenario() -> tuple[list[int], httpx.Response]:
        async with httpx.AsyncClient(base_url=cluster.base_url, timeout=TIMEOUT_S) as client:
            slow = [asyncio.create_task(client.post("/v1/completions", json=body)) for _ in "ab"]
            await asyncio.sleep(0.3)  # both admitted and generating
            refused = await client.post("/v1/completions", json=body)
            return [r.status_code for r in await asyncio.gather(*slow)], refused

    statuses, refused = asyncio.run(asyncio.wait_for(scenario(), TIMEOUT_S))
    assert statuses == [200, 200]
    assert refused.status_code == 429
    assert refused.headers["Retry-After"] == "1"
    assert refused.json()["error"]["type"] == "rate_limit_error"
    again = httpx.post(f"{cluster.base_url}/v1/completions", json=body, timeout=TIMEOUT_S)
    assert again.status_code == 200


def test_client_disconnect_mid_stream_cancels_the_node_call(gw: Cluster) -> None:
    for node in gw.decode_nodes:
        node.behaviour.token_delay_s = 0.02
    body = {"model": MODEL_NAME, "prompt": "a", "max_tokens": 400, "stream": True, "n": 2}
    stream_lines(gw, body, 4)
    wait_until(lambda: len(all_calls(gw)) == 2 and all(c.cancelled for c in all_calls(gw)))
    assert all(c.num_tokens_sent < 400 for c in all_calls(gw))


def test_client_disconnect_non_streaming_cancels_the_node_call(gw: Cluster) -> None:
    for node in gw.decode_nodes:
        node.behaviour.token_delay_s = 0.02
    body = {"model": MODEL_NAME, "prompt": "a", "max_tokens": 400}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{gw.base_url}/v1/completions", json=body, timeout=0.5)
    wait_until(lambda: len(all_calls(gw)) == 1 and all_calls(gw)[0].cancelled)


def _client(cluster: Cluster) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{cluster.base_url}/v1", api_key="x", max_retries=0, timeout=TIMEOUT_S
    )


def test_node_dying_mid_stream_is_resubmitted_identically(
    make_cluster: StartCluster, tokenizer: Tokenizer, script: list[int]
) -> None:
    cluster = make_cluster(decode_behaviour=[{"die_after_tokens": 5}, {"extra_load": 100}])
    prompt = [40, 41, 42]
    stream = _client(cluster).completions.create(
        model=MODEL_NAME,
        prompt=prompt,
        max_tokens=12,
        seed=9,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    want = expected_tokens(script, 3, 9, 12)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == tokenizer.decode(want)
    assert chunks[-1].usage.completion_tokens == 12
    first, second = cluster.decode_nodes
    (died,) = first.calls
    (resumed,) = second.calls
    assert died.num_tokens_sent == 5
    assert list(resumed.request.prompt_token_ids) == prompt + want[:5]
    assert resumed.request.sampling_params.max_tokens == 7
    assert resumed.request.sampling_params.seed == 9


def test_unseeded_request_resumes_identically_too(
    make_cluster: StartCluster, tokenizer: Tokenizer, script: list[int]
) -> None:
    cluster = make_cluster(decode_behaviour=[{"die_after_tokens": 3}, {"extra_load": 100}])
    out = _client(cluster).completions.create(model=MODEL_NAME, prompt=[1, 2], max_tokens=8)
    seed = cluster.decode_nodes[0].calls[0].request.sampling_params.seed  # drawn by the gateway
    assert cluster.decode_nodes[1].calls[0].request.sampling_params.seed == seed
    assert out.choices[0].text == tokenizer.decode(expected_tokens(script, 2, seed, 8))


def test_only_node_dying_mid_stream_fails_clearly(make_cluster: StartCluster) -> None:
    cluster = make_cluster(decode_behaviour=[{"die_after_tokens": 4}], num_decode=1)
    start = time.monotonic()
    stream = _client(cluster).completions.create(
        model=MODEL_NAME, prompt="a", max_tokens=30, stream=True
    )
    with pytest.raises(openai.APIError) as info:
        list(stream)
    assert "mid-stream" in info.value.message
    assert time.monotonic() - start < 5


def test_only_node_dying_non_streaming_is_500(make_cluster: StartCluster) -> None:
    cluster = make_cluster(decode_behaviour=[{"die_after_tokens": 2}], num_decode=1)
    response = httpx.post(
        f"{cluster.base_url}/v1/completions",
        json={"model": MODEL_NAME, "prompt": "a", "max_tokens": 30},
        timeout=TIMEOUT_S,
    )
    assert response.status_code == 500
    assert "no other decode node" in response.json()["error"]["message"]


def test_full_node_is_skipped_before_the_first_token(make_cluster: StartCluster) -> None:
    full = {"reject_with": grpc.StatusCode.RESOURCE_EXHAUSTED}
    cluster = make_cluster(decode_behaviour=[full, {"extra_load": 100}])
    out = _client(cluster).completions.create(model=MODEL_NAME, prompt="a", max_tokens=3)
    assert out.usage.completion_tokens == 3
    assert [len(n.calls) for n in cluster.decode_nodes] == [1, 1]
    # refusing work does not make a node unhealthy
    assert httpx.get(f"{cluster.base_url}/health", timeout=TIMEOUT_S).status_code == 200


def test_every_node_full_is_503(make_cluster: StartCluster) -> None:
    full = {"reject_with": grpc.StatusCode.RESOURCE_EXHAUSTED}
    cluster = make_cluster(decode_behaviour=[full, full])
    with pytest.raises(openai.InternalServerError) as info:
        _client(cluster).completions.create(model=MODEL_NAME, prompt="a", max_tokens=3)
    assert info.value.status_code == 503
    assert "RESOURCE_EXHAUSTED" in info.value.message


def test_no_healthy_decode_node_is_503(make_cluster: StartCluster) -> None:
    cluster = make_cluster()
    for i in range(2):
        cluster.kill_decode_node(i)
    health = f"{cluster.base_url}/health"
    wait_until(lambda: httpx.get(health, timeout=TIMEOUT_S).status_code == 503)
    with grpc.insecure_channel(cluster.grpc_address) as channel:
        check = health_pb2_grpc.HealthStub(channel).Check
        status = check(health_pb2.HealthCheckRequest(), timeout=TIMEOUT_S).status
        deadline = time.monotonic() + 5  # the gRPC health follows within an update interval
        while status != health_pb2.HealthCheckResponse.NOT_SERVING:
            assert time.monotonic() < deadline
            time.sleep(0.05)
            status = check(health_pb2.HealthCheckRequest(), timeout=TIMEOUT_S).status
    response = httpx.post(
        f"{cluster.base_url}/v1/chat/completions",
        json={"model": MODEL_NAME, "messages": [{"role": "user", "content": "x"}], "stream": True},
        timeout=TIMEOUT_S,
    )
    assert response.status_code == 503
    assert response.json()["error"]["message"] == "no healthy decode node is available"


def test_no_prefill_node_is_degraded_not_unready(make_cluster: StartCluster) -> None:
    """Decode nodes prefill locally when no prefill node accepts: /health stays 200 (a
    readiness probe must not take a working gateway out of rotation) and says "degraded"."""
    cluster = make_cluster()
    health = f"{cluster.base_url}/health"
    wait_until(lambda: httpx.get(health, timeout=TIMEOUT_S).json()["status"] == "ok")
    cluster.prefill_nodes[0].accepting = False
    wait_until(lambda: httpx.get(health, timeout=TIMEOUT_S).json()["status"] == "degraded")
    reply = httpx.get(health, timeout=TIMEOUT_S)
    assert reply.status_code == 200
    assert reply.json()["nodes"]["prefill"] == {"accepting": 0, "total": 1}
    assert reply.json()["nodes"]["decode"] == {"accepting": 2, "total": 2}
    assert "127.0.0.1" not in reply.text  # no internal addresses
    completion = httpx.post(
        f"{cluster.base_url}/v1/completions",
        json={"model": MODEL_NAME, "prompt": "a", "max_tokens": 3},
        timeout=TIMEOUT_S,
    )
    assert completion.status_code == 200
    cluster.prefill_nodes[0].accepting = True
    wait_until(lambda: httpx.get(health, timeout=TIMEOUT_S).json()["status"] == "ok")


def test_request_deadline(make_cluster: StartCluster) -> None:
    cluster = make_cluster(request_timeout_s=0.5, decode_behaviour=[{"token_delay_s": 0.1}] * 2)
    start = time.monotonic()
    response = httpx.post(
        f"{cluster.base_url}/v1/completions",
        json={"model": MODEL_NAME, "prompt": "a", "max_tokens": 100},
        timeout=TIMEOUT_S,
    )
    assert response.status_code == 504
    assert response.json()["error"]["type"] == "timeout_error"
    assert time.monotonic() - start < 2
    wait_until(lambda: all(c.cancelled for c in all_calls(cluster)))


def test_drain_finishes_requests_in_flight_and_refuses_new_ones(make_cluster: StartCluster) -> None:
    cluster = make_cluster(decode_behaviour=[{"token_delay_s": 0.05}] * 2)
    body = {"model": MODEL_NAME, "prompt": "a", "max_tokens": 20}  # ~1 s of tokens
    url = f"{cluster.base_url}/v1/completions"
    result: dict[str, httpx.Response] = {}
    worker = threading.Thread(
        target=lambda: result.update(r=httpx.post(url, json=body, timeout=TIMEOUT_S))
    )
    worker.start()
    wait_until(lambda: len(all_calls(cluster)) == 1)
    cluster.bg.loop.call_soon_threadsafe(cluster.stop_event.set)
    wait_until(
        lambda: httpx.get(f"{cluster.base_url}/health", timeout=TIMEOUT_S).status_code == 503
    )
    refused = httpx.post(url, json=body, timeout=TIMEOUT_S)
    assert refused.status_code == 503 and refused.headers["Retry-After"] == "1"
    worker.join(TIMEOUT_S)
    assert result["r"].status_code == 200
    assert result["r"].json()["usage"]["completion_tokens"] == 20


@pytest.mark.parametrize("how", ["hang_after_tokens", "stall_after_tokens"])
def test_a_hung_decode_node_costs_its_streams_seconds_not_the_hang(
    make_cluster: StartCluster, tokenizer: Tokenizer, script: list[int], how: str
) -> None:
    """A node that stops mid-stream (its polls failing too, as under SIGSTOP, or still
    answering them, as with a stuck engine): the stream moves to the other node with its
    tokens so far within the stall bounds, the text is exact, and the hung call is cancelled."""
    cluster = make_cluster(
        decode_behaviour=[{how: 4, "token_delay_s": 0.02}, {"extra_load": 100}],
        stall_timeout_s=2.0,
    )
    start = time.monotonic()
    out = _client(cluster).completions.create(
        model=MODEL_NAME, prompt=[40, 41, 42], max_tokens=12, seed=5
    )
    elapsed = time.monotonic() - start
    assert out.choices[0].text == tokenizer.decode(expected_tokens(script, 3, 5, 12))
    first, second = cluster.decode_nodes
    assert first.calls[0].num_tokens_sent == 4
    assert list(second.calls[0].request.prompt_token_ids)[3:] == expected_tokens(script, 3, 5, 4)
    bound = 3.5 if how == "hang_after_tokens" else 4.5  # unhealthy after ~1.5 s; stall 2 s
    assert elapsed < bound, elapsed
    wait_until(lambda: first.calls[0].cancelled)
    first.hung = False


def test_a_resumed_structured_request_tells_the_new_node_what_it_generated(
    make_cluster: StartCluster,
) -> None:
    """The resubmission carries the constraint and how many of its prompt tokens were generated
    under it, so the new node's grammar matcher continues instead of starting over."""
    cluster = make_cluster(decode_behaviour=[{"die_after_tokens": 5}, {"extra_load": 100}])
    _client(cluster).completions.create(
        model=MODEL_NAME,
        prompt=[40, 41, 42],
        max_tokens=12,
        seed=9,
        extra_body={"structured_outputs": {"regex": "[a-z ]+"}},
    )
    first, second = cluster.decode_nodes
    died, resumed = first.calls[0].request, second.calls[0].request
    assert died.sampling_params.structured_output.num_generated_in_prompt == 0
    assert resumed.sampling_params.structured_output.value == "[a-z ]+"
    assert resumed.sampling_params.structured_output.num_generated_in_prompt == 5
