"""`pdserve serve` (gateway + 2 prefill + 2 decode nodes, KV over UCX) driven by real clients:
the official openai client, the generated gRPC stubs, raw HTTP for malformed input."""

from __future__ import annotations

import asyncio
import json
import random
from concurrent.futures import ThreadPoolExecutor

import grpc
import httpx
import openai
import pytest

from pdserve.common.protocol import sampling_params_to_proto
from pdserve.engine import LLM, SamplingParams
from pdserve.v1 import gateway_pb2, gateway_pb2_grpc
from tests.integration.stack import BLOCK, start_stack

TIMEOUT_S = 120.0


@pytest.fixture(scope="module")
def stack(tiny_llama, tmp_path_factory):
    s = start_stack(tiny_llama, tmp_path_factory.mktemp("serve"))
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


def mixed_workload(n: int, seed: int = 0) -> list[tuple[list[int], SamplingParams]]:
    """Greedy and seeded sampling; shared and unshared prefixes; short prompts that stay on the
    decode node and long ones that go to a prefill node."""
    rng = random.Random(seed)
    shared = [rng.randrange(3, 2000) for _ in range(3 * BLOCK)]
    out = []
    for i in range(n):
        kind = i % 4
        if kind == 0:
            prompt = [rng.randrange(3, 2000) for _ in range(rng.randrange(3, 12))]  # local
        elif kind == 1:
            prompt = shared + [rng.randrange(3, 2000) for _ in range(rng.randrange(1, 40))]
        else:
            prompt = [rng.randrange(3, 2000) for _ in range(rng.randrange(20, 200))]
        if i % 2 == 0:
            params = SamplingParams(max_tokens=rng.randrange(4, 24), temperature=0.0)
        else:
            params = SamplingParams(
                max_tokens=rng.randrange(4, 24), temperature=0.8, top_p=0.95, seed=1000 + i
            )
        out.append((prompt, params))
    return out


def grpc_generate(address: str, model: str, prompt, params, n=1):
    """All messages of one Generate call, as {index: token ids}, {index: finish_reason}."""
    with grpc.insecure_channel(address) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        request = gateway_pb2.GenerateRequest(
            model=model,
            token_ids=gateway_pb2.TokenIds(ids=prompt),
            sampling_params=sampling_params_to_proto(params),
            n=n,
        )
        ids: dict[int, list[int]] = {}
        reasons: dict[int, int] = {}
        for msg in stub.Generate(request, timeout=TIMEOUT_S):
            ids.setdefault(msg.index, []).extend(msg.token_ids)
            if msg.finish_reason:
                reasons[msg.index] = msg.finish_reason
    return ids, reasons


def test_health_and_models(stack, client):
    assert httpx.get(f"{stack.base_url}/health", timeout=10).status_code == 200
    assert [m.id for m in client.models.list().data] == [stack.model]


def test_only_the_nodes_load_torch(stack):
    """The gateway tokenizes and routes and serve's supervisor watches: neither process maps
    libtorch (~200 MB and ~2.5 s each at start), while the nodes do."""

    def maps_torch(pid: int) -> bool:
        with open(f"/proc/{pid}/maps") as maps:
            return "libtorch" in maps.read()

    assert not maps_torch(stack.nodes["gateway"]["pid"])
    assert not maps_torch(stack.proc.process.pid)
    assert maps_torch(stack.nodes["prefill-0"]["pid"]) and maps_torch(
        stack.nodes["decode-0"]["pid"]
    )


def test_32_concurrent_mixed_requests_equal_the_offline_engine(stack, offline):
    work = mixed_workload(32)
    with ThreadPoolExecutor(32) as pool:
        futures = [
            pool.submit(grpc_generate, stack.grpc_address, stack.model, p, sp) for p, sp in work
        ]
        served = [f.result(timeout=TIMEOUT_S) for f in futures]
    for i, ((prompt, params), (ids, reasons)) in enumerate(zip(work, served, strict=True)):
        want = offline.generate([prompt], params, use_tqdm=False)[0].outputs[0]
        assert ids[0] == want.token_ids, f"request {i} ({len(prompt)} prompt tokens)"
        assert reasons[0] in (1, 2)
    stack.wait_all_blocks_free()


