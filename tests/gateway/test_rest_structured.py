"""Structured outputs and tool calling at the gateway, through the official openai client
against fake nodes: each spelling reaches the wire as one StructuredOutput, tool_choice
required / named become JSON-schema constraints, and scripted model outputs come back as
message.tool_calls (streamed as delta.tool_calls) with finish_reason "tool_calls"."""

from __future__ import annotations

import json
from typing import Any

import openai
import pytest

from pdserve.engine.tokenizer import Tokenizer
from pdserve.v1 import common_pb2
from tests.gateway.conftest import StartCluster
from tests.gateway.fake_nodes import EOS_TOKEN_ID
from tests.gateway.harness import MODEL_NAME, Cluster

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]
GREEDY = {"temperature": 0}
"""The fake nodes' output then starts at the script position of the prompt's length."""


def client(cluster: Cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=cluster.base_url + "/v1", api_key="x", max_retries=0)


def wire(cluster: Cluster) -> common_pb2.StructuredOutput | None:
    (call,) = [c for node in cluster.decode_nodes for c in node.calls]
    params = call.request.sampling_params
    return params.structured_output if params.HasField("structured_output") else None


K = common_pb2


@pytest.mark.parametrize(
    ("extra", "kind", "value"),
    [
        ({"guided_json": SCHEMA}, K.STRUCTURED_OUTPUT_KIND_JSON, json.dumps(SCHEMA)),
        (
            {"structured_outputs": {"json": SCHEMA}},
            K.STRUCTURED_OUTPUT_KIND_JSON,
            json.dumps(SCHEMA),
        ),
        ({"guided_regex": "[a-z]+"}, K.STRUCTURED_OUTPUT_KIND_REGEX, "[a-z]+"),
        ({"structured_outputs": {"regex": "a|b"}}, K.STRUCTURED_OUTPUT_KIND_REGEX, "a|b"),
        ({"guided_choice": ["x", "y"]}, K.STRUCTURED_OUTPUT_KIND_CHOICE, '["x", "y"]'),
        ({"structured_outputs": {"choice": ["x"]}}, K.STRUCTURED_OUTPUT_KIND_CHOICE, '["x"]'),
        ({"guided_grammar": 'root ::= "a"'}, K.STRUCTURED_OUTPUT_KIND_GRAMMAR, 'root ::= "a"'),
        ({"structured_outputs": {"json_object": True}}, K.STRUCTURED_OUTPUT_KIND_JSON_OBJECT, ""),
    ],
)
def test_completions_spellings_reach_the_wire(
    gw: Cluster, extra: dict[str, Any], kind: int, value: str
) -> None:
    client(gw).completions.create(model=MODEL_NAME, prompt="hi", max_tokens=3, extra_body=extra)
    got = wire(gw)
    assert got is not None and (got.kind, got.value) == (kind, value)


def test_chat_response_format_json_schema_and_json_object(gw: Cluster) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA, "strict": True}}
    client(gw).chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, max_tokens=3, response_format=fmt
    )
    got = wire(gw)
    assert (got.kind, json.loads(got.value)) == (K.STRUCTURED_OUTPUT_KIND_JSON, SCHEMA)
    gw.reset()
    client(gw).chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, max_tokens=3, response_format={"type": "json_object"}
    )
    assert wire(gw).kind == K.STRUCTURED_OUTPUT_KIND_JSON_OBJECT
    gw.reset()
    client(gw).chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=3)
    assert wire(gw) is None


def test_bad_schema_is_a_400_naming_the_feature(gw: Cluster) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "strange"}}}
    with pytest.raises(openai.BadRequestError) as info:
        client(gw).chat.completions.create(
            model=MODEL_NAME, messages=MESSAGES, max_tokens=3, response_format=fmt
        )
    assert 'Unsupported type "strange"' in info.value.message
    assert info.value.body["param"] == "response_format"
    bad_tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "strange"}}}
    with pytest.raises(openai.BadRequestError) as info:
        client(gw).chat.completions.create(
            model=MODEL_NAME, messages=MESSAGES, tools=[bad_tool], tool_choice="required"
        )
    assert info.value.body["param"] == "tools"
    assert not [c for node in gw.decode_nodes for c in node.calls]


def script_output(cluster: Cluster, tokenizer: Tokenizer, text: str, **request: Any) -> None:
    """Make the fake nodes answer this request's prompt with text, then eos."""
    probe = client(cluster).chat.completions.create(
        model=MODEL_NAME, max_tokens=1, extra_body={"return_token_ids": True}, **request
    )
    prompt_len = len(probe.model_extra["prompt_token_ids"])
    tokens = tokenizer.encode(text, add_special_tokens=False) + [EOS_TOKEN_ID]
    assert tokenizer.decode(tokens) == text
    shift = prompt_len % len(tokens)
    for node in cluster.decode_nodes:
        node.behaviour.script = tokens[-shift:] + tokens[:-shift] if shift else tokens
        node.calls.clear()


