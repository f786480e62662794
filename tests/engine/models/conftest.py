"""Fixtures shared by the model-vs-transformers tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from pdserve.engine.attention import CpuAttention, TorchAttention
from pdserve.engine.models import gguf as gguf_source
from pdserve.kernels.cpu import cpu_ops
from tests.engine.models.test_llama_vs_hf import PagedSeqs


@pytest.fixture(params=["torch_ops", "cpu_kernels"])
def layer_kernels(request: pytest.FixtureRequest) -> Iterator[str]:
    """Runs a test once on the pure-torch layers and once on the compiled CPU kernels (fused
    RMSNorm / RoPE / SiLU*up; the CPU attention backend: decode and prefill kernels, K/V
    store), restoring the previous choice."""
    ops = None
    if request.param == "cpu_kernels":
        ops = cpu_ops()
        assert ops is not None, "the CPU kernels must build on this machine (gcc + ninja)"
    saved = PagedSeqs.fused_ops, PagedSeqs.attention
    PagedSeqs.fused_ops = ops
    PagedSeqs.attention = CpuAttention(ops) if ops is not None else TorchAttention()
    yield request.param
    PagedSeqs.fused_ops, PagedSeqs.attention = saved


@pytest.fixture(scope="module")
def one_metadata_parse() -> Iterator[None]:
    """For a real-checkpoint module (used with pytestmark): transformers' own GGUF loads and the
    engine's conversion share one reader per file for the module (each new reader parses all of
    the file's metadata again: ~20 s for Gemma 3's vocabulary here)."""
    with gguf_source.reuse_readers():
        yield
