"""vLLM's documented request shapes, replayed against `pdserve serve` (1 prefill + 1 decode
node, the real SmolLM2-135M-Instruct) as raw HTTP: each gets 200 and a response with the fields vLLM's server returns for it
(names, types, and the values the request pins down: object names, choice counts, a choice
among the constrained ones, prompt/echo lengths). The shapes follow vLLM's OpenAI-compatible
server documentation: its quickstart requests, its extra sampling and chat parameters, its
structured-output examples (old and new spellings), tokenizer endpoints and embeddings."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

import httpx
import jsonschema
import pytest

from tests.integration.stack import SMOLLM2_NAMES

TIMEOUT_S = 120.0
MODEL, ALIAS = SMOLLM2_NAMES

COMPLETION_KEYS = {"id", "object", "created", "model", "choices", "usage"}
COMPLETION_CHOICE_KEYS = {"index", "text", "logprobs", "finish_reason", "stop_reason"}
CHAT_KEYS = {"id", "object", "created", "model", "choices", "usage"}
CHAT_CHOICE_KEYS = {"index", "message", "logprobs", "finish_reason", "stop_reason"}
USAGE_KEYS = {"prompt_tokens", "completion_tokens", "total_tokens"}
CHUNK_KEYS = {"id", "object", "created", "model", "choices"}


def completion_shape(body: dict, out: dict) -> None:
    assert COMPLETION_KEYS <= set(out) and out["object"] == "text_completion"
    assert USAGE_KEYS <= set(out["usage"])
    prompts = body["prompt"] if isinstance(body["prompt"], list) else [body["prompt"]]
    if prompts and isinstance(prompts[0], int):
        prompts = [prompts]
    assert len(out["choices"]) == len(prompts) * body.get("n", 1)
    for choice in out["choices"]:
        assert COMPLETION_CHOICE_KEYS <= set(choice)
        assert choice["finish_reason"] in ("stop", "length")
        assert isinstance(choice["text"], str)


def chat_shape(body: dict, out: dict) -> None:
    assert CHAT_KEYS <= set(out) and out["object"] == "chat.completion"
    assert USAGE_KEYS <= set(out["usage"])
    assert len(out["choices"]) == body.get("n", 1)
    for choice in out["choices"]:
        assert CHAT_CHOICE_KEYS <= set(choice)
        assert {"role", "content", "tool_calls"} <= set(choice["message"])
        assert choice["message"]["role"] == "assistant"


def chat_content(out: dict) -> str:
    return out["choices"][0]["message"]["content"]


def both(*checks: Callable[[dict, dict], None]) -> Callable[[dict, dict], None]:
    def check(body: dict, out: dict) -> None:
        for c in checks:
            c(body, out)

    return check


MESSAGES = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "Who won the world series in 2020?"},
]
CHOICES = ["positive", "negative"]
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}

# (name, path, body, check(body, response json))
CASES: list[tuple[str, str, dict[str, Any], Callable[[dict, dict], None]]] = [
    (
        "quickstart completion",
        "/v1/completions",
        {"prompt": "San Francisco is a", "max_tokens": 7, "temperature": 0},
        completion_shape,
    ),
    (
        "quickstart chat",
        "/v1/chat/completions",
        {"messages": MESSAGES, "max_tokens": 8},
        chat_shape,
    ),
    (
        "extra sampling parameters",
        "/v1/completions",
        {
            "prompt": "Hello",
            "max_tokens": 8,
            "top_k": 50,
            "min_p": 0.1,
            "repetition_penalty": 1.1,
            "min_tokens": 2,
            "stop_token_ids": [2],
            "include_stop_str_in_output": False,
            "skip_special_tokens": True,
            "seed": 7,
        },
        completion_shape,
    ),
    (
        "extra chat parameters",
        "/v1/chat/completions",
        {
            "messages": MESSAGES,
            "max_completion_tokens": 6,
            "add_generation_prompt": True,
            "chat_template_kwargs": {"enable_thinking": False},
            "top_k": 20,
            "priority": 0,
            "cache_salt": "team-a",
        },
        chat_shape,
    ),
    (
        "guided_choice (old spelling)",
        "/v1/chat/completions",
        {"messages": MESSAGES, "max_tokens": 10, "guided_choice": CHOICES},
        both(chat_shape, lambda b, o: _in(chat_content(o), CHOICES)),
    ),
    (
        "structured_outputs choice",
        "/v1/chat/completions",
        {"messages": MESSAGES, "max_tokens": 10, "structured_outputs": {"choice": CHOICES}},
        both(chat_shape, lambda b, o: _in(chat_content(o), CHOICES)),
    ),
    (
        "guided_regex with a stop string",
        "/v1/completions",
        {"prompt": "Email: ", "max_tokens": 30, "guided_regex": r"\w+@\w+\.com\n", "stop": ["\n"]},
        both(completion_shape, lambda b, o: _email(o)),
    ),
    (
        "response_format json_schema",
        "/v1/chat/completions",
        {
            "messages": MESSAGES,
            "max_tokens": 60,
            "temperature": 0,
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "person", "schema": PERSON},
            },
        },
        both(chat_shape, lambda b, o: _person(o)),
    ),
    (
        "echo with logprobs",
        "/v1/completions",
        {"prompt": [11, 12, 13, 14], "max_tokens": 3, "echo": True, "logprobs": 2},
        both(completion_shape, lambda b, o: _echo_logprobs(o, 4, 3)),
    ),
    (
        "prompt_logprobs",
        "/v1/completions",
        {"prompt": [11, 12, 13, 14], "max_tokens": 2, "prompt_logprobs": 1},
        both(completion_shape, lambda b, o: _prompt_logprobs(o["choices"][0], 4)),
    ),
    (
        "batched prompts, n=2, return_token_ids",
        "/v1/completions",
        {"prompt": ["a b", "c d e"], "max_tokens": 3, "n": 2, "return_token_ids": True},
        both(completion_shape, lambda b, o: _token_ids(o)),
    ),
    (
        "best_of",
        "/v1/completions",
        {"prompt": "x", "max_tokens": 3, "n": 1, "best_of": 2, "temperature": 0.8},
        completion_shape,
    ),
    (
        "tools with tool_choice required",
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "Weather in Paris?"}],
            "max_tokens": 60,
            "temperature": 0,
            "tools": [
                {
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
            ],
            "tool_choice": "required",
        },
        both(chat_shape, lambda b, o: _tool_calls(o)),
    ),
]


def _in(text: str, options: list[str]) -> None:
    assert text in options, text


def _email(out: dict) -> None:
    """The regex \\w+@\\w+\\.com\\n, cut at the stop string "\\n"; a prefix of it if cut by
    max_tokens."""
    choice = out["choices"][0]
    whole = choice["finish_reason"] == "stop"
    pattern = r"\w+@\w+\.com" if whole else r"\w*(@\w*(\.(c(om?)?)?)?)?"
    assert re.fullmatch(pattern, choice["text"]), choice


def _person(out: dict) -> None:
    choice = out["choices"][0]
    assert choice["finish_reason"] == "stop", choice
    jsonschema.validate(json.loads(choice["message"]["content"]), PERSON)


def _echo_logprobs(out: dict, prompt_len: int, max_tokens: int) -> None:
    lp = out["choices"][0]["logprobs"]
    assert set(lp) == {"text_offset", "token_logprobs", "tokens", "top_logprobs"}
    n = len(lp["tokens"])
    assert prompt_len < n <= prompt_len + max_tokens
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert all(isinstance(v, float) for v in lp["token_logprobs"][1:])


def _prompt_logprobs(choice: dict, prompt_len: int) -> None:
    got = choice["prompt_logprobs"]
    assert len(got) == prompt_len and got[0] is None
    for entry in got[1:]:
        for value in entry.values():
            assert set(value) == {"logprob", "rank", "decoded_token"}


def _token_ids(out: dict) -> None:
    for choice in out["choices"]:
        assert isinstance(choice["prompt_token_ids"], list) and choice["prompt_token_ids"]
        assert isinstance(choice["token_ids"], list) and choice["token_ids"]


def _tool_calls(out: dict) -> None:
    choice = out["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    for call in choice["message"]["tool_calls"]:
        assert set(call) >= {"id", "type", "function"} and call["type"] == "function"
        assert call["function"]["name"] == "get_weather"
        assert isinstance(json.loads(call["function"]["arguments"]), dict)


@pytest.fixture(scope="module")
def stack(smollm2_stack):
    return smollm2_stack


@pytest.fixture(scope="module")
def http(stack):
    with httpx.Client(base_url=stack.base_url, timeout=TIMEOUT_S) as client:
        yield client


@pytest.mark.parametrize(("name", "path", "body", "check"), CASES, ids=[c[0] for c in CASES])
def test_documented_request_shape(http, name, path, body, check) -> None:
    request = {"model": MODEL, **body}
    response = http.post(path, json=request)
    assert response.status_code == 200, response.text
    check(request, response.json())


def test_streamed_chat_with_usage_shape(http) -> None:
    body = {
        "model": MODEL,
        "messages": MESSAGES,
        "max_tokens": 5,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with http.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in response.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    for chunk in chunks:
        assert CHUNK_KEYS <= set(chunk) and chunk["object"] == "chat.completion.chunk"
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[-1]["choices"] == [] and USAGE_KEYS <= set(chunks[-1]["usage"])
    assert chunks[-2]["choices"][0]["finish_reason"] in ("stop", "length")


def test_models_tokenizer_and_embeddings_shapes(http) -> None:
    models = http.get("/v1/models").json()
    assert models["object"] == "list"
    assert [m["id"] for m in models["data"]] == [MODEL, ALIAS]
    for card in models["data"]:
        assert {"id", "object", "created", "owned_by", "root", "parent", "max_model_len",
                "permission"} <= set(card)  # fmt: skip
        assert card["object"] == "model" and card["permission"][0]["allow_sampling"]
    tokens = http.post("/tokenize", json={"model": MODEL, "prompt": "Hello world"}).json()
    assert set(tokens) == {"count", "max_model_len", "tokens", "token_strs"}
    chat_tokens = http.post("/tokenize", json={"model": MODEL, "messages": MESSAGES}).json()
    assert chat_tokens["count"] == len(chat_tokens["tokens"]) > tokens["count"]
    text = http.post("/detokenize", json={"model": MODEL, "tokens": tokens["tokens"]}).json()
    assert set(text) == {"prompt"} and "Hello world" in text["prompt"]
    assert set(http.get("/version").json()) == {"version"}
    emb = http.post("/v1/embeddings", json={"model": MODEL, "input": ["a", "b c"]}).json()
    assert emb["object"] == "list" and {"data", "model", "usage"} <= set(emb)
    assert [d["index"] for d in emb["data"]] == [0, 1]
    assert all(d["object"] == "embedding" and d["embedding"] for d in emb["data"])
