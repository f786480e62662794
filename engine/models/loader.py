"""Read a Hugging Face-format model directory (config.json + safetensors) without transformers.

``ModelArch`` is parsed from config.json (and generation_config.json) with plain json, so start-up
stays fast; ``load_model`` builds the model class from the registry and copies the safetensors
weights straight into its (fused) parameters.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from safetensors import safe_open

from pdserve.engine.config import SUPPORTED_DTYPES
from pdserve.engine.models import gguf
from pdserve.engine.models.llama import CausalLM
from pdserve.engine.models.registry import get_model_class
from pdserve.engine.parallel import (
    PipelineStage,
    attach_all_reduce,
    check_pipeline_parallel,
    check_tensor_parallel,
    local_arch,
    shard,
    stage_arch,
    stage_layers,
    stage_weight_name,
)

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_SUPPORTED_ROPE_TYPES = ("linear", "llama3")
_MODEL_TYPE_TO_ARCH = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
}
_DEFAULT_MISTRAL_SLIDING_WINDOW = 4096  # transformers' MistralConfig default when the key is absent
# Gemma3TextConfig's defaults where config.json may omit the key
_GEMMA3_DEFAULTS = {
    "head_dim": 256,
    "sliding_window": 4096,
    "sliding_window_pattern": 6,
    "query_pre_attn_scalar": 256,
    "rope_theta": 1_000_000.0,
    "rope_local_base_freq": 10_000.0,
    "hidden_activation": "gelu_pytorch_tanh",
    "tie_word_embeddings": True,
}


@dataclass(frozen=True)
class ModelArch:
    """The shape and numerics of a checkpoint (Llama family, Gemma 3), as read from its config
    files."""

    architecture: str
    """HF architectures[0], e.g. "Qwen2ForCausalLM"."""
    vocab_size: int
    """Rows of the embedding and lm_head matrices."""
    hidden_size: int
    """Width of the residual stream."""
    intermediate_size: int
    """Width of the gated MLP."""
    num_layers: int
    """Decoder layers."""
    num_heads: int
    """Query heads."""
    num_kv_heads: int
    """Key/value heads (GQA: divides num_heads; 1 is MQA)."""
    head_dim: int
    """Per-head width (may differ from hidden_size // num_heads, e.g. Qwen3)."""
    rms_norm_eps: float
    """Epsilon of every RMSNorm."""
    rope_theta: float
    """RoPE base (of the full-attention layers, where they differ)."""
    rope_scaling: dict[str, Any] | None
    """None, or {"rope_type": "linear"|"llama3", ...} with HF's keys (full-attention layers)."""
    local_rope_theta: float | None
    """RoPE base of the sliding-window layers (Gemma 3's rope_local_base_freq, no scaling);
    None: every layer uses rope_theta and rope_scaling."""
    tie_word_embeddings: bool
    """lm_head shares the embedding matrix."""
    attention_bias: bool
    """q/k/v projections have a bias (always for Qwen2)."""
    o_proj_bias: bool
    """o_proj has a bias (Llama/Qwen3 with attention_bias)."""
    mlp_bias: bool
    """gate/up/down projections have a bias (Llama's mlp_bias)."""
    qk_norm: bool
    """Per-head RMSNorm of q and k before RoPE (Qwen3, Gemma 3)."""
    query_pre_attn_scalar: float | None
    """Attention scores are scaled by its inverse square root (Gemma 3); None: head_dim's."""
    final_logit_softcapping: float | None
    """Logits become c * tanh(logits / c) with this c (Gemma); None: no capping."""
    max_position_embeddings: int
    """Longest sequence the model supports."""
    sliding_window: int | None
    """Attention window from the config (None: full attention)."""
    layer_sliding: tuple[bool, ...]
    """Per layer, whether its attention is limited to sliding_window (Gemma 3's layer_types);
    empty for the Llama family, whose window (if any) the engine does not apply."""
    eos_token_ids: tuple[int, ...]
    """generation_config.json's eos ids first, then config.json's."""
    bos_token_id: int | None
    """Beginning-of-sequence id, if any."""
    torch_dtype: torch.dtype
    """dtype the checkpoint was saved in."""


def _read_json(path: str) -> dict[str, Any]:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _as_ids(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]


def _parse_rope(cfg: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling) from transformers 4's rope_theta/rope_scaling or 5's
    rope_parameters; scaling is None for plain RoPE."""
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    return _rope_params(params, cfg.get("rope_theta", 10000.0), cfg)


def _gemma3_rope(cfg: dict[str, Any]) -> tuple[float, dict[str, Any] | None, float]:
    """(rope_theta, rope_scaling, local_rope_theta) of a Gemma 3 config: transformers 5's
    rope_parameters per layer type, or 4's rope_theta / rope_scaling (global layers) and
    rope_local_base_freq."""
    per_type = cfg.get("rope_parameters") or {}
    global_params = per_type.get("full_attention") or cfg.get("rope_scaling") or {}
    local_params = per_type.get("sliding_attention") or {}
    theta, scaling = _rope_params(global_params, _gemma3(cfg, "rope_theta"), cfg)
    local_theta, local_scaling = _rope_params(
        local_params, _gemma3(cfg, "rope_local_base_freq"), cfg
    )
    if local_scaling is not None:
        raise ValueError(f"unsupported RoPE scaling of the sliding-window layers: {local_params}")
    return theta, scaling, local_theta


def _rope_params(
    params: dict[str, Any], default_theta: float, cfg: dict[str, Any]
) -> tuple[float, dict[str, Any] | None]:
    """(theta, scaling) from one rope_parameters / rope_scaling dict."""
    params = dict(params)
    theta = float(params.pop("rope_theta", default_theta))
    rope_type = params.pop("rope_type", params.pop("type", "default"))
    if rope_type == "default":
        return theta, None
    if rope_type not in _SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"unsupported rope scaling type {rope_type!r}; supported: {_SUPPORTED_ROPE_TYPES}"
        )
    if rope_type == "llama3":
        params.setdefault("original_max_position_embeddings", cfg.get("max_position_embeddings"))
    return theta, {"rope_type": rope_type, **params}


def _gemma3(cfg: dict[str, Any], key: str) -> Any:
    """A Gemma 3 config value, with Gemma3TextConfig's default where the key is absent."""
    return cfg.get(key, _GEMMA3_DEFAULTS[key])


def _check_gemma3(cfg: dict[str, Any]) -> None:
    """ValueError for what the engine does not implement of a Gemma 3 config."""
    if cfg.get("use_bidirectional_attention"):
        raise ValueError("bidirectional attention (EmbeddingGemma) is not supported")
    if cfg.get("attn_logit_softcapping") is not None:
        # transformers 5's default (sdpa) attention refuses it too
        raise ValueError("attention logit softcapping (attn_logit_softcapping) is not supported")
    activation = _gemma3(cfg, "hidden_activation")
    if activation != "gelu_pytorch_tanh":  # the GeGLU of models/gemma3.py
        raise ValueError(f"unsupported Gemma 3 activation {activation!r}")


def _layer_sliding(cfg: dict[str, Any], architecture: str, num_layers: int) -> tuple[bool, ...]:
    """Gemma 3's sliding-window layers: its layer_types, or for older configs every layer but
    each sliding_window_pattern-th. Empty for the Llama family."""
    if architecture != "Gemma3ForCausalLM":
        return ()
    types = cfg.get("layer_types")
    if types is None:
        pattern = int(_gemma3(cfg, "sliding_window_pattern"))
        return tuple(bool((i + 1) % pattern) for i in range(num_layers))
    if len(types) != num_layers or not set(types) <= {"sliding_attention", "full_attention"}:
        raise ValueError(f"unsupported layer_types {types} for {num_layers} layers")
    return tuple(t == "sliding_attention" for t in types)


def _sliding_window(cfg: dict[str, Any], architecture: str, num_layers: int) -> int | None:
    """The window transformers would apply, mirroring each config class's rules."""
    if architecture == "Gemma3ForCausalLM":
        return _gemma3(cfg, "sliding_window")
    if architecture == "MistralForCausalLM":
        return cfg.get("sliding_window", _DEFAULT_MISTRAL_SLIDING_WINDOW)
    if architecture in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        window = cfg.get("sliding_window")
        layers_without = cfg.get("max_window_layers", 28)
        if cfg.get("use_sliding_window") and window is not None and layers_without < num_layers:
            return window
    return None


def parse_model_arch(model_dir: str) -> ModelArch:
    """Read config.json (+ generation_config.json) of an HF model directory (a GGUF file is
    converted to one first, engine/models/gguf.py)."""
    model_dir = gguf.model_dir(model_dir)
    config_path = os.path.join(model_dir, "config.json")
    if not os.path.isdir(model_dir):
        raise ValueError(f"model directory {model_dir!r} does not exist")
    if not os.path.isfile(config_path):
        raise ValueError(f"{model_dir!r} has no config.json: not a Hugging Face model directory")
    cfg = _read_json(config_path)
    gen_path = os.path.join(model_dir, "generation_config.json")
    gen = _read_json(gen_path) if os.path.isfile(gen_path) else {}

    archs = cfg.get("architectures") or [_MODEL_TYPE_TO_ARCH.get(cfg.get("model_type", ""), "")]
    architecture = archs[0] or f"<model_type {cfg.get('model_type')!r}>"
    get_model_class(architecture)  # fail early on an unsupported architecture

    num_heads = int(cfg["num_attention_heads"])
    num_layers = int(cfg["num_hidden_layers"])
    gemma3 = architecture == "Gemma3ForCausalLM"
    default_head_dim = {"Qwen3ForCausalLM": 128, "Gemma3ForCausalLM": 256}.get(architecture)
    head_dim = cfg.get("head_dim", default_head_dim) or cfg["hidden_size"] // num_heads
    attention_bias = bool(cfg.get("attention_bias", False))
    if gemma3:
        _check_gemma3(cfg)
        rope_theta, rope_scaling, local_rope_theta = _gemma3_rope(cfg)
    else:
        (rope_theta, rope_scaling), local_rope_theta = _parse_rope(cfg), None
    tie_default = _GEMMA3_DEFAULTS["tie_word_embeddings"] if gemma3 else False
    eos = list(dict.fromkeys(_as_ids(gen.get("eos_token_id")) + _as_ids(cfg.get("eos_token_id"))))
    bos = cfg.get("bos_token_id", gen.get("bos_token_id"))
    dtype_name = cfg.get("torch_dtype") or cfg.get("dtype") or "float32"
    if dtype_name not in _DTYPES:
        raise ValueError(f"unsupported checkpoint dtype {dtype_name!r}")
    return ModelArch(
        architecture=architecture,
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=int(cfg["hidden_size"]),
        intermediate_size=int(cfg["intermediate_size"]),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
        head_dim=int(head_dim),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        local_rope_theta=local_rope_theta,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", tie_default)),
        attention_bias=attention_bias or architecture == "Qwen2ForCausalLM",
        o_proj_bias=attention_bias and architecture in ("LlamaForCausalLM", "Qwen3ForCausalLM"),
        mlp_bias=bool(cfg.get("mlp_bias", False)) and architecture == "LlamaForCausalLM",
        qk_norm=architecture in ("Qwen3ForCausalLM", "Gemma3ForCausalLM"),
        query_pre_attn_scalar=float(_gemma3(cfg, "query_pre_attn_scalar")) if gemma3 else None,
        final_logit_softcapping=cfg.get("final_logit_softcapping") if gemma3 else None,
        max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
        sliding_window=_sliding_window(cfg, architecture, num_layers),
        layer_sliding=_layer_sliding(cfg, architecture, num_layers),
        eos_token_ids=tuple(eos),
        bos_token_id=None if bos is None else int(bos),
        torch_dtype=_DTYPES[dtype_name],
    )


def resolve_dtype(dtype: str, arch: ModelArch, device: torch.device | str = "cpu") -> torch.dtype:
    """ "auto" -> the checkpoint's dtype with float16 mapped to bfloat16 (fp16 is slow on CPU);
    float16 asked for on a CPU is a ValueError."""
    if dtype == "auto":
        return torch.bfloat16 if arch.torch_dtype == torch.float16 else arch.torch_dtype
    usable = SUPPORTED_DTYPES if torch.device(device).type == "cuda" else ("float32", "bfloat16")
    if dtype not in usable:
        raise ValueError(f"dtype must be one of {usable} or 'auto' on {device}, got {dtype!r}")
    return _DTYPES[dtype]


def _check_sliding_window(
    arch: ModelArch, max_model_len: int | None, model_class: type[CausalLM]
) -> None:
    """ValueError for a window shorter than the max length that the model class would not
    apply (Mistral, Qwen2 with use_sliding_window): its outputs would silently differ."""
    if model_class.applies_sliding_window:
        return
    limit = max_model_len or arch.max_position_embeddings
    if arch.sliding_window is not None and arch.sliding_window < limit:
        raise ValueError(
            f"sliding-window attention (window {arch.sliding_window} < max length {limit}) is "
            "not supported; set max_model_len <= the window"
        )


def _weight_files(model_dir: str) -> dict[str, str]:
    """Checkpoint tensor name -> safetensors file holding it."""
    index_path = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.isfile(index_path):
        weight_map = _read_json(index_path)["weight_map"]
        return {name: os.path.join(model_dir, f) for name, f in weight_map.items()}
    files = sorted(f for f in os.listdir(model_dir) if f.endswith(".safetensors"))
    if not files:
        raise ValueError(f"{model_dir!r} has no *.safetensors weights")
    names: dict[str, str] = {}
    for f in files:
        path = os.path.join(model_dir, f)
        with safe_open(path, framework="pt") as handle:
            names.update(dict.fromkeys(handle.keys(), path))
    return names


def _iter_checked_weights(
    files: dict[str, str], expected: dict[str, tuple[int, ...]], model_dir: str
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) for every expected weight, file by file; ValueError if one is
    missing or of the wrong shape."""
    missing = sorted(n for n in expected if n not in files)
    if missing:
        raise ValueError(
            f"incomplete checkpoint in {model_dir!r}: {len(missing)} weight(s) missing, "
            f"e.g. {missing[:3]}"
        )
    by_file: dict[str, list[str]] = {}
    for name in expected:
        by_file.setdefault(files[name], []).append(name)
    for path, names in by_file.items():
        if not os.path.isfile(path):
            raise ValueError(f"incomplete checkpoint: shard {path!r} is missing")
        with safe_open(path, framework="pt") as handle:
            for name in names:
                shape = tuple(handle.get_slice(name).get_shape())
                if shape != expected[name]:
                    raise ValueError(
                        f"weight {name!r} in {path!r} has shape {shape}, expected "
                        f"{expected[name]} (checkpoint does not match config.json)"
                    )
                yield name, handle.get_tensor(name)


def load_model(
    model_dir: str,
    dtype: str = "auto",
    max_model_len: int | None = None,
    tp_rank: int = 0,
    tp_size: int = 1,
    pp_rank: int = 0,
    pp_size: int = 1,
    device: torch.device | str = "cpu",
) -> tuple[CausalLM, ModelArch]:
    """Build the model for model_dir and fill it from its safetensors (single file or sharded
    with model.safetensors.index.json). Raises ValueError for anything missing or mismatched.
    With tp_size > 1, rank tp_rank's share of it (engine/parallel.py; the arch returned is the
    whole model's). With pp_size > 1, stage pp_rank's layers (and the embedding, final norm
    and lm_head, which every stage keeps). device: where the parameters are made and filled."""
    start = time.perf_counter()
    model_dir = gguf.model_dir(model_dir)
    arch = parse_model_arch(model_dir)
    model_class = get_model_class(arch.architecture)
    _check_sliding_window(arch, max_model_len, model_class)
    torch_dtype = resolve_dtype(dtype, arch, device)
    files = _weight_files(model_dir)
    check_tensor_parallel(arch, tp_size)
    check_pipeline_parallel(arch, pp_size)
    layers = stage_layers(arch.num_layers, pp_rank, pp_size)
    with torch.device(device):  # parameters and buffers (RoPE tables) made where they live
        if pp_size > 1:
            model = model_class(stage_arch(arch, pp_rank, pp_size), torch_dtype)
            model.stage = PipelineStage(pp_rank, pp_size)
        else:
            model = model_class(local_arch(arch, tp_size) if tp_size > 1 else arch, torch_dtype)
    expected = model.checkpoint_shapes()
    if tp_size > 1 or pp_size > 1:
        with torch.device("meta"):
            whole = model_class(arch, torch_dtype).checkpoint_shapes()
        expected = {n: s for n, s in whole.items() if stage_weight_name(n, layers) is not None}
    for name, tensor in _iter_checked_weights(files, expected, model_dir):
        local_name = stage_weight_name(name, layers)
        assert local_name is not None
        model.load_weight(local_name, shard(name, tensor, arch, tp_rank, tp_size))
    if tp_size > 1:
        attach_all_reduce(model)
    model.eval()
    model.pack_weights()
    logger.info(
        "loaded %s (%s, %.1fM params, %s) in %.2fs",
        model_dir,
        arch.architecture,
        sum(p.numel() for p in model.parameters()) / 1e6,
        str(torch_dtype).removeprefix("torch."),
        time.perf_counter() - start,
    )
    return model, arch