def test_n_fans_out_with_seed_plus_index_like_offline(stack, offline):
    prompt = mixed_workload(3, seed=3)[2][0]
    params = SamplingParams(max_tokens=10, temperature=1.0, seed=42, n=3)
    ids, _ = grpc_generate(stack.grpc_address, stack.model, prompt, params, n=3)
    want = offline.generate([prompt], params, use_tqdm=False)[0].outputs
    assert [ids[i] for i in range(3)] == [c.token_ids for c in want]


def test_openai_completions_text_matches_offline_streamed_and_not(stack, client, offline):
    prompt = mixed_workload(4, seed=5)[3][0]
    params = SamplingParams(max_tokens=16, temperature=0.0)
    want = offline.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    out = client.completions.create(model=stack.model, prompt=prompt, max_tokens=16, temperature=0)
    assert out.choices[0].text == want.text
    assert out.choices[0].finish_reason == want.finish_reason
    assert out.usage.prompt_tokens == len(prompt)
    assert out.usage.completion_tokens == len(want.token_ids)
    stream = client.completions.create(
        model=stack.model,
        prompt=prompt,
        max_tokens=16,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want.text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(want.token_ids)


def test_openai_chat_matches_offline_and_reports_cached_tokens(stack, client, offline):
    tok = offline.get_tokenizer()
    messages = [
        {"role": "system", "content": "You are terse. " * 12},
        {"role": "user", "content": "def fibonacci(n):"},
    ]
    text = tok.apply_chat_template(messages, add_generation_prompt=True)
    prompt = tok.encode(text, add_special_tokens=False)
    want = offline.generate([prompt], SamplingParams(max_tokens=12, temperature=0.0))[0]
    first = client.chat.completions.create(
        model=stack.model, messages=messages, max_completion_tokens=12, temperature=0
    )
    assert first.choices[0].message.role == "assistant"
    assert first.choices[0].message.content == want.outputs[0].text
    assert first.usage.prompt_tokens == len(prompt)
    again = client.chat.completions.create(
        model=stack.model, messages=messages, max_completion_tokens=12, temperature=0
    )
    assert again.choices[0].message.content == want.outputs[0].text
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert cached >= (len(prompt) - 1) // BLOCK * BLOCK - BLOCK  # served from a prefix cache


def test_openai_options_logprobs_stop_n(stack, client, offline):
    prompt = mixed_workload(8, seed=11)[6][0]
    out = client.completions.create(
        model=stack.model, prompt=prompt, max_tokens=8, temperature=0, logprobs=3
    )
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 8
    assert all(len(top) == 3 for top in lp.top_logprobs)
    chat = client.chat.completions.create(
        model=stack.model,
        messages=[{"role": "user", "content": "hello"}],
        max_completion_tokens=6,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert all(len(c.top_logprobs) == 2 and c.logprob <= 0 for c in content)
    # stop string: cut exactly, finish_reason stop
    full = offline.generate([prompt], SamplingParams(max_tokens=30, temperature=0.0))[0]
    text = full.outputs[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    if stop.strip():
        cut = client.completions.create(
            model=stack.model, prompt=prompt, max_tokens=30, temperature=0, stop=[stop]
        )
        assert cut.choices[0].text == text[: text.index(stop)]
        assert cut.choices[0].finish_reason == "stop"
    many = client.completions.create(
        model=stack.model, prompt=prompt, max_tokens=5, temperature=1.0, seed=3, n=3
    )
    assert sorted(c.index for c in many.choices) == [0, 1, 2]


def test_bad_input_gets_openai_errors_and_good_requests_still_succeed(stack):
    url = stack.base_url
    bad = [
        ("/v1/completions", b"{not json"),
        ("/v1/completions", {"model": stack.model, "prompt": "x", "max_tokens": "many"}),
        ("/v1/completions", {"model": "no-such-model", "prompt": "x"}),
        ("/v1/completions", {"model": stack.model, "prompt": [5] * 600, "max_tokens": 8}),
        ("/v1/completions", {"model": stack.model, "prompt": "x", "n": 0}),
        ("/v1/completions", {"model": stack.model, "prompt": "x", "max_tokens": -3}),
        ("/v1/completions", {"model": stack.model, "prompt": "x", "temperature": -1}),
        ("/v1/chat/completions", {"model": stack.model, "messages": []}),
        ("/v1/chat/completions", {"model": stack.model, "messages": [{"role": "x", "content": "y"}]}),
        ("/v1/chat/completions", {"model": stack.model, "messages": "hello"}),
    ]  # fmt: skip
    good = {"model": stack.model, "prompt": "def f(x):", "max_tokens": 4, "temperature": 0}

    async def send(http, path, body):
        if isinstance(body, bytes):
            return await http.post(path, content=body, headers={"content-type": "application/json"})
        return await http.post(path, json=body)

    async def storm():
        async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT_S) as http:
            jobs = [(p, b, False) for p, b in bad * 25] + [("/v1/completions", good, True)] * 30
            random.Random(0).shuffle(jobs)
            replies = await asyncio.gather(*(send(http, p, b) for p, b, _ in jobs))
            return jobs, replies

    jobs, replies = asyncio.run(storm())
    texts = set()
    for (_path, body, is_good), reply in zip(jobs, replies, strict=True):
        if is_good:
            assert reply.status_code == 200, reply.text
            texts.add(reply.json()["choices"][0]["text"])
        else:
            assert 400 <= reply.status_code < 500, (body, reply.status_code, reply.text)
            error = reply.json()["error"]
            assert {"message", "type", "param", "code"} <= error.keys() and error["message"]
            if isinstance(body, dict) and body.get("model") == "no-such-model":
                assert reply.status_code == 404
    assert len(texts) == 1  # greedy: every good request got the same answer
    stack.wait_all_blocks_free()


def test_client_disconnect_mid_stream_frees_every_block(stack, client):
    for i in range(4):
        stream = client.completions.create(
            model=stack.model,
            prompt=mixed_workload(8, seed=20 + i)[2][0],
            max_tokens=300,
            temperature=0,
            extra_body={"ignore_eos": True},
            stream=True,
        )
        for n, _ in enumerate(stream):
            if n == 3:
                break
        stream.close()
    stack.wait_all_blocks_free()


def test_grpc_front_bad_input_and_list_models(stack):
    with grpc.insecure_channel(stack.grpc_address) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        models = stub.ListModels(gateway_pb2.ListModelsRequest(), timeout=10)
        assert [m.id for m in models.models] == [stack.model]
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(gateway_pb2.GenerateRequest(model="nope", text="x"), timeout=10))
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
        bad = gateway_pb2.GenerateRequest(
            model=stack.model, text="x", sampling_params={"max_tokens": -1}
        )
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(bad, timeout=10))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_zz_after_everything_every_pool_is_free(stack):
    stack.wait_all_blocks_free()
    body = json.loads(httpx.get(f"{stack.base_url}/v1/models", timeout=10).text)
    assert body["object"] == "list"


