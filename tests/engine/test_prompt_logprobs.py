"""prompt_logprobs against transformers: each prompt token's logprob (after the first) under
the model's logits at the position before it, its rank and the top-N, fp32 within 1e-4 —
whole prompts, chunked prefill, a prompt the prefix cache already holds, and recomputation
after preemption (nothing scored twice, nothing missing)."""

from __future__ import annotations

import pytest
import torch
import transformers

from pdserve.engine import LLM, SamplingParams

PROMPTS = [[5, 6], list(range(100, 157)), [7, 8, 9] * 30]


@pytest.fixture(scope="module")
def hf_logprobs(tiny_llama: str) -> list[torch.Tensor]:
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        return [
            torch.log_softmax(model(torch.tensor([p])).logits[0].float(), dim=-1) for p in PROMPTS
        ]


def assert_matches(prompt: list[int], got, want: torch.Tensor, num_top: int) -> None:
    assert len(got) == len(prompt)
    assert got[0] is None
    for i in range(1, len(prompt)):
        entry, row = got[i], want[i - 1]
        assert entry.token_id == prompt[i]
        assert abs(entry.logprob - row[prompt[i]].item()) < 1e-4, f"position {i}"
        assert entry.rank == int((row > row[prompt[i]]).sum()) + 1
        top = row.topk(num_top)
        assert list(entry.top) == top.indices.tolist() or num_top == 0
        for token, value in entry.top.items():
            assert abs(value - row[token].item()) < 1e-4


def run(llm: LLM, num_top: int, max_tokens: int = 4):
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, prompt_logprobs=num_top)
    return llm.generate(PROMPTS, params, use_tqdm=False)


@pytest.mark.parametrize("budget", [512, 16])  # whole prompts; chunks of at most 16 tokens
@pytest.mark.parametrize("num_top", [0, 5])
def test_prompt_logprobs_equal_transformers(tiny_llama, hf_logprobs, budget, num_top) -> None:
    llm = LLM(model=tiny_llama, dtype="float32", num_blocks=64, block_size=16,
              max_num_batched_tokens=budget)  # fmt: skip
    outputs = run(llm, num_top)
    for prompt, out, want in zip(PROMPTS, outputs, hf_logprobs, strict=True):
        assert_matches(prompt, out.prompt_logprobs, want, num_top)
    # the generated tokens are those of a request without prompt logprobs
    plain = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in plain]
    assert plain[0].prompt_logprobs is None
    assert llm.engine.scheduler.kv.pool.num_free_blocks == 63


def test_prompt_logprobs_despite_a_cached_prefix(tiny_llama, hf_logprobs) -> None:
    llm = LLM(model=tiny_llama, dtype="float32", num_blocks=64, block_size=16)
    llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)
    outputs = run(llm, 2)  # the prompts' blocks are cached now; their positions still scored
    for prompt, out, want in zip(PROMPTS, outputs, hf_logprobs, strict=True):
        assert_matches(prompt, out.prompt_logprobs, want, 2)
    assert outputs[1].num_cached_tokens == 0


def test_prompt_logprobs_survive_preemption(tiny_llama, hf_logprobs) -> None:
    # 19 blocks of 8 tokens cannot hold all three requests (4 + 11 + 15 blocks) at once
    llm = LLM(model=tiny_llama, dtype="float32", num_blocks=20, block_size=8,
              max_num_batched_tokens=32, enable_prefix_caching=False)  # fmt: skip
    outputs = run(llm, 3, max_tokens=30)
    assert llm.engine.scheduler.num_preemptions > 0
    for prompt, out, want in zip(PROMPTS, outputs, hf_logprobs, strict=True):
        assert_matches(prompt, out.prompt_logprobs, want, 3)


def test_prompt_logprobs_out_of_range_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=21)
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=-1)
