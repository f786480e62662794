"""How many KV blocks fit on a GPU (vLLM's --gpu-memory-utilization): run one dummy step of
the largest size the scheduler can make, see how high torch's allocations peak, and give
what is left of the engine's share of the GPU to KV blocks."""

from __future__ import annotations

import logging

import torch

from pdserve.engine.attention import AttentionBackend
from pdserve.engine.model_runner import PagedModel
from pdserve.engine.models.llama import CausalLM
from pdserve.engine.models.loader import ModelArch
from pdserve.engine.outputs import ScheduledChunk
from pdserve.engine.utils import cdiv

logger = logging.getLogger(__name__)

GiB = 1 << 30


def dummy_step(max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int,
               block_size: int) -> list[ScheduledChunk]:  # fmt: skip
    """The largest step the scheduler can make: max_num_batched_tokens prompt tokens over
    min(max_num_seqs, tokens) requests (none longer than max_model_len), each sampling, on
    consecutive blocks from block 1."""
    tokens = max_num_batched_tokens
    num_seqs = max(min(max_num_seqs, tokens), cdiv(tokens, max_model_len))
    chunks, next_block = [], 1
    for i in range(num_seqs):
        n = tokens // num_seqs + (i < tokens % num_seqs)
        blocks = list(range(next_block, next_block + cdiv(n, block_size)))
        next_block += len(blocks)
        chunks.append(ScheduledChunk(f"profile-{i}", [0] * n, 0, blocks, 0, True))
    return chunks


def peak_step_memory(
    model: CausalLM,
    arch: ModelArch,
    kv_dtype: torch.dtype,
    block_size: int,
    chunks: list[ScheduledChunk],
    attention: AttentionBackend,
    device: torch.device,
) -> int:
    """Bytes torch holds at the peak of a forward + logits over chunks (the weights included,
    the dummy step's own KV blocks not)."""
    num_blocks = 1 + sum(len(c.block_ids) for c in chunks)
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    paged = PagedModel(model, arch, kv_dtype, num_blocks, block_size, attention, None, device)
    kv_bytes = paged.kv_cache.numel() * paged.kv_cache.element_size()
    logits = paged.compute_logits(chunks)
    logits.softmax(dim=-1)  # the sampler's working copy
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - kv_bytes
    del paged, logits
    torch.cuda.empty_cache()
    return peak


def kv_blocks_that_fit(
    total: int, free: int, reserved_by_torch: int, peak: int, utilization: float,
    block_bytes: int,
) -> int:  # fmt: skip
    """KV blocks in utilization x total, less the step's peak and what others hold on the
    GPU (the CUDA context, other processes: total - free - what torch has reserved)."""
    others = total - free - reserved_by_torch
    budget = int(total * utilization) - peak - others
    return max(budget, 0) // block_bytes


def gpu_num_blocks(
    model: CausalLM,
    arch: ModelArch,
    kv_dtype: torch.dtype,
    block_size: int,
    block_bytes: int,
    utilization: float,
    step: list[ScheduledChunk],
    attention: AttentionBackend,
    device: torch.device,
) -> int:
    """The KV blocks this engine may allocate on device (profiled as the module says)."""
    peak = peak_step_memory(model, arch, kv_dtype, block_size, step, attention, device)
    free, total = torch.cuda.mem_get_info(device)
    reserved = torch.cuda.memory_reserved(device)
    num_blocks = kv_blocks_that_fit(total, free, reserved, peak, utilization, block_bytes)
    logger.info(
        "GPU memory: %.2f GiB total, step peak %.2f GiB (weights included), others %.2f GiB; "
        "%d KV blocks (%.2f GiB) at gpu_memory_utilization %.2f",
        total / GiB,
        peak / GiB,
        (total - free - reserved) / GiB,
        num_blocks,
        num_blocks * block_bytes / GiB,
        utilization,
    )
    return num_blocks
