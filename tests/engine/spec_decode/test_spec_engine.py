"""Speculative decoding through the engine's public API: configuration, logprobs, seeded
reproducibility, and the decode role (a draft model catches up on a remotely prefilled
prompt, since only the target's KV comes over the wire)."""

from __future__ import annotations

import math

import pytest
import torch

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.config import CacheConfig, ModelConfig, SpeculativeConfig
from pdserve.engine.kv_block_io import KVBlockIO
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.outputs import SampledTokens
from pdserve.engine.request import RequestStatus

ALWAYS = {"max_batch_for_speculation": 64, "min_expected_accepted": 0.0}
PROMPTS = [[11, 12, 13, 11, 12, 13, 11, 12], list(range(400, 460)), [5, 6] * 20]


def test_config_from_json_and_dict():
    config = SpeculativeConfig.from_json('{"method": "ngram", "num_speculative_tokens": 5}')
    assert config.num_speculative_tokens == 5 and config.prompt_lookup_max == 4
    assert SpeculativeConfig.from_dict({"method": "ngram"}) == SpeculativeConfig()
    for text, message in [
        ("{", "not valid JSON"),
        ("[1]", "must be a JSON object"),
        ('{"method": "eagle"}', "'ngram' or 'draft_model'"),
        ('{"num_spec_tokens": 3}', "unknown speculative_config keys \\['num_spec_tokens'\\]"),
        ('{"num_speculative_tokens": "3"}', "must be an integer"),
        ('{"num_speculative_tokens": 0}', ">= 1"),
        ('{"method": "draft_model"}', "needs a draft 'model'"),
        ('{"prompt_lookup_min": 3, "prompt_lookup_max": 2}', "prompt_lookup_min"),
        ('{"acceptance_ema_alpha": 0}', "acceptance_ema_alpha"),
    ]:
        with pytest.raises(ValueError, match=message):
            SpeculativeConfig.from_json(text)


def test_llm_takes_a_config_object_and_rejects_a_bad_dict(tiny_llama):
    llm = LLM(
        model=tiny_llama,
        dtype="float32",
        num_blocks=32,
        speculative_config=SpeculativeConfig(num_speculative_tokens=2),
    )
    assert llm.engine.spec_stats.num_accepted_tokens_per_pos == [0, 0]
    with pytest.raises(ValueError, match="unknown speculative_config keys"):
        LLM(model=tiny_llama, dtype="float32", num_blocks=32, speculative_config={"k": 3})
    assert LLM(model=tiny_llama, dtype="float32", num_blocks=32).engine.spec_stats is None


def test_logprobs_of_accepted_tokens_match_plain_decoding(tiny_llama):
    params = SamplingParams(temperature=0.0, max_tokens=24, logprobs=3, ignore_eos=True)
    plain = LLM(model=tiny_llama, dtype="float32", num_blocks=64)
    spec = LLM(
        model=tiny_llama,
        dtype="float32",
        num_blocks=64,
        speculative_config={"method": "draft_model", "model": tiny_llama, **ALWAYS},
    )
    expected = plain.generate(PROMPTS, params, use_tqdm=False)
    got = spec.generate(PROMPTS, params, use_tqdm=False)
    assert spec.engine.spec_stats.num_accepted_tokens > 20
    for e, g in zip(expected, got, strict=True):
        e, g = e.outputs[0], g.outputs[0]
        assert g.token_ids == e.token_ids and len(g.logprobs) == len(e.logprobs) == 24
        for a, b in zip(g.logprobs, e.logprobs, strict=True):
            assert (a.token_id, a.rank, list(a.top)) == (b.token_id, b.rank, list(b.top))
            assert math.isclose(a.logprob, b.logprob, abs_tol=1e-4)


def test_seeded_sampling_with_speculation_is_independent_of_batch_mates(tiny_llama):
    llm = LLM(
        model=tiny_llama,
        dtype="float32",
        num_blocks=128,
        speculative_config={"method": "ngram", **ALWAYS},
    )
    seeded = SamplingParams(temperature=0.8, top_k=50, seed=7, max_tokens=30)
    alone = llm.generate([PROMPTS[2]], seeded, use_tqdm=False)[0].outputs[0].token_ids
    mates = SamplingParams(temperature=1.0, max_tokens=20)
    mixed = llm.generate(PROMPTS, [mates, mates, seeded], use_tqdm=False)
    assert mixed[2].outputs[0].token_ids == alone


class SnapshotConnector:
    """Prefill side: copies the prompt's KV blocks after the step that computes them."""

    def __init__(self) -> None:
        self.kv_cache: torch.Tensor | None = None
        self.kv: torch.Tensor | None = None

    def register_kv_cache(self, kv_cache: KVBlockIO, block_size: int) -> None:
        self.kv_cache = kv_cache.kv_cache  # one process: the tensor holds every head

    def after_execute(self, output) -> None:
        (chunk,) = output.chunks
        self.kv = self.kv_cache[:, chunk.block_ids].clone()


def test_decode_role_draft_model_computes_the_prompt_locally(tiny_llama):
    prompt = list(range(300, 340))
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    expected = (
        LLM(model=tiny_llama, dtype="float32", num_blocks=64)
        .generate([prompt], params, use_tqdm=False)[0]
        .outputs[0]
        .token_ids
    )
    model = ModelConfig(tiny_llama, dtype="float32")
    # the "prefill node": computes the prompt and samples the first token
    snapshot = SnapshotConnector()
    prefill = LLMEngine(model, CacheConfig(num_blocks=64), kv_connector=snapshot)
    prefill.add_request("r", prompt, params, prefill_only=True)
    (first,) = prefill.step().updates
    assert first.status is RequestStatus.FINISHED_PREFILLED and len(first.new_token_ids) == 1
    # the "decode node": reserves blocks, receives the KV, joins, speculates with a draft
    config = SpeculativeConfig(method="draft_model", model=tiny_llama, **ALWAYS)
    decode = LLMEngine(model, CacheConfig(num_blocks=64), speculative_config=config)
    request = decode.add_request("r", prompt, params, wants_remote_prefill=True)
    step = decode.step()
    assert step.updates == []
    (reserved,) = step.remote_prefills
    decode.kv_cache[:, reserved.block_ids] = snapshot.kv
    decode.finish_remote_prefill("r", SampledTokens(first.new_token_ids), 0)
    while decode.has_unfinished_requests():
        decode.step()
    assert request.output_token_ids == expected
    stats = decode.spec_stats
    assert stats.acceptance_rate >= 0.95 and stats.num_drafts <= 7  # ~4 tokens per step
    assert decode.speculator.proposer.kv.num_free_blocks == 63
