"""vLLM's extensions of the OpenAI API at the gateway, through the official openai client (and
httpx for vLLM's own routes), against fake decode nodes: the response fields vLLM returns, and
the sampling parameters carried to the nodes."""

from __future__ import annotations

import json

import httpx
import pytest

from pdserve.engine.tokenizer import Tokenizer
from pdserve.gateway.completions import _best
from pdserve.gateway.sequence import FinalOutput
from pdserve.v1 import common_pb2
from tests.gateway.fake_nodes import EOS_TOKEN_ID, expected_tokens, fake_logprobs
from tests.gateway.harness import MODEL_NAME, Cluster
from tests.gateway.test_rest_openai import TIMEOUT_S, client


def sent_params(gw: Cluster) -> list[common_pb2.SamplingParams]:
    return [c.request.sampling_params for node in gw.decode_nodes for c in node.calls]


def post(gw: Cluster, path: str, body: dict) -> httpx.Response:
    content = json.dumps(body).encode()  # ASCII: a lone surrogate travels as \\u escape
    headers = {"Content-Type": "application/json"}
    return httpx.post(f"{gw.base_url}{path}", content=content, headers=headers, timeout=TIMEOUT_S)


# --- /tokenize, /detokenize, /version ---------------------------------------------------------


def test_tokenize_prompt_fields_as_vllm(gw: Cluster, tokenizer: Tokenizer) -> None:
    text = "Hello wörld"
    out = post(gw, "/tokenize", {"model": MODEL_NAME, "prompt": text}).json()
    assert set(out) == {"count", "max_model_len", "tokens", "token_strs"}
    assert out["tokens"] == tokenizer.encode(text)
    assert out["count"] == len(out["tokens"]) and out["max_model_len"] == 512
    assert out["token_strs"] is None
    bare = post(gw, "/tokenize", {"prompt": text, "add_special_tokens": False}).json()
    assert bare["tokens"] == tokenizer.encode(text, add_special_tokens=False)
    strs = post(gw, "/tokenize", {"prompt": text, "return_token_strs": True}).json()
    pieces = [tokenizer.backend.id_to_token(t) for t in strs["tokens"]]
    assert strs["token_strs"] == pieces


def test_tokenize_messages_equals_what_chat_sends(gw: Cluster, tokenizer: Tokenizer) -> None:
    messages = [{"role": "user", "content": "Hi there"}]
    out = post(gw, "/tokenize", {"model": MODEL_NAME, "messages": messages}).json()
    client(gw).chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=2)
    (sent,) = [c.request for node in gw.decode_nodes for c in node.calls]
    assert out["tokens"] == list(sent.prompt_token_ids)
    text = tokenizer.apply_chat_template(messages)
    assert out["tokens"] == tokenizer.encode(text, add_special_tokens=False)


def test_continue_final_message_leaves_the_assistant_turn_open(
    gw: Cluster, tokenizer: Tokenizer
) -> None:
    messages = [
        {"role": "user", "content": "Count"},
        {"role": "assistant", "content": "one, two,"},
    ]
    body = {"messages": messages, "add_generation_prompt": False}
    closed = post(gw, "/tokenize", body).json()["tokens"]
    opened = post(gw, "/tokenize", {**body, "continue_final_message": True}).json()["tokens"]
    assert tokenizer.decode(opened, skip_special_tokens=False).endswith("one, two,")
    assert closed[: len(opened)] == opened and len(closed) > len(opened)
    client(gw).chat.completions.create(
        model=MODEL_NAME,
        messages=messages,  # type: ignore[arg-type]
        max_tokens=2,
        extra_body={"continue_final_message": True, "add_generation_prompt": False},
    )
    (sent,) = [c.request for node in gw.decode_nodes for c in node.calls]
    assert list(sent.prompt_token_ids) == opened