def test_tool_choice_required_constrains_and_returns_tool_calls(
    gw: Cluster, tokenizer: Tokenizer
) -> None:
    request = {"messages": MESSAGES, "tools": [WEATHER], "tool_choice": "required", **GREEDY}
    text = '[{"name": "get_weather", "parameters": {"city": "Paris"}}]'
    script_output(gw, tokenizer, text, **request)
    response = client(gw).chat.completions.create(model=MODEL_NAME, max_tokens=64, **request)
    schema = json.loads(wire(gw).value)
    assert schema["type"] == "array" and schema["minItems"] == 1 and "maxItems" not in schema
    (choice,) = response.choices
    assert choice.finish_reason == "tool_calls", choice.message.content
    assert choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("chatcmpl-tool-")
    assert (call.function.name, json.loads(call.function.arguments)) == (
        "get_weather",
        {"city": "Paris"},
    )
    stream = client(gw).chat.completions.create(
        model=MODEL_NAME, max_tokens=64, stream=True, **request
    )
    chunks = list(stream)
    deltas = [
        c.choices[0].delta.tool_calls for c in chunks if c.choices and c.choices[0].delta.tool_calls
    ]
    assert len(deltas) == 1
    (streamed,) = deltas[0]
    assert streamed.index == 0 and streamed.function.name == "get_weather"
    assert json.loads(streamed.function.arguments) == {"city": "Paris"}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert not any(c.choices[0].delta.content for c in chunks if c.choices)


def test_named_tool_choice_and_parallel_tool_calls_false(gw: Cluster, tokenizer: Tokenizer) -> None:
    named = {"type": "function", "function": {"name": "get_weather"}}
    request = {"messages": MESSAGES, "tools": [WEATHER], "tool_choice": named, **GREEDY}
    script_output(gw, tokenizer, '{"city": "Oslo"}', **request)
    response = client(gw).chat.completions.create(model=MODEL_NAME, max_tokens=64, **request)
    assert json.loads(wire(gw).value) == WEATHER["function"]["parameters"]
    (call,) = response.choices[0].message.tool_calls
    assert (call.function.name, call.function.arguments) == ("get_weather", '{"city": "Oslo"}')
    gw.reset()
    client(gw).chat.completions.create(
        model=MODEL_NAME,
        max_tokens=4,
        messages=MESSAGES,
        tools=[WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,
    )
    assert json.loads(wire(gw).value)["maxItems"] == 1


def test_auto_needs_the_flags_and_none_leaves_content(gw: Cluster) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client(gw).chat.completions.create(
            model=MODEL_NAME, messages=MESSAGES, tools=[WEATHER], tool_choice="auto"
        )
    assert "--enable-auto-tool-choice" in info.value.message
    response = client(gw).chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, tools=[WEATHER], max_tokens=4
    )  # without the flags tools default to tool_choice "none"
    assert response.choices[0].message.content and not response.choices[0].message.tool_calls
    assert wire(gw) is None


@pytest.mark.parametrize(
    ("parser", "text", "content"),
    [
        (
            "hermes",
            'Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}'
            "\n</tool_call>",
            "Let me check.",
        ),
        ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Rome"}}', None),
    ],
)
def test_auto_tool_choice_parsers(
    make_cluster: StartCluster, tokenizer: Tokenizer, parser: str, text: str, content: str | None
) -> None:
    cluster = make_cluster(tool_call_parser=parser, enable_auto_tool_choice=True)
    request = {"messages": MESSAGES, "tools": [WEATHER], **GREEDY}
    script_output(cluster, tokenizer, text, **request)
    response = client(cluster).chat.completions.create(model=MODEL_NAME, max_tokens=64, **request)
    assert wire(cluster) is None  # auto is not constrained
    message = response.choices[0].message
    assert response.choices[0].finish_reason == "tool_calls" and message.content == content
    (call,) = message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == (
        "get_weather",
        {"city": "Rome"},
    )
    script_output(cluster, tokenizer, "Just text.", **request)
    plain = client(cluster).chat.completions.create(model=MODEL_NAME, max_tokens=64, **request)
    assert plain.choices[0].message.content == "Just text."
    assert plain.choices[0].finish_reason == "stop" and not plain.choices[0].message.tool_calls


def test_tool_messages_are_rendered_through_the_template(tokenizer: Tokenizer) -> None:
    from pdserve.gateway.openai_api import ChatMessage
    from pdserve.gateway.tool_calls import template_messages

    call = {
        "id": "c1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
    }
    messages = [
        ChatMessage(role="user", content="Weather?"),
        ChatMessage(role="assistant", content=None, tool_calls=[call]),
        ChatMessage(role="tool", content="sunny", tool_call_id="c1"),
    ]
    rendered = template_messages(messages)
    assert rendered[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert rendered[2] == {"role": "tool", "content": "sunny", "tool_call_id": "c1"}
