"""Greedy tokens of the engine vs transformers' generate() on a real model, near-ties excepted
and counted (the check both real-checkpoint tests make)."""

from __future__ import annotations

import torch

from pdserve import LLM, SamplingParams

NEAR_TIE_NATS = 0.02
"""A first differing token is excused when transformers' top-2 logprobs there are closer than
this: fp32 summation order alone can flip such a choice."""

PAD_SLACK = 1.5
"""A batch of left-padded prompts may hold at most this many times its real prompt tokens..."""
SHORT_PROMPT = 64
"""...unless its longest prompt is no longer than this (padding a short batch costs little)."""
MAX_BATCH = 24


def _eos_ids(model) -> set[int]:
    eos = model.generation_config.eos_token_id
    if eos is None:
        eos = model.config.eos_token_id
    return set(eos) if isinstance(eos, list | tuple) else {eos}


def hf_greedy_batch(
    model, prompts: list[list[int]], max_new_tokens: int
) -> list[tuple[list[int], list[float]]]:
    """transformers' greedy tokens for each prompt, and each step's top-2 logprob gap (nats),
    from one generate() call over the prompts left-padded with an attention mask (as a user
    batches them). A row ends at its first end-of-sequence token, as generate() ends a lone
    prompt there; the tokens after it in a batch are padding."""
    eos_ids = _eos_ids(model)
    pad = min(eos_ids)
    longest = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (longest - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in prompts])
    out = model.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=max_new_tokens,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
        pad_token_id=pad,
    )
    logprobs = [torch.log_softmax(step.float(), -1).topk(2, dim=-1).values for step in out.logits]
    results = []
    for row in range(len(prompts)):
        tokens = out.sequences[row, longest:].tolist()
        end = next((i + 1 for i, t in enumerate(tokens) if t in eos_ids), len(tokens))
        gaps = [float(top2[row, 0] - top2[row, 1]) for top2 in logprobs[:end]]
        results.append((tokens[:end], gaps))
    return results


def length_batches(prompts: list[list[int]]) -> list[list[int]]:
    """Indices of prompts grouped by length (shortest first) so that left padding stays cheap:
    a batch's padded tokens are at most PAD_SLACK times its real ones, or its prompts are all
    short."""
    batches: list[list[int]] = []
    for i in sorted(range(len(prompts)), key=lambda i: len(prompts[i])):
        batch = batches[-1] if batches else None
        if batch is not None and len(batch) < MAX_BATCH:
            grown = [*batch, i]
            longest = len(prompts[i])  # sorted: the newcomer is the longest
            real = sum(len(prompts[j]) for j in grown)
            if longest <= SHORT_PROMPT or longest * len(grown) <= PAD_SLACK * real:
                batch.append(i)
                continue
        batches.append([i])
    return batches


def hf_greedy_all(model, prompts: list[list[int]], max_new_tokens: int):
    """hf_greedy_batch over prompts in length_batches; results in the prompts' order."""
    results: list = [None] * len(prompts)
    for batch in length_batches(prompts):
        outs = hf_greedy_batch(model, [prompts[i] for i in batch], max_new_tokens)
        for i, result in zip(batch, outs, strict=True):
            results[i] = result
    return results


def near_ties_vs_hf(llm: LLM, model, prompts: list[list[int]], max_new_tokens: int) -> list[int]:
    """Asserts every prompt's greedy tokens equal transformers' up to a near-tie; returns the
    positions of the near-ties (prompts that matched exactly add none)."""
    params = SamplingParams(temperature=0.0, max_tokens=max_new_tokens)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    near_ties = []
    with torch.inference_mode():
        references = hf_greedy_all(model, prompts, max_new_tokens)
    for prompt, out, (theirs, gaps) in zip(prompts, outputs, references, strict=True):
        ours = out.outputs[0].token_ids
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