def test_a_200_request_burst_spreads_over_both_tiers(stack):
    """200 requests at once (long enough prompts to be prefilled remotely): each prefill node
    computes a fair share of the prompt tokens and each decode node runs a fair share of the
    requests (the old choices, on polled loads from before the burst, sent it all to one)."""
    from tests.observability.scrape import Samples, scrape

    def counters() -> dict[str, float]:
        out = {}
        for name, node in stack.nodes.items():
            if name == "gateway":
                continue
            samples = Samples(scrape(node["metrics_address"]))
            metric = (
                "prompt_tokens_total" if name.startswith("prefill") else "request_success_total"
            )
            out[name] = samples.value(f"pdserve:{metric}")
        return out

    rng = random.Random(99)
    prompts = [[rng.randrange(3, 1000) for _ in range(rng.randrange(40, 120))] for _ in range(200)]
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    before = counters()
    with ThreadPoolExecutor(200) as pool:
        list(pool.map(lambda p: grpc_generate(stack.grpc_address, stack.model, p, params), prompts))
    after = counters()
    share = {name: after[name] - before[name] for name in after}
    prefill = [v for n, v in share.items() if n.startswith("prefill")]
    decode = [v for n, v in share.items() if n.startswith("decode")]
    assert sum(decode) == 200, share
    assert min(decode) >= 0.3 * sum(decode), share
    assert sum(prefill) > 0.5 * sum(len(p) for p in prompts), share  # mostly remote prefill
    assert min(prefill) >= 0.3 * sum(prefill), share
    print(f"burst split: {share}")
