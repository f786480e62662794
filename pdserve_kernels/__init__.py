"""GPU kernels (Triton) for paged attention, each with a pure-torch reference.

The Triton wrappers are importable wherever triton is; they run on CUDA tensors, or on the
CPU under ``TRITON_INTERPRET=1`` (set before triton is imported; tests only).
"""

from __future__ import annotations

from pdserve.kernels.reference import (
    paged_decode_attention_ref,
    paged_prefill_attention_ref,
    reshape_and_cache_ref,
)

try:
    from pdserve.kernels.kv_store import reshape_and_cache
    from pdserve.kernels.paged_decode import paged_decode_attention
    from pdserve.kernels.paged_prefill import paged_prefill_attention

    _TRITON_IMPORT_ERROR: Exception | None = None
except ImportError as e:  # triton missing (e.g. macOS): references only
    _TRITON_IMPORT_ERROR = e


def triton_available() -> bool:
    """True when the Triton kernels can run on a GPU: CUDA present and triton importable."""
    import torch

    return _TRITON_IMPORT_ERROR is None and torch.cuda.is_available()


__all__ = [
    "paged_decode_attention",
    "paged_decode_attention_ref",
    "paged_prefill_attention",
    "paged_prefill_attention_ref",
    "reshape_and_cache",
    "reshape_and_cache_ref",
    "triton_available",
]
