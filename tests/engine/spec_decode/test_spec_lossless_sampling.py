"""Sampling with speculation is lossless in distribution: over many seeds, the first tokens
sampled with speculation follow the plain engine's distribution (two-sample chi-square per
position), at temperature 1 with top-p, for a draft model whose q differs from p and for
n-gram's one-hot q. The target is tiny_llama with a sharpened lm_head (a few likely tokens
per position, so the test has power)."""

from __future__ import annotations

from collections import Counter

import pytest

from pdserve.engine import LLM, SamplingParams
from tests.engine.spec_decode.stats import homogeneity

N = 1000
"""Requests (seeds) per run."""
ALWAYS = {"max_batch_for_speculation": 10**6, "min_expected_accepted": 0.0}


def generate(target: str, prompt: list[int], seeds: range, speculative_config=None):
    llm = LLM(
        model=target,
        dtype="float32",
        num_blocks=2 * N + 64,
        max_num_seqs=N,
        max_num_batched_tokens=8 * N,
        speculative_config=speculative_config,
    )
    params = [
        SamplingParams(temperature=1.0, top_p=0.9, seed=s, max_tokens=4, ignore_eos=True)
        for s in seeds
    ]
    outputs = llm.generate([prompt] * len(seeds), params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs], llm.engine.spec_stats


@pytest.fixture(scope="module")
def target(sharp_models) -> str:
    return sharp_models(16)


@pytest.fixture(scope="module")
def prompt(target: str) -> list[int]:
    """X + (greedy continuation of X) + X: n-gram proposes the continuation, which the target
    often but not always samples."""
    x = [100, 200, 300, 400, 500]
    llm = LLM(model=target, dtype="float32", num_blocks=16)
    greedy = llm.generate([x], SamplingParams(temperature=0.0, max_tokens=6), use_tqdm=False)
    return x + greedy[0].outputs[0].token_ids + x


@pytest.fixture(scope="module")
def plain(target: str, prompt: list[int]) -> list[list[int]]:
    return generate(target, prompt, range(N, 2 * N))[0]  # seeds apart from the runs below


def assert_same_distribution(spec: list[list[int]], plain: list[list[int]]) -> None:
    # Position 0 is the prefill's token (never speculative); 1..3 come from verification.
    for position in (1, 2, 3):
        p_value = homogeneity(
            Counter(t[position] for t in spec), Counter(t[position] for t in plain)
        )
        assert p_value > 1e-3, f"position {position}: p = {p_value:.2g}"


def test_draft_model_with_a_different_distribution(sharp_models, target, prompt, plain):
    config = {"method": "draft_model", "model": sharp_models(8), **ALWAYS}
    spec, stats = generate(target, prompt, range(N), config)
    assert_same_distribution(spec, plain)
    # q != p: drafts are accepted often, and rejected often (both paths exercised)
    assert 0.1 < stats.acceptance_rate < 0.8 and stats.num_accepted_tokens_per_pos[1] > 50


def test_ngram_one_hot_drafts(target, prompt, plain):
    spec, stats = generate(target, prompt, range(N), {"method": "ngram", **ALWAYS})
    assert_same_distribution(spec, plain)
    assert 0.1 < stats.acceptance_rate < 0.8 and stats.num_drafts > N / 4
