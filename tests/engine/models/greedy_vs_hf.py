"""Greedy tokens of the engine vs transformers' generate() on a real model, near-ties excepted
and counted (the check both real-checkpoint tests make)."""

from __future__ import annotations

import torch

from pdserve import LLM, SamplingParams

NEAR_TIE_NATS = 0.02
"""A first differing token is excused when transformers' top-2 logprobs there are closer than
this: fp32 summation order alone can flip such a choice."""


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> tuple[list[int], list[float]]:
    """transformers' greedy tokens, and each step's top-2 logprob gap (nats)."""
    out = model.generate(
        torch.tensor([prompt_ids]),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
        pad_token_id=model.config.eos_token_id,
    )
    tokens = out.sequences[0, len(prompt_ids) :].tolist()
    gaps = []
    for logits in out.logits:
        top2 = torch.log_softmax(logits[0].float(), -1).topk(2).values
        gaps.append(float(top2[0] - top2[1]))
    return tokens, gaps


def near_ties_vs_hf(llm: LLM, model, prompts: list[list[int]], max_new_tokens: int) -> list[int]:
    """Asserts every prompt's greedy tokens equal transformers' up to a near-tie; returns the
    positions of the near-ties (prompts that matched exactly add none)."""
    params = SamplingParams(temperature=0.0, max_tokens=max_new_tokens)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    near_ties = []
    with torch.inference_mode():
        for prompt, out in zip(prompts, outputs, strict=True):
            ours = out.outputs[0].token_ids
            theirs, gaps = hf_greedy(model, prompt, max_new_tokens)
            if ours == theirs:
                continue
            common = min(len(ours), len(theirs))
            diverge = next((i for i in range(common) if ours[i] != theirs[i]), common)
            assert diverge < len(gaps) and gaps[diverge] < NEAR_TIE_NATS, (
                f"prompt of {len(prompt)} tokens: token {diverge} differs (ours "
                f"{ours[diverge : diverge + 3]}, transformers {theirs[diverge : diverge + 3]})"
            )
            near_ties.append(diverge)
    return near_ties
