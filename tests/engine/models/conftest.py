"""Fixtures shared by the model-vs-transformers tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from pdserve.engine import attention
from pdserve.engine.models import llama
from pdserve.kernels.cpu import cpu_ops


@pytest.fixture(params=["torch_ops", "cpu_kernels"])
def layer_kernels(request: pytest.FixtureRequest) -> Iterator[str]:
    """Runs a test once on the pure-torch layers and once on the compiled CPU kernels (fused
    RMSNorm / RoPE / SiLU*up, the decode attention kernel and the K/V store), restoring the
    previous choice."""
    ops = None
    if request.param == "cpu_kernels":
        ops = cpu_ops()
        assert ops is not None, "the CPU kernels must build on this machine (gcc + ninja)"
    saved = llama._fused, attention._decode_kernel, attention._store_kv
    llama.use_cpu_fused_ops(ops)
    attention.use_cpu_attention_ops(ops)
    yield request.param
    llama.use_cpu_fused_ops(saved[0])
    attention._decode_kernel, attention._store_kv = saved[1:]
