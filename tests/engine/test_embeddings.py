"""Embeddings against transformers: the final hidden states (last_hidden_state) of the same
model, pooled the same way, fp32 within 1e-4; single and batched; bad input named."""

from __future__ import annotations

import pytest
import torch
import transformers

from pdserve.engine import LLM

PROMPTS = [[5], [11, 12, 13, 14, 15, 16, 17], list(range(100, 190)), [7, 8] * 40]


@pytest.fixture(scope="module")
def llm(tiny_llama: str) -> LLM:
    # a small token budget and block size: the batch is split over several forwards
    return LLM(model=tiny_llama, dtype="float32", num_blocks=64, block_size=16,
               max_num_batched_tokens=128)  # fmt: skip


@pytest.fixture(scope="module")
def hf_states(tiny_llama: str) -> list[torch.Tensor]:
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        return [model.model(torch.tensor([p])).last_hidden_state[0].float() for p in PROMPTS]


def reference(states: torch.Tensor, pooling: str, normalize: bool) -> torch.Tensor:
    vector = {"last": states[-1], "cls": states[0], "mean": states.mean(0)}[pooling]
    return torch.nn.functional.normalize(vector, dim=0) if normalize else vector


@pytest.mark.parametrize("pooling", ["last", "mean", "cls"])
@pytest.mark.parametrize("normalize", [True, False])
def test_embeddings_equal_transformers_pooled(llm, hf_states, pooling, normalize) -> None:
    batched = llm.embed(PROMPTS, pooling=pooling, normalize=normalize)
    for i, (out, states) in enumerate(zip(batched, hf_states, strict=True)):
        got = torch.tensor(out.outputs.embedding)
        want = reference(states, pooling, normalize)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4, msg=f"prompt {i}")
        (single,) = llm.embed([PROMPTS[i]], pooling=pooling, normalize=normalize)
        torch.testing.assert_close(torch.tensor(single.outputs.embedding), got, atol=1e-5, rtol=0)
    assert llm.engine.scheduler.kv.pool.num_free_blocks == 63  # every block back


def test_embedding_leaves_generation_exact(llm) -> None:
    from pdserve.engine import SamplingParams

    params = SamplingParams(max_tokens=8, temperature=0.0)
    before = llm.generate([PROMPTS[2]], params, use_tqdm=False)[0].outputs[0].token_ids
    llm.embed(PROMPTS)
    after = llm.generate([PROMPTS[2]], params, use_tqdm=False)[0].outputs[0].token_ids
    assert before == after


@pytest.mark.parametrize(
    "prompts,kwargs,message",
    [
        ([[]], {}, "input 0 is empty"),
        ([[1, 10**9]], {}, "outside the vocabulary"),
        ([[1]], {"pooling": "max"}, "pooling must be one of"),
        ([], {}, "no input"),
    ],
)
def test_bad_input_is_a_value_error(llm, prompts, kwargs, message) -> None:
    with pytest.raises(ValueError, match=message):
        llm.engine.embed(prompts, **kwargs)
