"""Structured outputs in the engine: the batched sampler's grammar mask (exact, per row, raw
logprobs untouched), masks after speculative drafts, grammar-valid output through the offline
engine, speculation and a remote prefill giving the aggregated engine's tokens."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.config import CacheConfig, ModelConfig
from pdserve.engine.kv_block_io import KVBlockIO
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.outputs import SampledTokens
from pdserve.engine.request import RequestStatus
from pdserve.engine.sampler import SamplingMetadata, process_logits
from pdserve.engine.structured_output import (
    GrammarCompiler,
    StructuredOutputKind,
    StructuredOutputSpec,
    check_spec,
)
from pdserve.engine.tokenizer import Tokenizer
from tests.engine.test_sampler import make_row, sample

SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "enum": [1, 2, 3]}},
    "required": ["ok", "n"],
    "additionalProperties": False,
}
JSON_SPEC = StructuredOutputSpec(StructuredOutputKind.JSON, json.dumps(SCHEMA))
DIGITS = StructuredOutputSpec(StructuredOutputKind.REGEX, "[0-9]+x")


@pytest.fixture(scope="module")
def compiler(tiny_llama: str) -> GrammarCompiler:
    tokenizer = Tokenizer.from_pretrained(tiny_llama)
    return GrammarCompiler(tokenizer, 512, (tokenizer.eos_token_id,))


def allowed_tokens(compiler: GrammarCompiler, spec: StructuredOutputSpec, prefix=()) -> set[int]:
    """What the grammar allows next, asked token by token (the slow reference)."""
    allowed = set()
    for token in range(512):
        matcher = compiler.matcher(spec)
        assert all(matcher.accept(t) for t in prefix)
        if matcher.accept(token):
            allowed.add(token)
    return allowed


def test_mask_is_exactly_the_grammar_on_its_row_only(compiler: GrammarCompiler) -> None:
    torch.manual_seed(0)
    logits = torch.randn(3, 512)
    raw = logits.clone()
    greedy = SamplingParams(temperature=0, structured_output=DIGITS, logprobs=1)
    rows = [
        make_row(SamplingParams(temperature=0)),
        make_row(greedy),
        make_row(SamplingParams(structured_output=DIGITS), seed=3),
    ]
    rows[1].grammar = compiler.matcher(DIGITS)
    rows[2].grammar = compiler.matcher(DIGITS)
    meta = SamplingMetadata.build(rows, 512)
    out = process_logits(logits, meta)
    allowed = allowed_tokens(compiler, DIGITS)
    assert 0 < len(allowed) < 100
    assert set(out[1].isfinite().nonzero()[:, 0].tolist()) == allowed
    assert set(out[2].isfinite().nonzero()[:, 0].tolist()) == allowed
    assert torch.equal(out[0], raw[0]) and torch.equal(logits, raw)  # input never written
    result = sample(logits, rows)
    assert result.token_ids[0] == int(raw[0].argmax())
    assert result.token_ids[1] == max(allowed, key=lambda t: raw[1, t])
    assert result.token_ids[2] in allowed
    # logprobs come from the raw logits, as without a grammar
    expected = torch.log_softmax(raw[1], -1)[result.token_ids[1]]
    assert result.logprobs[1].logprob == pytest.approx(float(expected), abs=1e-5)


def test_draft_rows_are_masked_after_their_drafts_and_the_matcher_is_unchanged(
    compiler: GrammarCompiler,
) -> None:
    first = min(allowed_tokens(compiler, DIGITS))
    matcher = compiler.matcher(DIGITS)
    rows = [make_row(SamplingParams(temperature=0)) for _ in range(3)]
    for row, drafts in zip(rows, [(), (first,), (first, 0)], strict=True):
        row.grammar, row.grammar_drafts = matcher, drafts
    meta = SamplingMetadata.build(rows, 512)
    out = process_logits(torch.zeros(3, 512), meta)
    after_first = allowed_tokens(compiler, DIGITS, (first,))
    assert set(out[0].isfinite().nonzero()[:, 0].tolist()) == allowed_tokens(compiler, DIGITS)
    assert set(out[1].isfinite().nonzero()[:, 0].tolist()) == after_first
    assert matcher.accept(first)  # still at the start: the drafts were rolled back
    assert not matcher.is_terminated


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (StructuredOutputSpec(StructuredOutputKind.JSON, "{not json"), "invalid JSON schema"),
        (StructuredOutputSpec(StructuredOutputKind.REGEX, "(unclosed"), "invalid regex"),
        (StructuredOutputSpec(StructuredOutputKind.GRAMMAR, "root ::= missing"), "invalid grammar"),
        (StructuredOutputSpec(StructuredOutputKind.CHOICE, "[]"), "non-empty list"),
        (
            StructuredOutputSpec(StructuredOutputKind.JSON, '{"type": "strange"}'),
            'invalid JSON schema: Unsupported type "strange"',
        ),
    ],
)
def test_bad_specs_are_value_errors(spec: StructuredOutputSpec, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        check_spec(spec)


@pytest.fixture(scope="module")
def llm(tiny_llama: str) -> LLM:
    return LLM(model=tiny_llama, dtype="float32", num_blocks=128)


PROMPTS = [[11, 12, 13, 11, 12, 13], list(range(400, 430)), [5, 6] * 10]


def test_offline_outputs_follow_the_schema_and_a_grammar_that_never_ends_is_length(
    llm: LLM,
) -> None:
    greedy = SamplingParams(temperature=0, max_tokens=120, structured_output=JSON_SPEC)
    seeded = SamplingParams(temperature=1.0, seed=5, max_tokens=120, structured_output=JSON_SPEC)
    for out in llm.generate(PROMPTS, greedy, use_tqdm=False) + llm.generate(
        PROMPTS, seeded, use_tqdm=False
    ):
        completion = out.outputs[0]
        if completion.finish_reason == "stop":
            jsonschema.validate(json.loads(completion.text), SCHEMA)
    endless = StructuredOutputSpec(StructuredOutputKind.GRAMMAR, 'root ::= "ab" root')
    params = SamplingParams(temperature=0, max_tokens=10, structured_output=endless)
    (out,) = llm.generate([PROMPTS[0]], params, use_tqdm=False)
    assert out.outputs[0].finish_reason == "length"
    assert out.outputs[0].text.replace("ab", "") in ("", "a") and out.outputs[0].text
    choice = StructuredOutputSpec.choice(["red", "green", "blue"])
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=10, structured_output=choice, seed=1))
    assert {o.outputs[0].text for o in outs} <= {"red", "green", "blue"}
    assert all(o.outputs[0].finish_reason == "stop" for o in outs)


def test_speculation_verifies_drafts_against_the_grammar(tiny_llama: str, llm: LLM) -> None:
    """The draft (the target itself, unconstrained) proposes tokens the grammar forbids; the
    verifier must reject them, so greedy output equals plain constrained decoding."""
    params = SamplingParams(temperature=0, max_tokens=40, structured_output=JSON_SPEC)
    expected = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    spec_llm = LLM(
        model=tiny_llama,
        dtype="float32",
        num_blocks=128,
        speculative_config={
            "method": "draft_model",
            "model": tiny_llama,
            "max_batch_for_speculation": 64,
            "min_expected_accepted": 0.0,
        },
    )
    got = [o.outputs[0].token_ids for o in spec_llm.generate(PROMPTS, params, use_tqdm=False)]
    assert got == expected
    stats = spec_llm.engine.spec_stats
    # the random model's unconstrained argmax is rarely what the grammar allows: rejected
    assert stats.num_draft_tokens > 30 and stats.num_accepted_tokens < stats.num_draft_tokens


class SnapshotConnector:
    """Prefill side: copies the prompt's KV blocks after the step that computes them."""

    def register_kv_cache(self, kv_cache: KVBlockIO, block_size: int) -> None:
        self.kv_cache = kv_cache.kv_cache  # one process: the tensor holds every head

    def after_execute(self, output) -> None:
        (chunk,) = output.chunks
        self.kv = self.kv_cache[:, chunk.block_ids].clone()


