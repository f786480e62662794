"""Loading a PEFT LoRA adapter directory and checking it against the base model.

A PEFT directory holds adapter_config.json (r, lora_alpha, target_modules, ...) and
adapter_model.safetensors (or .bin) with, per adapted projection,
``base_model.model.<module>.lora_A.weight`` [r, in] and ``...lora_B.weight`` [out, r]. The
adapter adds ``scaling * B (A x)`` to the projection's output, scaling = lora_alpha / r
(lora_alpha / sqrt(r) with use_rslora). Our q/k/v and gate/up projections are fused, so an
adapted q_proj becomes shard 0 of qkv_proj, and so on (models/llama.py's _FUSED).

What PEFT can express but this engine does not apply (DoRA, biases, modules_to_save, adapted
embeddings or lm_head, per-module rank/alpha patterns) is a ValueError naming it, never
silently dropped.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from pdserve.engine.lora.request import LoRARequest
from pdserve.engine.models.llama import _FUSED, CausalLM, Linear

_PEFT_PREFIX = "base_model.model."
_UNSUPPORTED_CONFIG = {
    "use_dora": "DoRA adapters",
    "modules_to_save": "modules_to_save (fully trained extra modules)",
    "rank_pattern": "per-module ranks (rank_pattern)",
    "alpha_pattern": "per-module alphas (alpha_pattern)",
    "layers_to_transform": "layers_to_transform",
}


@dataclass
class LoRAAdapter:
    """A loaded adapter: per (fused projection module, shard), A [r, in] and scaling * B
    [shard rows, r], in the model's dtype."""

    request: LoRARequest
    rank: int
    weights: dict[tuple[str, int], tuple[torch.Tensor, torch.Tensor]]

    @property
    def name(self) -> str:
        return self.request.lora_name


def read_config(path: Path) -> dict:
    config_file = path / "adapter_config.json"
    if not config_file.is_file():
        raise ValueError(f"LoRA adapter {path}: no adapter_config.json (not a PEFT adapter?)")
    try:
        config = json.loads(config_file.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"LoRA adapter {path}: adapter_config.json is not JSON: {e}") from e
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"LoRA adapter {path}: peft_type {config.get('peft_type')!r} is not LORA")
    for key, what in _UNSUPPORTED_CONFIG.items():
        if config.get(key):
            raise ValueError(f"LoRA adapter {path}: {what} are not supported")
    if config.get("bias", "none") != "none":
        raise ValueError(f"LoRA adapter {path}: bias={config['bias']!r} is not supported")
    if config.get("fan_in_fan_out"):
        raise ValueError(f"LoRA adapter {path}: fan_in_fan_out (Conv1D bases) is not supported")
    return config


def _open_tensors(path: Path) -> tuple[dict[str, tuple[int, ...]], Callable[[str], torch.Tensor]]:
    """Each tensor's shape, read before any tensor's data (the safetensors header; a legacy
    .bin is memory-mapped), and a function that loads one: shapes are checked against the base
    model first, so an oversized or foreign file costs no memory."""
    safetensors = path / "adapter_model.safetensors"
    if safetensors.is_file():
        try:
            f = safe_open(str(safetensors), framework="pt")
            shapes = {key: tuple(f.get_slice(key).get_shape()) for key in f.keys()}
        except Exception as e:  # noqa: BLE001 - safetensors raises its own error types
            raise ValueError(f"LoRA adapter {path}: unreadable safetensors file: {e}") from e
        return shapes, f.get_tensor
    legacy = path / "adapter_model.bin"
    if legacy.is_file():
        try:
            tensors = torch.load(legacy, map_location="cpu", weights_only=True, mmap=True)
        except Exception as e:  # noqa: BLE001 - torch.load raises many error types
            raise ValueError(f"LoRA adapter {path}: unreadable adapter_model.bin: {e}") from e
        if not isinstance(tensors, dict):
            raise ValueError(f"LoRA adapter {path}: adapter_model.bin holds no state dict")
        return {key: tuple(t.shape) for key, t in tensors.items()}, tensors.__getitem__
    raise ValueError(f"LoRA adapter {path}: no adapter_model.safetensors or adapter_model.bin")


def load_adapter(request: LoRARequest, model: CausalLM, max_rank: int) -> LoRAAdapter:
    """Read and check request's adapter against model; ValueError says what does not fit."""
    path = Path(request.lora_path)
    if not path.is_dir():
        raise ValueError(f"LoRA adapter {request.lora_name!r}: {path} is not a directory")
    config = read_config(path)
    rank = int(config.get("r", 0))
    if not 1 <= rank <= max_rank:
        raise ValueError(
            f"LoRA adapter {request.lora_name!r} has rank {rank}; --max-lora-rank is {max_rank}"
        )
    alpha = float(config.get("lora_alpha", rank))
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    shapes, load = _open_tensors(path)
    pairs: dict[str, dict[str, str]] = {}
    for key in shapes:
        name = key.removeprefix(_PEFT_PREFIX)
        for part in ("lora_A", "lora_B"):
            suffix = f".{part}.weight"
            if name.endswith(suffix):
                pairs.setdefault(name.removesuffix(suffix), {})[part] = key
                break
        else:
            raise ValueError(
                f"LoRA adapter {request.lora_name!r}: tensor {key} is not a LoRA A/B weight "
                "(only q/k/v/o and MLP projections can be adapted)"
            )
    if not pairs:
        raise ValueError(f"LoRA adapter {request.lora_name!r} holds no LoRA weights")
    targets: dict[tuple[str, int], tuple[str, str]] = {}
    for module_name, pair in pairs.items():
        if set(pair) != {"lora_A", "lora_B"}:
            raise ValueError(f"LoRA adapter {request.lora_name!r}: {module_name} lacks A or B")
        key, linear = _target(model, module_name, request.lora_name)
        size = linear.shard_sizes[key[1]]
        a, b = shapes[pair["lora_A"]], shapes[pair["lora_B"]]
        want_a, want_b = (rank, linear.weight.shape[1]), (size, rank)
        if a != want_a or b != want_b:
            raise ValueError(
                f"LoRA adapter {request.lora_name!r}: {module_name} has A {a} and B {b}; the "
                f"base model needs {want_a} and {want_b} (an adapter for another base model?)"
            )
        targets[key] = (pair["lora_A"], pair["lora_B"])
    weights = {
        key: (load(a).to(model.dtype), (load(b).float() * scaling).to(model.dtype))
        for key, (a, b) in targets.items()
    }
    return LoRAAdapter(request, rank, weights)


def _target(model: CausalLM, module_name: str, lora_name: str) -> tuple[tuple[str, int], Linear]:
    """(fused module path, shard) and the Linear that module_name (a checkpoint projection
    name) adapts."""
    prefix, _, proj = module_name.rpartition(".")
    fused, shard = _FUSED.get(proj, (proj, 0))
    path = f"{prefix}.{fused}"
    try:
        module = model.get_submodule(path)
    except AttributeError:
        module = None
    if not isinstance(module, Linear) or ".layers." not in f".{path}":
        raise ValueError(
            f"LoRA adapter {lora_name!r} adapts {module_name}, which is not a projection of this "
            "model's decoder layers"
        )
    return (path, shard), module
