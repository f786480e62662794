"""Greedy generation token-for-token equal to transformers' generate() (fp32), for every
architecture, under prefix caching on/off, chunked prefill, block sizes 16/32, and a KV cache
small enough to force preemption."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from pdserve.engine import LLM, SamplingParams

ARCHS = ["llama", "qwen2", "qwen3", "mistral"]
PROMPT_LENS = [1, 7, 33, 64, 100, 150, 260, 300]


def make_prompts(vocab_size: int) -> tuple[list[list[int]], list[int]]:
    """8 prompts, 1..300 tokens; several share long prefixes (prompt i+4 extends prompt i's
    first tokens) so prefix caching has something to reuse. Returns prompts and max_tokens."""
    rng = random.Random(1234)
    base = [rng.randrange(10, vocab_size) for _ in range(300)]
    prompts = []
    for i, n in enumerate(PROMPT_LENS):
        if i >= 4:  # shares the first n - 20 tokens with the common base
            tail = [rng.randrange(10, vocab_size) for _ in range(20)]
            prompts.append(base[: n - 20] + tail)
        else:
            prompts.append([rng.randrange(10, vocab_size) for _ in range(n)])
    max_tokens = [32 + 4 * i for i in range(len(prompts))]  # 32..60
    return prompts, max_tokens


@pytest.fixture(scope="module", params=ARCHS)
def reference(request):
    """(model dir, prompts, max_tokens, transformers' greedy outputs) for one architecture."""
    from transformers import AutoModelForCausalLM

    model_dir = request.getfixturevalue(f"tiny_{request.param}")
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    prompts, max_tokens = make_prompts(hf.config.vocab_size)
    outputs: dict[bool, list[list[int]]] = {False: [], True: []}
    with torch.inference_mode():
        for ids, n in zip(prompts, max_tokens, strict=True):
            for full_length in (False, True):  # True: eos suppressed until max_tokens
                out = hf.generate(
                    torch.tensor([ids]),
                    max_new_tokens=n,
                    min_new_tokens=n if full_length else 0,
                    do_sample=False,
                    attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                )
                outputs[full_length].append(out[0, len(ids) :].tolist())
    return model_dir, prompts, max_tokens, outputs


def blocks_needed(prompts, max_tokens, block_size):
    return [-(-(len(p) + n) // block_size) for p, n in zip(prompts, max_tokens, strict=True)]


COMBOS = list(itertools.product([True, False], [64, 2048], [16, 32], [False, True]))


@pytest.mark.parametrize(
    "prefix_caching,budget,block_size,small_kv",
    COMBOS,
    ids=[f"cache={c}-budget={b}-bs={s}-smallkv={k}" for c, b, s, k in COMBOS],
)
def test_greedy_matches_transformers(
    reference, prefix_caching, budget, block_size, small_kv, prefill_cap=None
):
    model_dir, prompts, max_tokens, references = reference
    # With the small cache every request runs to max_tokens (min_tokens, eos suppressed on both
    # sides), so the cache is sure to overflow and preempt; otherwise eos ends requests.
    expected = references[small_kv]
    need = blocks_needed(prompts, max_tokens, block_size)
    # small: room for the largest request alone (+ the null block), far less than all at once
    num_blocks = max(need) + 1 if small_kv else sum(need) + 8
    llm = LLM(
        model=model_dir,
        dtype="float32",
        block_size=block_size,
        num_blocks=num_blocks,
        max_num_batched_tokens=budget,
        max_prefill_tokens_while_decoding=prefill_cap,
        enable_prefix_caching=prefix_caching,
        max_num_seqs=16,
    )
    params = [
        SamplingParams(temperature=0.0, max_tokens=n, min_tokens=n if small_kv else 0)
        for n in max_tokens
    ]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    got = [o.outputs[0].token_ids for o in outputs]
    for i, (g, e) in enumerate(zip(got, expected, strict=True)):
        assert g == e, f"prompt {i} ({len(prompts[i])} tokens) diverged at {_first_diff(g, e)}"
    eos = llm.engine.eos_token_ids
    reasons = [o.outputs[0].finish_reason for o in outputs]
    assert reasons == ["stop" if e[-1] in eos else "length" for e in expected]
    sched = llm.engine.scheduler
    if small_kv:
        assert sched.num_preemptions > 0, "the small KV cache was meant to force preemption"
    if prefix_caching:
        assert llm.engine.kv.prefix_hits > 0
        # a second round is served from the cache and still gives the same tokens
        again = llm.generate(prompts[4:], params[4:], use_tqdm=False)
        assert [o.outputs[0].token_ids for o in again] == expected[4:]
        assert all(o.num_cached_tokens > 0 for o in again)
    # nothing leaks: every block is free again (cached blocks count as free)
    assert llm.engine.kv.num_free_blocks == num_blocks - 1


@pytest.mark.parametrize("small_kv", [False, True], ids=["kv", "smallkv"])
def test_greedy_matches_transformers_with_prompts_capped_beside_decodes(reference, small_kv):
    """Prompts spread over the decode steps in 24-token chunks (after the first step's 64)."""
    test_greedy_matches_transformers(reference, True, 64, 16, small_kv, prefill_cap=24)


def _first_diff(a, b):
    return next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )
