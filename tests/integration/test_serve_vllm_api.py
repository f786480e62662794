"""vLLM's sampling extensions through `pdserve serve` (1 prefill + 1 decode node, KV over UCX or
TCP) with the official openai client: logit_bias, allowed_token_ids and bad_words reach both
tiers (the prefill node samples the first token under them, the decode node the rest) and give
what the offline engine gives; batched prompts too."""

from __future__ import annotations

import random

import openai
import pytest

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.tokenizer import Tokenizer
from pdserve.gateway.sampling import bad_words_token_ids
from tests.integration.stack import BLOCK, start_stack

TIMEOUT_S = 120.0
PROMPT_LEN = 40
"""Long enough to be prefilled on the prefill node (--remote-prefill-min-tokens 16)."""


@pytest.fixture(scope="module")
def stack(tiny_llama, tmp_path_factory):
    s = start_stack(tiny_llama, tmp_path_factory.mktemp("vllm_api"), num_prefill=1, num_decode=1)
    try:
        yield s
    finally:
        code = s.proc.stop(timeout_s=40)
        assert code == 0, f"pdserve serve exited with {code}:\n{s.proc.log()}"


@pytest.fixture(scope="module")
def offline(tiny_llama):
    return LLM(model=tiny_llama, dtype="float32", block_size=BLOCK, num_blocks=512)


@pytest.fixture(scope="module")
def client(stack):
    return openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key="none", timeout=TIMEOUT_S)


def prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 2000) for _ in range(PROMPT_LEN)]


def offline_ids(offline: LLM, tokens: list[int], **kwargs) -> list[int]:
    params = SamplingParams(max_tokens=8, temperature=0.0, **kwargs)
    return offline.generate([tokens], params, use_tqdm=False)[0].outputs[0].token_ids


def served_ids(client: openai.OpenAI, tokens: list[int], **extra) -> list[int]:
    logit_bias = extra.pop("logit_bias", None)
    out = client.completions.create(
        model=client.models.list().data[0].id,
        prompt=tokens,
        max_tokens=8,
        temperature=0.0,
        logit_bias=logit_bias,
        extra_body={**extra, "return_token_ids": True},
    )
    return out.choices[0].token_ids  # type: ignore[attr-defined]


def test_logit_bias_on_both_tiers_equals_offline(client, offline):
    tokens = prompt(1)
    plain = offline_ids(offline, tokens)
    # Ban the greedy first token (sampled by the prefill node) and force a later one in.
    bias = {plain[0]: -100.0, 77: 30.0}
    want = offline_ids(offline, tokens, logit_bias=bias)
    assert want != plain and want[0] != plain[0]
    got = served_ids(client, tokens, logit_bias={str(t): v for t, v in bias.items()})
    assert got == want


def test_allowed_token_ids_equal_offline(client, offline):
    tokens = prompt(2)
    allowed = [5, 300, 301, 1500]
    want = offline_ids(offline, tokens, allowed_token_ids=tuple(allowed))
    got = served_ids(client, tokens, allowed_token_ids=allowed)
    assert got == want and set(got) <= set(allowed)


def test_bad_words_equal_offline(client, offline, tiny_llama):
    tokens = prompt(3)
    plain = offline_ids(offline, tokens)
    tokenizer = Tokenizer.from_pretrained(tiny_llama)
    words = [tokenizer.decode([plain[0]]), tokenizer.decode(plain[2:4])]
    word_ids = tuple(tuple(w) for w in bad_words_token_ids(tokenizer, words))
    want = offline_ids(offline, tokens, bad_words_token_ids=word_ids)
    assert want != plain
    assert served_ids(client, tokens, bad_words=words) == want


def test_batched_prompts_equal_offline(client, offline):
    prompts = [prompt(4), prompt(5)[:10]]  # one remote prefill, one local
    out = client.completions.create(
        model=client.models.list().data[0].id,
        prompt=prompts,
        max_tokens=6,
        temperature=0.0,
        n=2,
        extra_body={"return_token_ids": True},
    )
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    for choice in out.choices:
        want = offline_ids(offline, prompts[choice.index // 2])[:6]
        assert choice.token_ids == want  # type: ignore[attr-defined]


def test_prompt_logprobs_equal_offline(client, offline):
    """prompt_logprobs through serve (the decode node computes such a prompt itself) equal the
    offline engine's; asked twice, the second time the prompt's blocks are cached and every
    position is still scored; echo with logprobs reports the same numbers."""
    tokens = prompt(6)
    params = SamplingParams(max_tokens=4, temperature=0.0, prompt_logprobs=2)
    want = offline.generate([tokens], params, use_tqdm=False)[0]
    model = client.models.list().data[0].id
    for _ in range(2):
        out = client.completions.create(
            model=model, prompt=tokens, max_tokens=4, temperature=0.0,
            extra_body={"prompt_logprobs": 2, "return_token_ids": True},
        )  # fmt: skip
        choice = out.choices[0]
        assert choice.token_ids == want.outputs[0].token_ids  # type: ignore[attr-defined]
        got = choice.prompt_logprobs  # type: ignore[attr-defined]
        assert len(got) == len(tokens) and got[0] is None
        for entry, expected in zip(got[1:], want.prompt_logprobs[1:], strict=True):
            assert entry[str(expected.token_id)]["rank"] == expected.rank
            assert abs(entry[str(expected.token_id)]["logprob"] - expected.logprob) < 1e-4
            assert [int(t) for t in entry][1:] == [
                t for t in expected.top if t != expected.token_id
            ][: len(entry) - 1]
    echoed = client.completions.create(
        model=model, prompt=tokens, max_tokens=4, temperature=0.0, echo=True, logprobs=1
    )
    scores = echoed.choices[0].logprobs.token_logprobs
    assert scores[0] is None and len(scores) == len(tokens) + 4
    for score, expected in zip(scores[1 : len(tokens)], want.prompt_logprobs[1:], strict=True):
        assert abs(score - expected.logprob) < 1e-4
