"""pdserve make-model: deterministic HF-format output that transformers loads, sized per preset."""

from __future__ import annotations

import itertools
import json
import logging
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer

from pdserve.make_model import ARCHS, PRESETS, make_config, make_model, param_count, weight_shapes

PARAM_RANGES = {"tiny": (2e6, 5e6), "small": (20e6, 40e6), "bench": (100e6, 150e6)}
FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
)


def _read_all(model_dir: str | Path) -> dict[str, bytes]:
    return {f: Path(model_dir, f).read_bytes() for f in FILES}


def test_same_seed_gives_identical_files_across_processes(tiny_qwen2: str, tmp_path) -> None:
    # A fresh interpreter retrains the tokenizer and redraws the weights.
    out = tmp_path / "again"
    code = (
        "from pdserve.make_model import make_model; "
        f"make_model('qwen2', 'tiny', {str(out)!r}, seed=0)"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
    assert _read_all(out) == _read_all(tiny_qwen2)


def test_other_seed_gives_other_weights(tiny_qwen3: str, tmp_path) -> None:
    make_model("qwen3", "tiny", str(tmp_path), seed=1)
    ours, seed0 = _read_all(tmp_path), _read_all(tiny_qwen3)
    assert ours["model.safetensors"] != seed0["model.safetensors"]
    assert ours["tokenizer.json"] == seed0["tokenizer.json"]


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("arch", ARCHS)
def test_param_count_in_range_and_equal_to_transformers(arch: str, preset: str, tmp_path) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    low, high = PARAM_RANGES[preset]
    count = param_count(arch, preset)
    assert low <= count <= high, f"{arch}/{preset}: {count / 1e6:.1f}M params"
    (tmp_path / "config.json").write_text(json.dumps(make_config(arch, preset)))
    with torch.device("meta"):  # no memory, no init: just the shapes
        hf = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tmp_path))
    assert sum(p.numel() for p in hf.parameters()) == count
    assert {n: tuple(p.shape) for n, p in hf.named_parameters()} == weight_shapes(
        make_config(arch, preset)
    )


@pytest.mark.parametrize("arch", ARCHS)
def test_config_shape_per_arch(arch: str, tiny_model_dir: Callable[[str], str]) -> None:
    model_dir = tiny_model_dir(arch)
    config = json.loads(Path(model_dir, "config.json").read_text())
    tokenizer = Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))
    expected = {
        "llama": "LlamaForCausalLM",
        "qwen2": "Qwen2ForCausalLM",
        "qwen3": "Qwen3ForCausalLM",
        "mistral": "MistralForCausalLM",
    }[arch]
    assert config["architectures"] == [expected] and config["model_type"] == arch
    assert config["torch_dtype"] == "float32"
    assert config["num_key_value_heads"] < config["num_attention_heads"]  # GQA
    assert config["vocab_size"] >= tokenizer.get_vocab_size(with_added_tokens=True)
    if arch == "llama":
        assert config["rope_scaling"]["rope_type"] == "llama3"
        assert config["max_position_embeddings"] >= 1024
    if arch == "qwen3":
        assert config["head_dim"] != config["hidden_size"] // config["num_attention_heads"]
    if arch == "mistral":
        assert config["sliding_window"] is None


@pytest.mark.parametrize("arch", ARCHS)
def test_transformers_loads_output_and_generates_varied_text(
    arch: str, tiny_model_dir: Callable[[str], str]
) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = tiny_model_dir(arch)
    model, info = AutoModelForCausalLM.from_pretrained(model_dir, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    if arch == "qwen2":
        assert model.model.layers[0].self_attn.q_proj.bias is not None
    if arch == "qwen3":
        head_dim = json.loads(Path(model_dir, "config.json").read_text())["head_dim"]
        assert model.model.layers[0].self_attn.q_norm.weight.shape == (head_dim,)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompt = tokenizer("def main():", return_tensors="pt").input_ids
    out = model.generate(prompt, max_new_tokens=40, do_sample=False, min_new_tokens=40)
    new = out[0, prompt.shape[1] :].tolist()
    longest_run = max(sum(1 for _ in g) for _, g in itertools.groupby(new))
    assert len(set(new)) >= 15 and longest_run <= 4, new


def test_logs_progress(tmp_path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="pdserve.make_model"):
        make_model("mistral", "tiny", str(tmp_path / "m"))
    assert any("mistral/tiny" in r.getMessage() for r in caplog.records)
    assert sorted(os.listdir(tmp_path / "m")) == sorted(FILES)


def test_rejects_unknown_arch_and_preset(tmp_path) -> None:
    with pytest.raises(ValueError, match="arch"):
        make_model("gpt2", "tiny", str(tmp_path))
    with pytest.raises(ValueError, match="preset"):
        make_model("llama", "huge", str(tmp_path))
