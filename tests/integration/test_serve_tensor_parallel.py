"""KV transfer between tiers of different tensor-parallel sizes through `pdserve serve` (KV over
UCX or TCP): a prefill node at TP 2 feeding a decode node at TP 1, and a prefill node at TP 1
feeding a decode node at TP 2. The wire carries every key/value head; a TP 2 prefill node
gathers its ranks' heads before sending, a TP 2 decode node scatters them to its ranks. Both
give the aggregated single-process engine's greedy tokens, with the prompts prefilled
remotely."""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from pdserve.engine import LLM, SamplingParams
from tests.integration.stack import BLOCK, start_stack

TIMEOUT_S = 120.0
MAX_TOKENS = 8


def prompts() -> list[list[int]]:
    rng = random.Random(5)
    return [[rng.randrange(3, 2000) for _ in range(rng.randrange(20, 80))] for _ in range(6)]


@pytest.fixture(scope="module")
def expected(tiny_llama) -> list[list[int]]:
    llm = LLM(model=tiny_llama, dtype="float32", block_size=BLOCK, num_blocks=256)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts(), params, use_tqdm=False)]


@pytest.mark.parametrize("tp_tier", ["prefill", "decode"])
def test_kv_moves_between_tensor_parallel_sizes(tiny_llama, expected, tmp_path, tp_tier) -> None:
    extra = [f"--{tp_tier}-node-arg=--tensor-parallel-size=2"]
    stack = start_stack(tiny_llama, tmp_path, num_prefill=1, num_decode=1, extra=extra)
    try:
        client = openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key="none", timeout=TIMEOUT_S)
        model = client.models.list().data[0].id

        def served(tokens: list[int]) -> list[int]:
            out = client.completions.create(
                model=model, prompt=tokens, max_tokens=MAX_TOKENS, temperature=0.0,
                extra_body={"return_token_ids": True, "ignore_eos": True},
            )  # fmt: skip
            return out.choices[0].token_ids  # type: ignore[attr-defined]

        with ThreadPoolExecutor(3) as pool:
            got = list(pool.map(served, prompts(), timeout=TIMEOUT_S))
        assert got == expected
        total = sum(len(p) for p in prompts())
        prefilled = stack.node_counter("prefill-0", "pdserve:prompt_tokens_total")
        assert prefilled >= total * 0.9, "the prompts were not prefilled remotely"
        stack.wait_all_blocks_free()
    finally:
        code = stack.proc.stop(timeout_s=40)
    assert code == 0, stack.proc.log()
