"""Tensor and pipeline parallelism (gloo, one process per rank, one thread each) give the
single-process engine's greedy fp32 output token for token: Llama at TP 2 and TP 4 (four
query heads, two key/value heads: at TP 4 each rank shares one key/value head with another),
Qwen2 (q/k/v biases) at TP 2; Llama at PP 2 and PP 3 (four layers: stages of 2, 1 and 1),
Qwen2 at PP 2; chunked prefill and continuous batching. Sizes that do not fit the model are
ValueErrors naming why."""

from __future__ import annotations

import random

import pytest
import torch

from pdserve.engine import LLM, SamplingParams

PARAMS = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def prompts() -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(3, 2000) for _ in range(rng.randrange(3, 70))] for _ in range(6)]


@pytest.fixture
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def generate(model: str, **kwargs) -> list[list[int]]:
    llm = LLM(model=model, dtype="float32", num_blocks=64, block_size=16,
              max_num_batched_tokens=48, **kwargs)  # fmt: skip  # 48: chunked prefills
    try:
        outputs = llm.generate(prompts(), PARAMS, use_tqdm=False)
        assert llm.engine.scheduler.kv.pool.num_free_blocks == 63
        return [o.outputs[0].token_ids for o in outputs]
    finally:
        llm.engine.close()


@pytest.mark.parametrize(
    ("arch", "kwargs"),
    [
        ("llama", {"tensor_parallel_size": 2}),
        ("llama", {"tensor_parallel_size": 4}),
        ("qwen2", {"tensor_parallel_size": 2}),
        ("llama", {"pipeline_parallel_size": 2}),
        ("llama", {"pipeline_parallel_size": 3}),
        ("qwen2", {"pipeline_parallel_size": 2}),
    ],
    ids=["llama-tp2", "llama-tp4", "qwen2-tp2", "llama-pp2", "llama-pp3", "qwen2-pp2"],
)
def test_parallel_equals_one_process(tiny_model_dir, one_thread, arch, kwargs) -> None:
    model = tiny_model_dir(arch)
    assert generate(model, **kwargs) == generate(model)


def test_sizes_that_do_not_divide_the_heads_are_value_errors(tiny_llama) -> None:
    with pytest.raises(ValueError, match="does not divide the 4 attention heads"):
        LLM(model=tiny_llama, dtype="float32", num_blocks=16, tensor_parallel_size=3)
    with pytest.raises(ValueError, match="exceeds the model's 4 layers"):
        LLM(model=tiny_llama, dtype="float32", num_blocks=16, pipeline_parallel_size=5)
    with pytest.raises(ValueError, match="together"):
        LLM(model=tiny_llama, dtype="float32", num_blocks=16, tensor_parallel_size=2,
            pipeline_parallel_size=2)  # fmt: skip
