"""Greedy speculative decoding is lossless end to end: token for token the outputs of the plain
engine, for n-gram and draft-model proposers, with prefix caching, chunked prefill (budget 64)
and preemption."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from pdserve.engine import LLM, SamplingParams

ALWAYS = {"max_batch_for_speculation": 64, "min_expected_accepted": 0.0}
"""Policy off: speculate in every step, whatever the acceptance."""


def make_prompts() -> list[list[int]]:
    """20 prompts of 1..300 tokens: repetitive ones (n-gram proposes), random ones, and a few
    sharing a 64-token prefix (prefix cache hits)."""
    rng = random.Random(0)
    shared = [rng.randrange(5, 2000) for _ in range(64)]
    prompts = []
    for i, length in enumerate([1, 2, 5, 9, 17, 33, 40, 64, 80, 100, 130, 160, 200, 250, 300]):
        if i % 3 == 0:
            pattern = [rng.randrange(5, 2000) for _ in range(rng.randint(2, 7))]
            prompts.append((pattern * length)[:length])
        else:
            prompts.append([rng.randrange(5, 2000) for _ in range(length)])
    prompts += [shared + [rng.randrange(5, 2000) for _ in range(n)] for n in (1, 20, 70)]
    prompts += [[42] * 120, [7, 8] * 90]
    return prompts


PROMPTS = make_prompts()


def engine_args(model: str, **kw) -> dict:
    return dict(model=model, dtype="float32", num_blocks=512, max_num_batched_tokens=64) | kw


def generate(llm: LLM, params: list[SamplingParams]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def expected(tiny_llama: str) -> tuple[list[SamplingParams], list[list[int]]]:
    """Greedy params (max_tokens 8..48; stop ids on some, picked so they land mid-output)
    and the plain engine's outputs for them."""
    params = [
        SamplingParams(temperature=0.0, max_tokens=8 + (5 * i) % 41, ignore_eos=i % 4 == 0)
        for i in range(len(PROMPTS))
    ]
    plain = LLM(**engine_args(tiny_llama))
    first = generate(plain, params)
    for i in range(1, len(params), 4):
        params[i] = replace(params[i], stop_token_ids=(first[i][len(first[i]) // 2],))
    return params, generate(plain, params)


def check_lossless(llm: LLM, expected) -> None:
    params, outputs = expected
    assert generate(llm, params) == outputs
    engine = llm.engine
    assert engine.kv.num_free_blocks == engine.num_blocks - 1  # no block leaked
    proposer = engine.speculator.proposer
    if hasattr(proposer, "kv"):
        assert proposer.kv.num_free_blocks == proposer.kv.pool.num_blocks - 1
        assert proposer.num_computed == {}


def test_ngram(tiny_llama, expected):
    llm = LLM(**engine_args(tiny_llama), speculative_config={"method": "ngram", **ALWAYS})
    check_lossless(llm, expected)
    stats = llm.engine.spec_stats
    # Budget 64: steps that carry a running prompt's chunk leave drafts little or nothing.
    assert stats.num_drafts > 10 and stats.num_accepted_tokens > 10


def test_ngram_with_the_default_policy(tiny_llama, expected):
    llm = LLM(**engine_args(tiny_llama), speculative_config={"method": "ngram"})
    check_lossless(llm, expected)
    assert llm.engine.spec_stats.num_drafts > 0


def test_draft_model_equal_to_target_is_accepted(tiny_llama, expected):
    config = {"method": "draft_model", "model": tiny_llama, "num_speculative_tokens": 4, **ALWAYS}
    llm = LLM(**engine_args(tiny_llama), speculative_config=config)
    check_lossless(llm, expected)
    assert llm.engine.spec_stats.acceptance_rate >= 0.95


def test_unrelated_draft_model_changes_nothing(tiny_llama, random_draft, expected):
    config = {"method": "draft_model", "model": random_draft, **ALWAYS}
    llm = LLM(**engine_args(tiny_llama), speculative_config=config)
    check_lossless(llm, expected)
    assert llm.engine.spec_stats.num_drafts > 100


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_under_preemption(tiny_llama, expected, method):
    config = {"method": method, "model": tiny_llama, "draft_num_blocks": 40, **ALWAYS}
    llm = LLM(**engine_args(tiny_llama, num_blocks=40), speculative_config=config)
    check_lossless(llm, expected)
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.spec_stats.num_accepted_tokens > 0
