"""Which device the engine computes on, resolved once from ModelConfig.device."""

from __future__ import annotations

import torch

KV_CACHE_TORCH_DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn}
"""CacheConfig.kv_cache_dtype -> the cache tensor's dtype ("auto": the model's)."""


def resolve_device(name: str) -> torch.device:
    """ "auto" -> the current CUDA GPU when torch sees one, else the CPU; "cuda" -> the current
    one, "cuda:N" -> that one. ValueError naming why a CUDA device cannot be used here."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {name!r}") from None
    if device.type == "cpu":
        return torch.device("cpu")
    if device.type != "cuda":
        raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {name!r}")
    if not torch.cuda.is_available():
        raise ValueError(f"device {name!r}: torch sees no CUDA GPU here")
    index = torch.cuda.current_device() if device.index is None else device.index
    if index >= torch.cuda.device_count():
        raise ValueError(
            f"device {name!r}: only {torch.cuda.device_count()} CUDA GPU(s) are visible"
        )
    return torch.device("cuda", index)


def kv_cache_torch_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The KV cache tensor's dtype for CacheConfig.kv_cache_dtype."""
    return KV_CACHE_TORCH_DTYPES.get(kv_cache_dtype, model_dtype)