def test_remote_prefill_first_token_under_the_grammar_then_the_decode_matcher(
    tiny_llama: str, llm: LLM
) -> None:
    """The prefill engine samples the first token under the grammar; the decode engine's
    matcher takes it with the KV and continues: the aggregated engine's tokens."""
    prompt = PROMPTS[1]
    params = SamplingParams(temperature=0, max_tokens=30, structured_output=JSON_SPEC)
    expected = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    model = ModelConfig(tiny_llama, dtype="float32")
    snapshot = SnapshotConnector()
    prefill = LLMEngine(model, CacheConfig(num_blocks=64), kv_connector=snapshot)
    prefill.add_request("r", prompt, params, prefill_only=True)
    (first,) = prefill.step().updates
    assert first.status is RequestStatus.FINISHED_PREFILLED
    assert first.new_token_ids == expected[:1]
    decode = LLMEngine(model, CacheConfig(num_blocks=64))
    request = decode.add_request("r", prompt, params, wants_remote_prefill=True)
    (reserved,) = decode.step().remote_prefills
    decode.kv_cache[:, reserved.block_ids] = snapshot.kv
    decode.finish_remote_prefill("r", SampledTokens(first.new_token_ids), 0)
    while decode.has_unfinished_requests():
        decode.step()
    assert request.output_token_ids == expected


def test_a_resumed_request_replays_its_generated_tokens_into_the_matcher(llm: LLM) -> None:
    """What a decode node does with a request resumed on it (its node died mid-stream): the
    prompt holds the tokens generated so far, structured_output_resume says how many; the
    continuation equals the uninterrupted run. Without the replay the matcher would start the
    grammar over (a new JSON object mid-object). Tokens the grammar forbids: ValueError."""
    params = SamplingParams(
        temperature=0, max_tokens=40, ignore_eos=False, structured_output=JSON_SPEC
    )
    for prompt in PROMPTS:
        (whole,) = llm.generate([prompt], params, use_tqdm=False)
        tokens = whole.outputs[0].token_ids
        assert len(tokens) > 6
        for cut in (1, 5):
            resumed = SamplingParams(
                temperature=0,
                max_tokens=40 - cut,
                structured_output=JSON_SPEC,
                structured_output_resume=cut,
            )
            (rest,) = llm.generate([prompt + tokens[:cut]], resumed, use_tqdm=False)
            assert rest.outputs[0].token_ids == tokens[cut:], (prompt, cut)
        unresumed = SamplingParams(temperature=0, max_tokens=40 - 5, structured_output=JSON_SPEC)
        (restart,) = llm.generate([prompt + tokens[:5]], unresumed, use_tqdm=False)
        assert restart.outputs[0].token_ids != tokens[5:]  # the bug this field fixes
    bad = SamplingParams(max_tokens=4, structured_output=JSON_SPEC, structured_output_resume=2)
    with pytest.raises(ValueError, match="does not match"):
        llm.generate([[5, 6, 7, 8]], bad, use_tqdm=False)
    with pytest.raises(ValueError, match="structured_output_resume"):
        SamplingParams(structured_output_resume=1)
