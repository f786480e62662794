"""Bad requests get exact status codes in OpenAI's error shape, and do not disturb good ones."""

from __future__ import annotations

import asyncio
import json
import random
from typing import Any

import httpx
import pytest

from tests.gateway.harness import MODEL_NAME, Cluster

TIMEOUT_S = 10.0
GOOD_COMPLETION = {"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 3}
GOOD_CHAT = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}


def completion(**changes: Any) -> dict[str, Any]:
    return {**GOOD_COMPLETION, **changes}


def chat(**changes: Any) -> dict[str, Any]:
    return {**GOOD_CHAT, **changes}


# (path, body, status, param): param is what error.param must be (None: not checked)
BAD_REQUESTS: list[tuple[str, Any, int, str | None]] = [
    ("/v1/completions", b"{not json", 400, None),
    ("/v1/completions", [1, 2], 400, None),
    ("/v1/completions", {"prompt": "hi"}, 400, "model"),
    ("/v1/completions", completion(max_tokens="5"), 400, "max_tokens"),
    ("/v1/completions", completion(temperature="hot"), 400, "temperature"),
    ("/v1/completions", completion(n=1.5), 400, "n"),
    ("/v1/completions", completion(stream="yes"), 400, "stream"),
    ("/v1/completions", completion(n=0), 400, "n"),
    ("/v1/completions", completion(n=17), 400, "n"),
    ("/v1/completions", completion(max_tokens=0), 400, "max_tokens"),
    ("/v1/completions", completion(temperature=2.5), 400, "temperature"),
    ("/v1/completions", completion(top_p=0), 400, "top_p"),
    ("/v1/completions", completion(top_k=-2), 400, "top_k"),
    ("/v1/completions", completion(presence_penalty=3), 400, "presence_penalty"),
    ("/v1/completions", completion(repetition_penalty=0), 400, "repetition_penalty"),
    ("/v1/completions", completion(stop=["a", "b", "c", "d", "e"]), 400, "stop"),
    ("/v1/completions", completion(stop=5), 400, None),
    ("/v1/completions", completion(logprobs=21), 400, "logprobs"),
    ("/v1/completions", completion(stop_token_ids=[-1]), 400, "stop_token_ids"),
    ("/v1/completions", completion(min_tokens=5, max_tokens=3), 400, "min_tokens"),
    ("/v1/completions", completion(logit_bias={"5": 101.0}), 400, "logit_bias"),
    ("/v1/completions", completion(logit_bias={"x": 1.0}), 400, "logit_bias"),
    ("/v1/completions", completion(logit_bias={"99999": 1.0}), 400, "logit_bias"),
    ("/v1/completions", completion(allowed_token_ids=[]), 400, "allowed_token_ids"),
    ("/v1/completions", completion(allowed_token_ids=[5, 99999]), 400, "allowed_token_ids"),
    ("/v1/completions", completion(best_of=1, n=2), 400, None),
    ("/v1/completions", completion(best_of=3, n=2, stream=True), 400, None),
    ("/v1/completions", completion(prompt=[]), 400, "prompt"),
    ("/v1/completions", completion(prompt=[1, 99999]), 400, "prompt"),
    ("/v1/completions", completion(prompt=["a", [5, 6]]), 400, "prompt"),
    ("/v1/completions", completion(prompt=[[5, 6], []]), 400, "prompt"),
    ("/v1/completions", completion(prompt=["a"] * 65), 400, "prompt"),
    ("/v1/completions", completion(prompt=[1] * 500, max_tokens=100), 400, "prompt"),
    ("/v1/completions", completion(model="other"), 404, "model"),
    ("/v1/chat/completions", chat(messages=[]), 400, "messages"),
    ("/v1/chat/completions", chat(messages=[{"role": "wizard", "content": "x"}]), 400, None),
    ("/v1/chat/completions", chat(messages=[{"content": "x"}]), 400, None),
    (
        "/v1/chat/completions",
        chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]),
        400,
        None,
    ),
    ("/v1/chat/completions", chat(top_logprobs=2), 400, None),
    ("/v1/chat/completions", chat(top_logprobs=21, logprobs=True), 400, "top_logprobs"),
    ("/v1/chat/completions", chat(max_completion_tokens=1000), 400, "messages"),
    ("/v1/chat/completions", chat(tools=[{"type": "function"}]), 400, "tools"),
    # Structured outputs and tools: what cannot be honoured is a 400 naming it.
    ("/v1/chat/completions", chat(tool_choice="required"), 400, "tool_choice"),
    ("/v1/chat/completions", chat(response_format={"type": "structural_tag"}), 400, None),
    (
        "/v1/chat/completions",
        chat(response_format={"type": "json_schema", "json_schema": {"name": "x"}}),
        400,
        "response_format",
    ),
    ("/v1/chat/completions", chat(guided_choice=[]), 400, "guided_choice"),
    ("/v1/completions", completion(guided_json={"type": "strange"}), 400, "guided_json"),
    ("/v1/completions", completion(guided_regex="(unclosed"), 400, "guided_regex"),
    ("/v1/completions", completion(guided_grammar="root ::= nothing"), 400, "guided_grammar"),
    (
        "/v1/completions",
        completion(structured_outputs={"choice": ["a"], "regex": "b"}),
        400,
        "structured_outputs.regex",
    ),
    ("/v1/completions", completion(structured_outputs={"structural_tag": "x"}), 400, None),
    ("/v1/completions", completion(guided_decoding_backend="outlines"), 400, None),
    ("/v1/completions", completion(prompt_logprobs=21), 400, None),
    ("/v1/completions", completion(prompt_logprobs=-1), 400, None),  # the whole vocabulary
    ("/v1/completions", completion(prompt_logprobs=-2), 400, None),
    ("/v1/completions", completion(prompt_logprobs="1"), 400, "prompt_logprobs"),
    ("/v1/completions", completion(prompt_logprobs=1, stream=True), 400, None),
    ("/v1/chat/completions", chat(prompt_logprobs=2, stream=True), 400, None),
    ("/v1/chat/completions", chat(prompt_logprobs=1 << 31), 400, "prompt_logprobs"),
    ("/v1/completions", completion(use_beam_search=True), 400, "use_beam_search"),
    ("/v1/chat/completions", chat(chat_template="{{ 1 }}"), 400, "chat_template"),
    # chat_template_kwargs may not collide with what the gateway passes the template.
    ("/v1/chat/completions", chat(chat_template_kwargs={"messages": []}), 400, None),
    (
        "/v1/chat/completions",
        chat(chat_template_kwargs={"add_generation_prompt": False}),
        400,
        "chat_template_kwargs",
    ),
    ("/v1/chat/completions", chat(continue_final_message=True), 400, None),
    (
        "/v1/chat/completions",
        chat(continue_final_message=True, add_generation_prompt=False),  # last is the user's
        400,
        None,
    ),
    # Lone surrogates anywhere; integers past int32 (int64 for seed) in any integer field.
    ("/v1/completions", completion(prompt="a\ud800b"), 400, None),
    ("/v1/completions", completion(stop=["\udfff"]), 400, None),
    ("/v1/completions", completion(user="\ud800"), 400, None),
    ("/v1/completions", completion(bad_words=["\ud800"]), 400, None),
    ("/v1/chat/completions", chat(messages=[{"role": "user", "content": "\ud83d"}]), 400, None),
    ("/v1/chat/completions", chat(chat_template_kwargs={"\ud800": 1}), 400, None),
    ("/v1/completions", completion(max_tokens=2**31), 400, "max_tokens"),
    ("/v1/completions", completion(top_k=2**31), 400, "top_k"),
    ("/v1/completions", completion(min_tokens=2**31), 400, "min_tokens"),
    ("/v1/completions", completion(priority=2**31), 400, "priority"),
    ("/v1/completions", completion(priority=-(2**31) - 1), 400, "priority"),
    ("/v1/completions", completion(stop_token_ids=[2**31]), 400, None),
    ("/v1/completions", completion(prompt=[2**31]), 400, "prompt"),
    ("/v1/completions", completion(prompt=[[1, 2**40]]), 400, "prompt"),
    ("/v1/completions", completion(seed=2**63), 400, "seed"),
    ("/v1/completions", completion(logprobs=2**31), 400, "logprobs"),
    ("/v1/completions", completion(n=2**31), 400, "n"),
    ("/v1/completions", completion(best_of=2**31), 400, "best_of"),
    ("/v1/completions", completion(truncate_prompt_tokens=2**31), 400, None),
    ("/v1/chat/completions", chat(max_completion_tokens=2**31), 400, None),
    ("/v1/chat/completions", chat(top_logprobs=2**31, logprobs=True), 400, "top_logprobs"),
    ("/v1/chat/completions", chat(model="other"), 404, "model"),
]


