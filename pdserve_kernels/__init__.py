"""GPU kernels (Triton) for paged attention, each with a pure-torch reference.

The Triton wrappers are importable wherever triton is; they run on CUDA tensors, or on the
CPU under ``TRITON_INTERPRET=1`` (set before triton is imported; tests only).
"""

from __future__ import annotations

_TRITON_KERNELS = {
    "reshape_and_cache": "pdserve.kernels.kv_store",
    "paged_decode_attention": "pdserve.kernels.paged_decode",
    "paged_prefill_attention": "pdserve.kernels.paged_prefill",
    "paged_decode_attention_ref": "pdserve.kernels.reference",
    "paged_prefill_attention_ref": "pdserve.kernels.reference",
    "reshape_and_cache_ref": "pdserve.kernels.reference",
}
"""The Triton wrappers and their torch references, imported on first use (PEP 562): a CPU
process that only needs pdserve.kernels.cpu never imports triton (76 ms, and its bindings' leak
report at exit), and one that only needs pdserve.kernels.cache (the gateway, through the GGUF
source) never imports torch."""


def __getattr__(name: str) -> object:
    if name not in _TRITON_KERNELS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(_TRITON_KERNELS[name]), name)


def triton_available() -> bool:
    """True when the Triton kernels can run on a GPU: CUDA present and triton importable."""
    import torch

    if not torch.cuda.is_available():
        return False
    try:
        import triton  # noqa: F401
    except ImportError:  # triton missing (e.g. macOS): references only
        return False
    return True


__all__ = [
    "paged_decode_attention",
    "paged_decode_attention_ref",
    "paged_prefill_attention",
    "paged_prefill_attention_ref",
    "reshape_and_cache",
    "reshape_and_cache_ref",
    "triton_available",
]
