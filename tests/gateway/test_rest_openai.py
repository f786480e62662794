"""The REST front through the official openai client, against fake decode nodes."""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest

from pdserve.engine.tokenizer import Tokenizer
from tests.gateway.conftest import StartCluster
from tests.gateway.fake_nodes import EOS_TOKEN_ID, expected_tokens, fake_logprobs
from tests.gateway.harness import MODEL_NAME, Cluster

TIMEOUT_S = 10.0


def client(gw: Cluster) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{gw.base_url}/v1", api_key="x", max_retries=0, timeout=TIMEOUT_S
    )


def async_client(gw: Cluster) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(
        base_url=f"{gw.base_url}/v1", api_key="x", max_retries=0, timeout=TIMEOUT_S
    )


def chat_prompt_len(tokenizer: Tokenizer, content: str) -> int:
    text = tokenizer.apply_chat_template([{"role": "user", "content": content}])
    return len(tokenizer.encode(text, add_special_tokens=False))


def test_models_and_health(gw: Cluster) -> None:
    models = client(gw).models.list()
    assert [m.id for m in models.data] == [MODEL_NAME]
    assert models.data[0].model_extra["max_model_len"] == 512
    assert httpx.get(f"{gw.base_url}/health", timeout=TIMEOUT_S).status_code == 200


def test_completion_text_usage_and_finish_length(
    gw: Cluster, tokenizer: Tokenizer, script: list[int]
) -> None:
    prompt = "Once upon a time"
    prompt_ids = tokenizer.encode(prompt)
    out = client(gw).completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=7, seed=5)
    want = expected_tokens(script, len(prompt_ids), 5, 7)
    assert out.object == "text_completion" and out.model == MODEL_NAME
    assert out.choices[0].text == tokenizer.decode(want)
    assert out.choices[0].finish_reason == "length"
    assert out.usage.prompt_tokens == len(prompt_ids)
    assert out.usage.completion_tokens == 7
    assert out.usage.total_tokens == len(prompt_ids) + 7
    sent = [c.request for node in gw.decode_nodes for c in node.calls]
    assert len(sent) == 1 and list(sent[0].prompt_token_ids) == prompt_ids
    assert sent[0].sampling_params.seed == 5 and sent[0].sampling_params.max_tokens == 7
    assert list(sent[0].prefill_candidates) == [gw.config.prefill_nodes[0]]


def test_token_id_prompt_and_cached_tokens(gw: Cluster, script: list[int]) -> None:
    prompt = list(range(100, 140))  # 40 tokens: two full 16-token blocks before the last token
    first = client(gw).completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=2)
    assert first.usage.prompt_tokens == 40
    # Both decode nodes see the prompt once, so the second time each reports a cache hit.
    for node in gw.decode_nodes:
        node._cached_tokens(prompt)
    again = client(gw).completions.create(model=MODEL_NAME, prompt=[prompt], max_tokens=2)
    assert again.usage.prompt_tokens_details.cached_tokens == 32


def test_finish_stop_on_eos_and_stop_token(gw: Cluster, tokenizer: Tokenizer) -> None:
    body = tokenizer.encode("Bye now.", add_special_tokens=False)
    for node in gw.decode_nodes:
        node.behaviour.script = body + [EOS_TOKEN_ID]
    prompt = [5] * (len(body) + 1)  # the script starts over at position len(body) + 1
    out = client(gw).completions.create(
        model=MODEL_NAME, prompt=prompt, max_tokens=50, temperature=0
    )
    assert out.choices[0].text == "Bye now."
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].model_extra["stop_reason"] is None
    assert out.usage.completion_tokens == len(body) + 1
    stop_id = body[2]
    out = client(gw).completions.create(
        model=MODEL_NAME,
        prompt=prompt,
        max_tokens=50,
        temperature=0,
        extra_body={"stop_token_ids": [stop_id]},
    )
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].model_extra["stop_reason"] == stop_id
    assert out.usage.completion_tokens == 3