def _encode(body: Any) -> bytes:
    """JSON with surrogates written as \\u escapes (a lone one cannot be UTF-8 encoded)."""
    return body if isinstance(body, bytes) else json.dumps(body).encode()


def _send(client: httpx.Client, path: str, body: Any) -> httpx.Response:
    content = _encode(body)
    return client.post(path, content=content, headers={"Content-Type": "application/json"})


def _check_error(response: httpx.Response, status: int, param: str | None) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    if param is not None:
        assert error["param"] == param, error


@pytest.mark.parametrize("path,body,status,param", BAD_REQUESTS)
def test_bad_request(gw: Cluster, path: str, body: Any, status: int, param: str | None) -> None:
    with httpx.Client(base_url=gw.base_url, timeout=TIMEOUT_S) as client:
        _check_error(_send(client, path, body), status, param)
    assert not any(node.calls for node in gw.decode_nodes)


def test_unknown_fields_are_ignored(gw: Cluster) -> None:
    with httpx.Client(base_url=gw.base_url, timeout=TIMEOUT_S) as client:
        response = _send(client, "/v1/completions", completion(frobnicate=True, best_of=1))
    assert response.status_code == 200, response.text


def test_unknown_route_is_openai_shaped_404(gw: Cluster) -> None:
    response = httpx.get(f"{gw.base_url}/v1/nothing", timeout=TIMEOUT_S)
    _check_error(response, 404, None)


