"""Multi-LoRA through `pdserve serve` (1 prefill + 1 decode node, KV over UCX or TCP) with the
official openai client: adapters named as models, interleaved with the base model in one
batch, give the offline engine's greedy tokens (which tests/engine/test_lora.py holds equal to
transformers + PEFT) with their prompts prefilled on the prefill node under the same adapter;
vLLM's /v1/models listing, 404 for an unknown adapter, runtime load and unload."""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import grpc
import httpx
import openai
import pytest

from pdserve.engine import LLM, LoRARequest, SamplingParams
from pdserve.v1 import gateway_pb2, gateway_pb2_grpc
from tests.integration.stack import BLOCK, running_stack
from tests.lora_adapters import make_adapter

TIMEOUT_S = 120.0
PROMPT_LEN = 40
"""Long enough to be prefilled on the prefill node (--remote-prefill-min-tokens 16)."""
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def adapter_dirs(tiny_llama, tmp_path_factory) -> dict[str, str]:
    return {
        name: make_adapter(tiny_llama, tmp_path_factory.mktemp(name), seed, rank)
        for name, seed, rank in (("sql", 1, 8), ("poem", 2, 16), ("late", 3, 4))
    }


@pytest.fixture(scope="module")
def stack(tiny_llama, adapter_dirs, tmp_path_factory):
    extra = [
        "--enable-lora", "--max-loras", "2", "--max-lora-rank", "16",
        "--lora-modules", f"sql={adapter_dirs['sql']}", f"poem={adapter_dirs['poem']}",
        "--allow-runtime-lora-updating",
    ]  # fmt: skip
    with running_stack(tiny_llama, tmp_path_factory.mktemp("lora"), 1, 1, extra=extra) as s:
        yield s


@pytest.fixture(scope="module")
def client(stack):
    return openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key="none", timeout=TIMEOUT_S)


@pytest.fixture(scope="module")
def offline(tiny_llama):
    return LLM(model=tiny_llama, dtype="float32", block_size=BLOCK, num_blocks=512,
               enable_lora=True, max_loras=3, max_lora_rank=16)  # fmt: skip


def prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 2000) for _ in range(PROMPT_LEN)]


def offline_ids(offline: LLM, tokens: list[int], lora: LoRARequest | None) -> list[int]:
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    out = offline.generate([tokens], params, use_tqdm=False, lora_request=lora)
    return out[0].outputs[0].token_ids


def served_ids(client: openai.OpenAI, model: str, tokens: list[int]) -> list[int]:
    out = client.completions.create(
        model=model, prompt=tokens, max_tokens=MAX_TOKENS, temperature=0.0,
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )  # fmt: skip
    return out.choices[0].token_ids  # type: ignore[attr-defined]


def prefill_prompt_tokens(stack) -> float:
    return stack.node_counter("prefill-0", "pdserve:prompt_tokens_total")


def test_adapters_and_base_interleaved_equal_offline(client, stack, offline, adapter_dirs):
    base = client.models.list().data[0].id
    loras = {
        "sql": LoRARequest("sql", 1, adapter_dirs["sql"]),
        "poem": LoRARequest("poem", 2, adapter_dirs["poem"]),
    }
    cases = [(name, seed) for seed in range(3) for name in (base, "sql", "poem")]
    before = prefill_prompt_tokens(stack)
    with ThreadPoolExecutor(len(cases)) as pool:
        futures = [pool.submit(served_ids, client, name, prompt(seed)) for name, seed in cases]
        served = [f.result(timeout=TIMEOUT_S) for f in futures]
    for (name, seed), got in zip(cases, served, strict=True):
        want = offline_ids(offline, prompt(seed), loras.get(name))
        assert got == want, f"model {name}, prompt {seed}"
    # the adapters change the output, and the prompts were prefilled on the prefill node
    assert served[1] != served[0] and served[2] != served[0]
    assert prefill_prompt_tokens(stack) - before >= PROMPT_LEN * len(cases) / 2
    stack.wait_all_blocks_free()


def test_models_list_adapters_and_unknown_is_404(client, stack, adapter_dirs):
    cards = {m.id: m for m in client.models.list().data}
    base = next(iter(cards))
    with grpc.insecure_channel(stack.grpc_address) as channel:
        listed = gateway_pb2_grpc.GatewayStub(channel).ListModels(
            gateway_pb2.ListModelsRequest(), timeout=TIMEOUT_S
        )
    assert [(m.id, m.parent) for m in listed.models] == [(base, ""), ("sql", base), ("poem", base)]
    assert cards["sql"].parent == base and cards["sql"].root == adapter_dirs["sql"]  # type: ignore[attr-defined]
    assert cards["poem"].parent == base  # type: ignore[attr-defined]
    with pytest.raises(openai.NotFoundError):
        served_ids(client, "no-such-adapter", prompt(0))


def test_runtime_load_and_unload(client, stack, offline, adapter_dirs):
    http = httpx.Client(base_url=stack.base_url, timeout=TIMEOUT_S)
    body = {"lora_name": "late", "lora_path": adapter_dirs["late"]}
    response = http.post("/v1/load_lora_adapter", json=body)
    assert response.status_code == 200, response.text
    again = http.post("/v1/load_lora_adapter", json=body)
    assert again.status_code == 400 and "already been loaded" in again.json()["error"]["message"]
    bad = http.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/nowhere"})
    assert bad.status_code == 400
    want = offline_ids(offline, prompt(7), LoRARequest("late", 3, adapter_dirs["late"]))
    assert served_ids(client, "late", prompt(7)) == want
    assert http.post("/v1/unload_lora_adapter", json={"lora_name": "late"}).status_code == 200
    with pytest.raises(openai.NotFoundError):
        served_ids(client, "late", prompt(7))
    assert http.post("/v1/unload_lora_adapter", json={"lora_name": "late"}).status_code == 404