def test_stop_string_split_across_tokens(
    gw: Cluster, tokenizer: Tokenizer, script: list[int]
) -> None:
    # Paced like a real node: unpaced, the fake node can put all 40 tokens on the wire before
    # the gateway's cancel reaches it, and the cancel check below would depend on timing.
    for node in gw.decode_nodes:
        node.behaviour.token_delay_s = 0.01
    prompt = [7] * 4
    full = tokenizer.decode(expected_tokens(script, 4, 0, 40))
    stop = "quick br"  # spans several tokens
    assert stop in full
    want = full[: full.index(stop)]
    out = client(gw).completions.create(
        model=MODEL_NAME, prompt=prompt, max_tokens=40, temperature=0, stop=[stop, "zzz"]
    )
    assert out.choices[0].text == want
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].model_extra["stop_reason"] == stop
    streamed = client(gw).completions.create(
        model=MODEL_NAME, prompt=prompt, max_tokens=40, temperature=0, stop=stop, stream=True
    )
    chunks = list(streamed)
    assert "".join(c.choices[0].text for c in chunks) == want
    assert chunks[-1].choices[0].finish_reason == "stop"
    # The node's call was cancelled once the stop string matched: it did not run to max_tokens.
    calls = [c for node in gw.decode_nodes for c in node.calls]
    assert all(c.num_tokens_sent < 40 for c in calls)


def test_stream_multibyte_whole_characters(
    gw: Cluster, tokenizer: Tokenizer, script: list[int]
) -> None:
    stream = client(gw).completions.create(
        model=MODEL_NAME, prompt=[9, 9], max_tokens=30, seed=0, stream=True
    )
    texts = [c.choices[0].text for c in stream]
    assert "".join(texts) == tokenizer.decode(expected_tokens(script, 2, 0, 30))
    assert all("\ufffd" not in t for t in texts)


def test_n_fans_out_with_seed_plus_index(
    gw: Cluster, tokenizer: Tokenizer, script: list[int]
) -> None:
    out = client(gw).completions.create(
        model=MODEL_NAME, prompt=[11, 12, 13], max_tokens=6, n=3, seed=100
    )
    assert [c.index for c in out.choices] == [0, 1, 2]
    for i, choice in enumerate(out.choices):
        assert choice.text == tokenizer.decode(expected_tokens(script, 3, 100 + i, 6))
    assert out.usage.completion_tokens == 18 and out.usage.prompt_tokens == 3
    ids = sorted(c.request.request_id for node in gw.decode_nodes for c in node.calls)
    assert ids == [f"{out.id}-{i}" for i in range(3)]


def test_completion_logprobs_shape(gw: Cluster, tokenizer: Tokenizer, script: list[int]) -> None:
    out = client(gw).completions.create(
        model=MODEL_NAME, prompt=[20, 21], max_tokens=4, logprobs=2, seed=1
    )
    lp = out.choices[0].logprobs
    tokens = expected_tokens(script, 2, 1, 4)
    assert lp.tokens == [tokenizer.decode([t], skip_special_tokens=False) for t in tokens]
    assert lp.token_logprobs == [fake_logprobs(t, 2 + i, 2).logprob for i, t in enumerate(tokens)]
    offsets = [sum(len(s) for s in lp.tokens[:i]) for i in range(4)]
    assert lp.text_offset == offsets
    first = fake_logprobs(tokens[0], 2, 2)
    want_top = {
        tokenizer.decode([e.token_id], skip_special_tokens=False): e.logprob for e in first.top
    }
    assert lp.top_logprobs[0] == want_top


def test_chat_non_streaming_and_logprobs(
    gw: Cluster, tokenizer: Tokenizer, script: list[int]
) -> None:
    content = "Hi there"
    prompt_len = chat_prompt_len(tokenizer, content)
    out = client(gw).chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": [{"type": "text", "text": content}]}],
        max_completion_tokens=5,
        seed=2,
        logprobs=True,
        top_logprobs=3,
    )
    tokens = expected_tokens(script, prompt_len, 2, 5)
    choice = out.choices[0]
    assert out.object == "chat.completion"
    assert choice.message.role == "assistant"
    assert choice.message.content == tokenizer.decode(tokens)
    assert choice.finish_reason == "length"
    assert out.usage.prompt_tokens == prompt_len
    entries = choice.logprobs.content
    assert [e.logprob for e in entries] == [
        fake_logprobs(t, prompt_len + i, 3).logprob for i, t in enumerate(tokens)
    ]
    assert all(len(e.top_logprobs) == 3 for e in entries)
    assert b"".join(bytes(e.bytes) for e in entries).decode() == tokenizer.decode(tokens)


