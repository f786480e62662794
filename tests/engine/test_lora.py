"""Multi-LoRA against transformers + PEFT: adapters made with peft (random weights on the tiny
random base; all projections or only q/v; rsLoRA; ranks 4..16), greedy fp32 output token for
token, with four adapters and the base interleaved in one batch and with fewer slots than
adapters (the scheduler holds requests until a slot frees); no prefix-cache sharing across
adapters; bad adapters named."""

from __future__ import annotations

import json
from pathlib import Path

import peft
import pytest
import torch
import transformers

from pdserve.engine import LLM, LoRARequest, SamplingParams
from tests.lora_adapters import ALL_PROJECTIONS as ALL
from tests.lora_adapters import make_adapter

ADAPTERS = {  # name -> (rank, targets, rslora)
    "all-r8": (8, ALL, False),
    "qv-r4": (4, ["q_proj", "v_proj"], False),
    "mlp-r16": (16, ["gate_proj", "up_proj", "down_proj"], False),
    "rs-r8": (8, ALL, True),
}
PROMPTS = [[5, 6, 7, 8], list(range(100, 140)), [9] * 20, [300, 301, 302], list(range(50, 75))]
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def adapters(tiny_llama: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, LoRARequest]:
    out = {}
    for i, (name, (rank, targets, rslora)) in enumerate(ADAPTERS.items(), start=1):
        path = make_adapter(tiny_llama, tmp_path_factory.mktemp(name), i, rank, targets, rslora)
        out[name] = LoRARequest(name, i, path)
    return out


def hf_greedy(tiny_llama: str, lora: LoRARequest | None, prompt: list[int]) -> list[int]:
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    if lora is not None:
        model = peft.PeftModel.from_pretrained(model, lora.lora_path)
    model.eval()
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(MAX_TOKENS):
            logits = model(torch.tensor([ids])).logits[0, -1]
            ids.append(int(logits.argmax()))
    return ids[len(prompt) :]


@pytest.fixture(scope="module")
def expected(tiny_llama, adapters) -> dict[tuple[str | None, int], list[int]]:
    names = [None, *adapters]
    return {
        (name, i): hf_greedy(tiny_llama, adapters.get(name) if name else None, prompt)
        for name in names
        for i, prompt in enumerate(PROMPTS)
    }


PARAMS = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.mark.parametrize("max_loras", [4, 2])
def test_adapters_and_base_in_one_batch_equal_transformers_peft(
    tiny_llama, adapters, expected, max_loras
) -> None:
    llm = LLM(model=tiny_llama, dtype="float32", num_blocks=128, block_size=16,
              enable_lora=True, max_loras=max_loras, max_lora_rank=16)  # fmt: skip
    names = [None, *adapters]
    cases = [(names[(i + j) % len(names)], i) for j in range(2) for i in range(len(PROMPTS))]
    loras = [adapters[n] if n else None for n, _ in cases]
    outputs = llm.generate([PROMPTS[i] for _, i in cases], PARAMS, use_tqdm=False,
                           lora_request=loras)  # fmt: skip
    for (name, i), out in zip(cases, outputs, strict=True):
        assert out.outputs[0].token_ids == expected[(name, i)], f"adapter {name}, prompt {i}"
    # the adapters change the output (else equality above would prove nothing)
    for name in adapters:
        assert expected[(name, 1)] != expected[(None, 1)], name
    assert llm.engine.scheduler.kv.pool.num_free_blocks == 127


def test_no_prefix_cache_sharing_across_adapters(tiny_llama, adapters, expected) -> None:
    llm = LLM(model=tiny_llama, dtype="float32", num_blocks=128, block_size=16,
              enable_lora=True, max_loras=2, max_lora_rank=16)  # fmt: skip
    prompt = PROMPTS[1]  # 40 tokens: two full blocks to share

    def run(name: str | None):
        lora = adapters[name] if name else None
        return llm.generate([prompt], PARAMS, use_tqdm=False, lora_request=lora)[0]

    first = run("all-r8")
    assert first.num_cached_tokens == 0
    again = run("all-r8")
    assert again.num_cached_tokens == 32  # the same adapter shares its blocks
    for name in ("qv-r4", None):  # another adapter, and the base, do not
        other = run(name)
        assert other.num_cached_tokens == 0, name
        assert other.outputs[0].token_ids == expected[(name, 1)]
    assert again.outputs[0].token_ids == expected[("all-r8", 1)]


def write_adapter(path: Path, rank: int, a_shape: tuple[int, int], b_shape: tuple[int, int],
                  **config) -> None:  # fmt: skip
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    base = {"peft_type": "LORA", "r": rank, "lora_alpha": rank, "target_modules": ["q_proj"]}
    (path / "adapter_config.json").write_text(json.dumps({**base, **config}))
    prefix = "base_model.model.model.layers.0.self_attn.q_proj"
    save_file(
        {f"{prefix}.lora_A.weight": torch.zeros(a_shape), f"{prefix}.lora_B.weight": torch.zeros(b_shape)},
        str(path / "adapter_model.safetensors"),
    )  # fmt: skip


def test_bad_adapters_are_value_errors(tiny_llama, adapters, tmp_path) -> None:
    llm = LLM(model=tiny_llama, dtype="float32", num_blocks=64, enable_lora=True,
              max_loras=1, max_lora_rank=8)  # fmt: skip
    hidden = llm.engine.arch.hidden_size
    q_rows = llm.engine.arch.num_heads * llm.engine.arch.head_dim
    write_adapter(tmp_path / "wrong-base", 4, (4, hidden + 8), (q_rows, 4))
    write_adapter(tmp_path / "dora", 4, (4, hidden), (q_rows, 4), use_dora=True)
    write_adapter(tmp_path / "truncated", 4, (4, hidden), (q_rows, 4))
    data = (tmp_path / "truncated" / "adapter_model.safetensors").read_bytes()
    (tmp_path / "truncated" / "adapter_model.safetensors").write_bytes(data[: len(data) // 2])
    # 2 GiB claimed by a foreign adapter: refused from the header, before a byte is read
    huge = tmp_path / "huge"
    write_adapter(huge, 4, (4, hidden), (q_rows, 4))
    header = json.dumps(
        {
            "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": {
                "dtype": "F32",
                "shape": [4, 1 << 27],
                "data_offsets": [0, 1 << 31],
            }
        }
    ).encode()
    (huge / "adapter_model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header)
    cases = [
        (adapters["mlp-r16"], "rank 16"),  # above max_lora_rank 8
        (LoRARequest("wrong-base", 9, str(tmp_path / "wrong-base")), "another base model"),
        (LoRARequest("dora", 10, str(tmp_path / "dora")), "DoRA"),
        (LoRARequest("missing", 11, str(tmp_path / "nowhere")), "not a directory"),
        (LoRARequest("truncated", 12, str(tmp_path / "truncated")), "unreadable safetensors"),
        (LoRARequest("huge", 13, str(huge)), "unreadable safetensors"),
    ]
    for lora, message in cases:
        with pytest.raises(ValueError, match=message):
            llm.generate([[5, 6]], PARAMS, use_tqdm=False, lora_request=lora)
    plain = LLM(model=tiny_llama, dtype="float32", num_blocks=64)
    with pytest.raises(ValueError, match="enable-lora"):
        plain.generate([[5, 6]], PARAMS, use_tqdm=False, lora_request=adapters["qv-r4"])
    # nothing leaked, and good requests still run
    assert llm.generate([[5, 6]], PARAMS, use_tqdm=False)[0].outputs[0].token_ids
    assert llm.engine.scheduler.kv.pool.num_free_blocks == 63
