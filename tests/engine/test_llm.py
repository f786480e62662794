"""The offline API end to end: sampling through the engine, logprobs, stops, n, preemption."""

from __future__ import annotations

import math

import pytest
import torch

from pdserve.engine import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(model=tiny_llama, dtype="float32", num_blocks=256, max_num_batched_tokens=128)


PROMPTS = [[11, 12, 13, 14, 15], [20] * 40, list(range(100, 170)), [7]]


def tokens(outputs):
    return [o.outputs[0].token_ids for o in outputs]


def test_seeded_sampling_is_independent_of_batch_mates(llm):
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=42, max_tokens=20)
    alone = tokens(llm.generate([PROMPTS[2]], seeded, use_tqdm=False))[0]
    mates = [SamplingParams(temperature=0.8, top_k=20, max_tokens=30)] * 3
    mixed = llm.generate(
        PROMPTS[:2] + [PROMPTS[2]] + PROMPTS[3:], mates[:2] + [seeded] + mates[2:], use_tqdm=False
    )
    assert tokens(mixed)[2] == alone
    other_seed = SamplingParams(temperature=1.0, top_p=0.9, seed=43, max_tokens=20)
    assert tokens(llm.generate([PROMPTS[2]], other_seed, use_tqdm=False))[0] != alone


def test_seeded_sampling_survives_preemption(tiny_llama):
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=48) for s in range(6)]
    prompts = [list(range(50 + 10 * i, 90 + 10 * i)) for i in range(6)]
    roomy = LLM(model=tiny_llama, dtype="float32", num_blocks=200, block_size=16)
    tight = LLM(model=tiny_llama, dtype="float32", num_blocks=12, block_size=16)
    expected = tokens(roomy.generate(prompts, params, use_tqdm=False))
    got = tokens(tight.generate(prompts, params, use_tqdm=False))
    assert tight.engine.scheduler.num_preemptions > 0
    assert got == expected


def test_logprobs_match_log_softmax_of_prompt_logits(llm):
    params = SamplingParams(temperature=0, max_tokens=3, logprobs=5)
    out = llm.generate([PROMPTS[0]], params, use_tqdm=False)[0].outputs[0]
    assert len(out.logprobs) == 3
    # recompute the logits of the prompt's last position with transformers as the reference
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(llm.engine.model_config.model, dtype=torch.float32)
    with torch.inference_mode():
        logits = hf(torch.tensor([PROMPTS[0]])).logits[0, -1]
    ref = torch.log_softmax(logits, -1)
    first = out.logprobs[0]
    assert first.token_id == out.token_ids[0] == int(ref.argmax())
    assert first.rank == 1
    assert math.isclose(first.logprob, float(ref.max()), abs_tol=1e-4)
    top = torch.topk(ref, 5)
    assert list(first.top) == top.indices.tolist()
    for tok, lp in first.top.items():
        assert math.isclose(lp, float(ref[tok]), abs_tol=1e-4)


def test_stop_strings_token_ids_min_tokens_and_n(llm):
    greedy = SamplingParams(temperature=0, max_tokens=24)
    base = llm.generate([PROMPTS[2]], greedy, use_tqdm=False)[0].outputs[0]
    # stop token id: the 5th generated token ends the request (and is kept, like eos)
    stop_id = base.token_ids[4]
    first = base.token_ids.index(stop_id)
    out = llm.generate(
        [PROMPTS[2]],
        SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[stop_id]),
        use_tqdm=False,
    )
    got = out[0].outputs[0]
    assert got.token_ids == base.token_ids[: first + 1] and got.finish_reason == "stop"
    assert got.stop_reason == stop_id
    # stop string: text is cut before it
    text = base.text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    if stop.strip():
        got = llm.generate(
            [PROMPTS[2]], SamplingParams(temperature=0, max_tokens=24, stop=[stop]), use_tqdm=False
        )[0].outputs[0]
        assert got.text == text[: text.find(stop)] and got.finish_reason == "stop"
        assert got.stop_reason == stop
    # n > 1 with a seed: children differ and are reproducible
    params = SamplingParams(temperature=1.0, n=3, seed=7, max_tokens=10)
    a = llm.generate([PROMPTS[0]], params, use_tqdm=False)[0]
    b = llm.generate([PROMPTS[0]], params, use_tqdm=False)[0]
    assert [c.index for c in a.outputs] == [0, 1, 2]
    assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
    assert len({tuple(c.token_ids) for c in a.outputs}) > 1


