"""vLLM's metric names beside ours: the same samples under vllm: names with vLLM's labels
(model_name, finished_reason), read at scrape time, on the gateway and on a node."""

from __future__ import annotations

import time

from pdserve.common import metrics
from pdserve.common.node_metrics import NodeMetrics
from pdserve.gateway.metrics import GatewayMetrics
from tests.observability.test_units import fake_engine


def test_gateway_exposes_vllm_request_series() -> None:
    m = GatewayMetrics("tiny", lambda: 0)
    timer = m.sequence(time.monotonic(), 5)
    timer.on_tokens(1, "n")
    timer.on_tokens(2, "n")
    timer.finish("stop")
    m.sequence(time.monotonic(), 3).finish("length")
    get = m.registry.get_sample_value
    model = {"model_name": "tiny"}
    assert get("vllm:prompt_tokens_total", model) == 8
    assert get("vllm:generation_tokens_total", model) == 3
    assert get("vllm:request_success_total", {**model, "finished_reason": "stop"}) == 1
    assert get("vllm:request_success_total", {**model, "finished_reason": "length"}) == 1
    assert get("vllm:time_to_first_token_seconds_count", model) == 1
    assert get("vllm:inter_token_latency_seconds_count", model) == 1
    assert get("vllm:time_per_output_token_seconds_count", model) == 1
    assert get("vllm:e2e_request_latency_seconds_count", model) == 2
    assert get("vllm:e2e_request_latency_seconds_bucket", {**model, "le": "+Inf"}) == 2
    ours = get("pdserve:e2e_request_latency_seconds_sum", {**model, "role": "gateway"})
    assert get("vllm:e2e_request_latency_seconds_sum", model) == ours
    text = metrics.exposition(m.registry).decode()
    assert 'vllm:request_success_total{finished_reason="stop",model_name="tiny"} 1.0' in text


def test_node_exposes_vllm_engine_series() -> None:
    engine = fake_engine(None)
    node = NodeMetrics(engine, "decode", "tiny", "d0")
    engine.state.num_running = 7  # read when scraped
    get = node.registry.get_sample_value
    model = {"model_name": "tiny"}
    assert get("vllm:num_requests_running", model) == 7
    assert get("vllm:num_requests_waiting", model) == 1
    assert get("vllm:kv_cache_usage_perc", model) == 0.25
    assert get("vllm:gpu_cache_usage_perc", model) == 0.25
    assert get("vllm:num_preemptions_total", model) == 4
    assert get("vllm:prefix_cache_hits_total", model) == 40
    # Request series are the gateway's alone: a sum over targets never counts one twice.
    assert get("vllm:prompt_tokens_total", model) is None
