"""Speculative decoding served: `pdserve serve --speculative-config` (disaggregated: the draft
model catches up on prompts whose target KV came from a prefill node) equals the offline engine
without speculation, token for token (greedy), and the decode node reports accepted drafts."""

from __future__ import annotations

import json
import random
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from pdserve.engine import LLM, SamplingParams
from tests.integration.stack import BLOCK, start_stack
from tests.integration.test_serve import grpc_generate

TIMEOUT_S = 120.0


@pytest.fixture(scope="module")
def spec_stack(tiny_llama, tmp_path_factory):
    # the draft is the target itself: every draft should be accepted, so a mismatch would show
    config = {
        "method": "draft_model",
        "model": tiny_llama,
        "num_speculative_tokens": 3,
        "max_batch_for_speculation": 64,
    }
    extra = ["--speculative-config", json.dumps(config)]
    s = start_stack(tiny_llama, tmp_path_factory.mktemp("spec"), 1, 1, extra=extra)
    try:
        yield s
    finally:
        s.proc.stop(timeout_s=40)


def test_disaggregated_speculative_output_equals_offline(spec_stack, tiny_llama):
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 2000) for _ in range(rng.randrange(5, 150))] for _ in range(12)]
    params = SamplingParams(max_tokens=24, temperature=0.0)
    with ThreadPoolExecutor(12) as pool:
        futures = [
            pool.submit(grpc_generate, spec_stack.grpc_address, spec_stack.model, p, params)
            for p in prompts
        ]
        served = [f.result(timeout=TIMEOUT_S) for f in futures]
    offline = LLM(model=tiny_llama, dtype="float32", block_size=BLOCK, num_blocks=512)
    want = offline.generate(prompts, params, use_tqdm=False)
    for i, ((ids, _), w) in enumerate(zip(served, want, strict=True)):
        assert ids[0] == w.outputs[0].token_ids, f"request {i}"
    metrics_address = spec_stack.nodes["decode-0"]["metrics_address"]
    text = urllib.request.urlopen(f"http://{metrics_address}/metrics", timeout=10).read().decode()
    accepted = [
        float(line.split()[-1])
        for line in text.splitlines()
        if line.startswith("pdserve:spec_decode_num_accepted_tokens_total")
    ]
    assert accepted and accepted[0] > 0, "the decode node accepted no drafts"
    spec_stack.wait_all_blocks_free()