def test_mixed_concurrent_good_and_bad(gw: Cluster) -> None:
    rng = random.Random(0)
    good = [("/v1/completions", completion(seed=i), 200, None) for i in range(60)] + [
        ("/v1/chat/completions", chat(stream=True, seed=i), 200, None) for i in range(40)
    ]
    bad = [rng.choice(BAD_REQUESTS) for _ in range(100)]
    cases = good + bad
    rng.shuffle(cases)

    async def one(client: httpx.AsyncClient, path: str, body: Any) -> httpx.Response:
        content = _encode(body)
        return await client.post(
            path, content=content, headers={"Content-Type": "application/json"}
        )

    async def run_all() -> list[httpx.Response]:
        limits = httpx.Limits(max_connections=64)
        async with httpx.AsyncClient(base_url=gw.base_url, timeout=TIMEOUT_S, limits=limits) as c:
            return await asyncio.gather(*(one(c, path, body) for path, body, _, _ in cases))

    responses = asyncio.run(asyncio.wait_for(run_all(), 30))
    for (path, _, status, param), response in zip(cases, responses, strict=True):
        if status != 200:
            _check_error(response, status, param)
            continue
        assert response.status_code == 200, response.text
        if path == "/v1/completions":
            assert response.json()["usage"]["completion_tokens"] == 3
        else:
            assert response.text.endswith("data: [DONE]\n\n")
            assert '"finish_reason":"length"' in response.text
    assert sum(len(node.calls) for node in gw.decode_nodes) == 100