def test_chat_stream_include_usage(gw: Cluster, tokenizer: Tokenizer, script: list[int]) -> None:
    content = "Tell me"
    prompt_len = chat_prompt_len(tokenizer, content)
    stream = client(gw).chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": content}],
        max_tokens=8,
        n=2,
        seed=3,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 16
    texts = {0: "", 1: ""}
    finish = {}
    for c in chunks[:-1]:
        assert c.object == "chat.completion.chunk" and c.usage is None
        (choice,) = c.choices
        texts[choice.index] += choice.delta.content or ""
        if choice.finish_reason:
            finish[choice.index] = choice.finish_reason
    assert chunks[0].choices[0].delta.role == "assistant"
    sys_prompt_len = len(
        tokenizer.encode(
            tokenizer.apply_chat_template(
                [{"role": "system", "content": "Be brief."}, {"role": "user", "content": content}]
            ),
            add_special_tokens=False,
        )
    )
    assert prompt_len < sys_prompt_len
    for i in (0, 1):
        assert texts[i] == tokenizer.decode(expected_tokens(script, sys_prompt_len, 3 + i, 8))
    assert finish == {0: "length", 1: "length"}


def test_default_chat_max_tokens_fills_context(gw: Cluster, tokenizer: Tokenizer) -> None:
    prompt_len = chat_prompt_len(tokenizer, "x")
    client(gw).chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "x"}], stop=["e"]
    )
    (call,) = [c for node in gw.decode_nodes for c in node.calls]
    assert call.request.sampling_params.max_tokens == 512 - prompt_len


def test_async_client_concurrent_streams(gw: Cluster) -> None:
    async def one(i: int) -> str:
        async with async_client(gw) as c:
            stream = await c.completions.create(
                model=MODEL_NAME, prompt=[30 + i], max_tokens=5, stream=True
            )
            return "".join([chunk.choices[0].text async for chunk in stream])

    async def all_of_them() -> list[str]:
        return await asyncio.gather(*(one(i) for i in range(8)))

    texts = asyncio.run(asyncio.wait_for(all_of_them(), TIMEOUT_S))
    assert len(texts) == 8 and all(texts)
    # power of two choices spread them over both decode nodes
    assert all(node.calls for node in gw.decode_nodes)


@pytest.mark.parametrize("stream", [False, True])
def test_unknown_model_is_404(gw: Cluster, stream: bool) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        client(gw).completions.create(model="nope", prompt="hi", stream=stream)
    assert info.value.body["code"] == "model_not_found"


def test_prefill_candidates_follow_the_routed_prefix(make_cluster: StartCluster) -> None:
    cluster = make_cluster(num_prefill=2)
    p0, p1 = cluster.config.prefill_nodes
    cluster.prefill_nodes[0].num_running = 5  # p1 is less loaded ...
    time.sleep(0.3)  # ... once the registry has polled (every 0.1 s here)

    def candidates_for(prompt: list[int]) -> list[str]:
        for node in cluster.decode_nodes:
            node.calls.clear()
        client(cluster).completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=1)
        (call,) = [c for node in cluster.decode_nodes for c in node.calls]
        return list(call.request.prefill_candidates)

    shared = list(range(200, 248))  # three 16-token blocks
    assert candidates_for(shared) == [p1, p0]
    cluster.prefill_nodes[0].num_running = 0
    cluster.prefill_nodes[1].num_running = 9  # now p0 is less loaded ...
    time.sleep(0.3)
    assert candidates_for(shared + [1, 2, 3]) == [p1, p0]  # but p1 holds the prefix
    assert candidates_for(list(range(300, 340))) == [p0, p1]  # a new prompt goes by load


def test_chat_template_flag_replaces_the_models(
    make_cluster: StartCluster, tokenizer: Tokenizer, tmp_path
) -> None:
    """vLLM's --chat-template: a file (or the template itself); a template that raises is a
    400 carrying its message."""
    template = tmp_path / "plain.jinja"
    template.write_text(
        "{% for m in messages %}{% if m['role'] == 'system' %}"
        "{{ raise_exception('no system messages here') }}{% endif %}"
        "[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    )
    cluster = make_cluster(chat_template=str(template))
    messages = [{"role": "user", "content": "hello there"}]
    reply = client(cluster).chat.completions.create(
        model=MODEL_NAME, messages=messages, max_tokens=2
    )
    expected = tokenizer.encode("[user] hello there\n", add_special_tokens=False)
    assert reply.usage.prompt_tokens == len(expected)
    with pytest.raises(openai.BadRequestError, match="no system messages here"):
        client(cluster).chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "system", "content": "x"}, *messages], max_tokens=2
        )
