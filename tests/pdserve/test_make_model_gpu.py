"""make-model for a GPU: the gpu-1b preset's shape (checked on the meta device, never built
here) and weights drawn on the device asked for."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from pdserve.cli import build_parser, main
from pdserve.make_model import (
    ARCHS,
    GPU_PRESETS,
    PRESETS,
    make_config,
    make_weights,
    param_count,
    weight_shapes,
)

TOKENIZER_SIZE = 27718
"""What the BPE trainer reaches on its corpus when asked for 32000 (fewer than the model's)."""


def test_gpu_1b_is_the_llama_shape_asked_for():
    config = make_config("llama", "gpu-1b", TOKENIZER_SIZE)
    shape = {
        k: config[k]
        for k in (
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "intermediate_size",
            "vocab_size",
            "max_position_embeddings",
        )
    }
    assert shape == {
        "hidden_size": 2048,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "intermediate_size": 5632,
        "vocab_size": 32000,
        "max_position_embeddings": 4096,
    }
    assert config["rope_scaling"]["original_max_position_embeddings"] == 512
    assert "gpu-1b" in GPU_PRESETS and "gpu-1b" not in PRESETS  # the CPU suites skip it


@pytest.mark.parametrize("arch", ARCHS)
def test_gpu_1b_per_arch_matches_transformers_on_the_meta_device(arch: str, tmp_path) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = make_config(arch, "gpu-1b", TOKENIZER_SIZE)
    assert config["vocab_size"] == 32000 and config["hidden_size"] == 2048
    assert config["head_dim"] == (128 if arch == "qwen3" else 64)  # qwen3's explicit head_dim
    count = param_count(arch, "gpu-1b")
    assert 0.75e9 <= count <= 1.1e9, f"{arch}: {count / 1e9:.2f}B params"
    (tmp_path / "config.json").write_text(json.dumps(config))
    with torch.device("meta"):  # shapes only: no memory, no init
        hf = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tmp_path))
    assert {n: tuple(p.shape) for n, p in hf.named_parameters()} == weight_shapes(config)


def test_a_small_tokenizer_keeps_the_presets_vocab_and_a_large_one_grows_it():
    assert make_config("llama", "gpu-1b", 100)["vocab_size"] == 32000
    assert make_config("llama", "gpu-1b", 40000)["vocab_size"] == 40000
    assert make_config("llama", "tiny", 2000)["vocab_size"] == 2048  # unchanged presets


def test_weights_are_drawn_on_the_device_asked_for():
    config = make_config("qwen2", "tiny", 2000)
    default, cpu = make_weights(config, 3), make_weights(config, 3, device="cpu")
    assert default.keys() == cpu.keys()
    assert all(torch.equal(default[k], cpu[k]) for k in default)
    assert {w.device.type for w in cpu.values()} == {"cpu"}


def test_cli_takes_the_gpu_preset_and_a_device(tmp_path) -> None:
    args = build_parser().parse_args(
        ["make-model", "--preset", "gpu-1b", "--device", "cuda:0", "--out", str(tmp_path)]
    )
    assert (args.preset, args.device) == ("gpu-1b", "cuda:0")
    out = tmp_path / "m"
    assert main(["make-model", "--preset", "tiny", "--device", "cpu", "--out", str(out)]) == 0
    weights = load_file(out / "model.safetensors")
    assert weights.keys() == weight_shapes(json.loads(Path(out, "config.json").read_text())).keys()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_weights_are_written_from_host_memory(tmp_path) -> None:
    from pdserve.make_model import make_model

    make_model("llama", "tiny", str(tmp_path), seed=1, device="cuda")
    weights = load_file(tmp_path / "model.safetensors")
    assert {w.device.type for w in weights.values()} == {"cpu"}
    assert all(torch.isfinite(w).all() for w in weights.values())