def test_detokenize_and_version(gw: Cluster, tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("round trip", add_special_tokens=False)
    assert post(gw, "/detokenize", {"model": MODEL_NAME, "tokens": ids}).json() == {
        "prompt": "round trip"
    }
    bad = post(gw, "/detokenize", {"tokens": [1, 10**6]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    assert post(gw, "/tokenize", {"model": "other", "prompt": "x"}).status_code == 404
    assert post(gw, "/tokenize", {"prompt": "\ud800"}).status_code == 400
    version = httpx.get(f"{gw.base_url}/version", timeout=TIMEOUT_S).json()
    assert version == {"version": "0.1.0"}


# --- completions: batches, echo, best_of ------------------------------------------------------


def test_batched_prompts_index_choices_prompt_times_n(
    gw: Cluster, tokenizer: Tokenizer, script: list[int]
) -> None:
    prompts = [[11, 12, 13], [40, 41, 42, 43, 44]]
    out = client(gw).completions.create(model=MODEL_NAME, prompt=prompts, max_tokens=5, n=2, seed=7)
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    for choice in out.choices:
        prompt = prompts[choice.index // 2]
        want = expected_tokens(script, len(prompt), 7 + choice.index % 2, 5)
        assert choice.text == tokenizer.decode(want)
    assert out.usage.prompt_tokens == 8 and out.usage.completion_tokens == 20
    text_batch = client(gw).completions.create(
        model=MODEL_NAME, prompt=["Once upon", "a time"], max_tokens=3, seed=1, stream=True
    )
    chunks = list(text_batch)
    texts = {0: "", 1: ""}
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    for index, prompt in enumerate(["Once upon", "a time"]):
        want = expected_tokens(script, len(tokenizer.encode(prompt)), 1, 3)
        assert texts[index] == tokenizer.decode(want)


def test_echo_prepends_the_prompt(gw: Cluster, tokenizer: Tokenizer, script: list[int]) -> None:
    prompt = "Once upon a time"
    out = client(gw).completions.create(
        model=MODEL_NAME, prompt=prompt, max_tokens=3, seed=2, echo=True
    )
    generated = tokenizer.decode(expected_tokens(script, len(tokenizer.encode(prompt)), 2, 3))
    assert out.choices[0].text == prompt + generated
    stream = client(gw).completions.create(
        model=MODEL_NAME, prompt=[30, 31], max_tokens=3, seed=2, echo=True, stream=True
    )
    chunks = [c.choices[0].text for c in stream if c.choices]
    assert chunks[0].startswith(tokenizer.decode([30, 31]))
    assert "".join(chunks) == tokenizer.decode([30, 31]) + tokenizer.decode(
        expected_tokens(script, 2, 2, 3)
    )


def test_best_of_generates_more_and_returns_n(gw: Cluster) -> None:
    out = client(gw).completions.create(
        model=MODEL_NAME, prompt=[5, 6], max_tokens=4, n=1, best_of=3, seed=3
    )
    assert [c.index for c in out.choices] == [0] and out.choices[0].logprobs is None
    assert out.usage.completion_tokens == 12  # all three candidates count, as in OpenAI's
    assert [p.logprobs for p in sent_params(gw)] == [0, 0, 0]  # to rank the candidates


def test_best_of_ranks_by_cumulative_logprob_per_prompt() -> None:
    def output(index: int, logprobs: list[float]) -> FinalOutput:
        entries = [common_pb2.TokenLogprob(token_id=1, logprob=lp) for lp in logprobs]
        return FinalOutput(index=index, text=str(index), logprobs=entries)

    outputs = [
        output(0, [-1.0, -1.0]),
        output(1, [-0.5]),
        output(2, [-3.0]),
        output(3, [-2.0]),
        output(4, [-0.1, -0.1]),
        output(5, [-0.1, -0.1]),
    ]
    best = _best(outputs, num_candidates=3, n=2)
    assert [(o.index, o.text) for o in best] == [(0, "1"), (1, "0"), (2, "4"), (3, "5")]


# --- prompt_logprobs and echo with logprobs --------------------------------------------------


def check_prompt_logprobs(got: list, prompt: list[int], num_top: int, texts) -> None:
    """vLLM's shape: None, then per prompt token {id: {logprob, rank, decoded_token}} with the
    prompt token first and num_top top ones (the fake node reports the prompt token as the
    most likely, so they overlap once)."""
    assert len(got) == len(prompt) and got[0] is None
    for position, (entry, token) in enumerate(zip(got[1:], prompt[1:], strict=True), start=1):
        assert list(entry)[0] == str(token)
        assert len(entry) == max(num_top, 1)
        assert entry[str(token)] == {
            "logprob": fake_logprobs(token, position, 0).logprob,
            "rank": 1,
            "decoded_token": texts(token),
        }
        assert [e["rank"] for e in entry.values()] == list(range(1, len(entry) + 1))


def test_prompt_logprobs_completion_and_chat(gw: Cluster, tokenizer: Tokenizer) -> None:
    prompt = [30, 31, 32, 33]
    texts = lambda t: tokenizer.decode([t], skip_special_tokens=False)  # noqa: E731
    out = client(gw).completions.create(
        model=MODEL_NAME, prompt=prompt, max_tokens=2, extra_body={"prompt_logprobs": 3}
    )
    check_prompt_logprobs(out.choices[0].prompt_logprobs, prompt, 3, texts)
    assert out.choices[0].logprobs is None
    zero = client(gw).completions.create(
        model=MODEL_NAME, prompt=prompt, max_tokens=2, stream=True,
        extra_body={"prompt_logprobs": 0},
    )  # fmt: skip
    chunks = list(zero)
    check_prompt_logprobs(chunks[0].choices[0].prompt_logprobs, prompt, 0, texts)
    assert all("prompt_logprobs" not in c.choices[0].model_dump() for c in chunks[1:])
    messages = [{"role": "user", "content": "Hi"}]
    prompt_ids = tokenizer.encode(tokenizer.apply_chat_template(messages), add_special_tokens=False)
    chat = client(gw).chat.completions.create(
        model=MODEL_NAME, messages=messages, max_tokens=2, n=2, extra_body={"prompt_logprobs": 1}
    )
    check_prompt_logprobs(chat.prompt_logprobs, prompt_ids, 1, texts)
    asked = sorted(p.prompt_logprobs for p in sent_params(gw))
    assert asked == [0, 1, 1, 3]  # one per choice
    plain = client(gw).completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=2)
    assert plain.choices[0].prompt_logprobs is None  # null, as vLLM's
    assert sum(p.HasField("prompt_logprobs") for p in sent_params(gw)) == 4


def test_echo_with_logprobs_scores_the_prompt_too(
    gw: Cluster, tokenizer: Tokenizer, script: list[int]
) -> None:
    prompt = [30, 31, 32]
    want = expected_tokens(script, len(prompt), 5, 3)
    out = client(gw).completions.create(
        model=MODEL_NAME, prompt=prompt, max_tokens=3, seed=5, echo=True, logprobs=2
    )
    lp = out.choices[0].logprobs
    names = [tokenizer.decode([t], skip_special_tokens=False) for t in prompt + want]
    assert lp.tokens == names
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1] == fake_logprobs(31, 1, 0).logprob
    assert lp.token_logprobs[3] == fake_logprobs(want[0], 3, 0).logprob
    offsets = [sum(len(n) for n in names[:i]) for i in range(len(names))]
    assert lp.text_offset == offsets
    assert [p.prompt_logprobs for p in sent_params(gw)] == [2]  # echo + logprobs asks for them
    stream = client(gw).completions.create(
        model=MODEL_NAME, prompt=prompt, max_tokens=3, seed=5, echo=True, logprobs=2, stream=True
    )
    chunks = [c.choices[0] for c in stream if c.choices]
    streamed = [t for c in chunks for t in c.logprobs.tokens]
    assert streamed == names
    assert [o for c in chunks for o in c.logprobs.text_offset] == offsets
    assert chunks[0].logprobs.token_logprobs[0] is None


# --- token ids in responses -------------------------------------------------------------------


def test_return_token_ids_completion(gw: Cluster, tokenizer: Tokenizer, script: list[int]) -> None:
    prompt = "Once upon"
    prompt_ids = tokenizer.encode(prompt)
    want = expected_tokens(script, len(prompt_ids), 4, 5)
    out = client(gw).completions.create(
        model=MODEL_NAME, prompt=prompt, max_tokens=5, seed=4, extra_body={"return_token_ids": True}
    )
    assert out.choices[0].prompt_token_ids == prompt_ids
    assert out.choices[0].token_ids == want
    plain = client(gw).completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=5)
    assert plain.choices[0].model_dump().get("token_ids") is None
    stream = client(gw).completions.create(
        model=MODEL_NAME,
        prompt=prompt,
        max_tokens=5,
        seed=4,
        stream=True,
        extra_body={"return_token_ids": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].prompt_token_ids == prompt_ids
    assert all("prompt_token_ids" not in c.choices[0].model_dump() for c in chunks[1:])
    assert [t for c in chunks for t in c.choices[0].token_ids] == want


def test_return_token_ids_chat(gw: Cluster, tokenizer: Tokenizer, script: list[int]) -> None:
    messages = [{"role": "user", "content": "Hi"}]
    prompt_ids = tokenizer.encode(tokenizer.apply_chat_template(messages), add_special_tokens=False)
    want = expected_tokens(script, len(prompt_ids), 4, 5)
    extra = {"return_token_ids": True}
    out = client(gw).chat.completions.create(
        model=MODEL_NAME, messages=messages, max_tokens=5, seed=4, extra_body=extra
    )
    assert out.prompt_token_ids == prompt_ids and out.choices[0].token_ids == want
    stream = client(gw).chat.completions.create(
        model=MODEL_NAME, messages=messages, max_tokens=5, seed=4, stream=True, extra_body=extra
    )
    chunks = list(stream)
    assert chunks[0].prompt_token_ids == prompt_ids
    assert all("prompt_token_ids" not in c.model_dump() for c in chunks[1:])
    assert [t for c in chunks[1:] for t in c.choices[0].token_ids] == want


def test_return_tokens_as_token_ids_in_logprobs(gw: Cluster, script: list[int]) -> None:
    extra = {"return_tokens_as_token_ids": True}
    out = client(gw).completions.create(
        model=MODEL_NAME, prompt=[20, 21], max_tokens=3, logprobs=1, seed=1, extra_body=extra
    )
    want = expected_tokens(script, 2, 1, 3)
    assert out.choices[0].logprobs.tokens == [f"token_id:{t}" for t in want]
    assert f"token_id:{want[0]}" in out.choices[0].logprobs.top_logprobs[0]
    chat = client(gw).chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=2,
        logprobs=True,
        top_logprobs=1,
        extra_body=extra,
    )
    assert all(e.token.startswith("token_id:") for e in chat.choices[0].logprobs.content)


# --- sampling parameters carried to the nodes -------------------------------------------------


def test_token_constraints_reach_the_decode_node(gw: Cluster, tokenizer: Tokenizer) -> None:
    client(gw).completions.create(
        model=MODEL_NAME,
        prompt="Hi",
        max_tokens=2,
        logit_bias={"17": -100, "42": 2.5},
        extra_body={"allowed_token_ids": [17, 42, 99], "bad_words": ["quick fox"]},
    )
    (params,) = sent_params(gw)
    assert dict(params.logit_bias) == {17: -100.0, 42: 2.5}
    assert list(params.allowed_token_ids) == [17, 42, 99]
    words = [list(w.token_ids) for w in params.bad_words]
    assert tokenizer.encode("quick fox", add_special_tokens=False) in words


def test_include_stop_str_in_output(gw: Cluster, tokenizer: Tokenizer, script: list[int]) -> None:
    full = tokenizer.decode(expected_tokens(script, 4, 0, 40))
    stop = "quick br"
    out = client(gw).completions.create(
        model=MODEL_NAME,
        prompt=[7] * 4,
        max_tokens=40,
        temperature=0,
        stop=stop,
        extra_body={"include_stop_str_in_output": True},
    )
    assert out.choices[0].text == full[: full.index(stop) + len(stop)]
    assert sent_params(gw)[0].include_stop_str_in_output


def test_skip_special_tokens_false_keeps_them(gw: Cluster, tokenizer: Tokenizer) -> None:
    body = tokenizer.encode("Bye now.", add_special_tokens=False)
    bos = tokenizer.bos_token_id
    assert bos is not None and bos != EOS_TOKEN_ID
    for node in gw.decode_nodes:
        node.behaviour.script = [*body, bos, *body]
    prompt = [5] * (2 * len(body) + 1)  # starts the script over
    kept = client(gw).completions.create(
        model=MODEL_NAME,
        prompt=prompt,
        max_tokens=len(body) * 2 + 1,
        temperature=0,
        extra_body={"skip_special_tokens": False},
    )
    skipped = client(gw).completions.create(
        model=MODEL_NAME, prompt=prompt, max_tokens=len(body) * 2 + 1, temperature=0
    )
    special = tokenizer.decode([bos], skip_special_tokens=False)
    assert special in kept.choices[0].text and special not in skipped.choices[0].text


@pytest.mark.parametrize("stream", [False, True])
def test_64kb_stop_strings_are_accepted_and_cheap(gw: Cluster, stream: bool) -> None:
    stops = ["a" * 65535 + c for c in "bcde"]
    out = client(gw).completions.create(
        model=MODEL_NAME, prompt=[9, 9], max_tokens=40, n=16, stop=stops, stream=stream, seed=0
    )
    if stream:
        out = list(out)  # type: ignore[assignment]
    assert out