def test_min_tokens_blocks_eos(llm):
    eos = llm.engine.eos_token_id
    params = SamplingParams(temperature=0, max_tokens=12, min_tokens=12, stop_token_ids=[eos])
    out = llm.generate(PROMPTS, params, use_tqdm=False)
    for o in out:
        assert len(o.outputs[0].token_ids) == 12
        assert eos not in o.outputs[0].token_ids[:-1]


def test_string_prompts_and_text(llm):
    out = llm.generate(
        ["Hello world", "def f(x):"], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False
    )
    tok = llm.get_tokenizer()
    for o in out:
        assert o.prompt_token_ids == tok.encode(o.prompt)
        assert o.outputs[0].text == tok.decode(o.outputs[0].token_ids)


def test_bf16_runs_and_mostly_agrees(tiny_llama):
    llm32 = LLM(model=tiny_llama, dtype="float32", num_blocks=64)
    llm16 = LLM(model=tiny_llama, dtype="bfloat16", num_blocks=64)
    assert llm16.engine.runner.kv_cache.dtype == torch.bfloat16
    p = SamplingParams(temperature=0, max_tokens=4)
    a = tokens(llm32.generate(PROMPTS, p, use_tqdm=False))
    b = tokens(llm16.generate(PROMPTS, p, use_tqdm=False))
    assert sum(x[0] == y[0] for x, y in zip(a, b, strict=True)) >= 3


def test_reset_prefix_cache_forgets_cached_prompts(llm):
    """A repeated prompt is served from the prefix cache until reset_prefix_cache(), after
    which it is computed again (same tokens either way)."""
    prompt = [list(range(20, 20 + 70))]
    params = SamplingParams(temperature=0.0, max_tokens=4)
    first = llm.generate(prompt, params, use_tqdm=False)[0]
    again = llm.generate(prompt, params, use_tqdm=False)[0]
    assert again.num_cached_tokens == 64  # four full blocks; the last token is never cached
    assert llm.reset_prefix_cache() is True
    fresh = llm.generate(prompt, params, use_tqdm=False)[0]
    assert fresh.num_cached_tokens == 0
    assert first.outputs[0].token_ids == again.outputs[0].token_ids == fresh.outputs[0].token_ids
    llm.engine.add_request("held", prompt[0], params)
    llm.engine.step()
    assert llm.reset_prefix_cache() is False  # a request holds blocks
    for _ in range(50):  # 4 tokens: a few steps
        if not llm.engine.has_unfinished_requests():
            break
        llm.engine.step()
    assert llm.reset_prefix_cache() is True


def test_a_budget_below_max_num_seqs_is_warned_about(tiny_llama, caplog) -> None:
    with caplog.at_level("WARNING", logger="pdserve.engine.llm_engine"):
        LLM(model=tiny_llama, dtype="float32", num_blocks=64, max_num_batched_tokens=16,
            max_num_seqs=32)  # fmt: skip
    assert any(
        "max_num_batched_tokens 16 < max_num_seqs 32" in r.getMessage() for r in caplog.records
    )
    caplog.clear()
    with caplog.at_level("WARNING", logger="pdserve.engine.llm_engine"):
        LLM(model=tiny_llama, dtype="float32", num_blocks=64, max_num_batched_tokens=32,
            max_num_seqs=32)  # fmt: skip
    assert not any("max_num_batched_tokens" in r.getMessage() for r in caplog.records)
