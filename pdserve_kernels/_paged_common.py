"""Pieces shared by the paged-attention kernels: the KV-block loop (online softmax) and
the launch-parameter helpers of the Python wrappers."""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634


def interpreting() -> bool:
    """True when Triton runs kernels on the CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "yes", "on")


def upcast_for(kv_cache: torch.Tensor) -> bool:
    """Whether the kernels cast loaded Q/K/V to fp32 (and use exact fp32 dots) instead of
    feeding the 16-bit cache dtype to the tensor cores. Always under the interpreter, which
    stores bf16 as raw uint16 and computes bf16 arithmetic wrongly; and for an fp32 cache."""
    return interpreting() or kv_cache.dtype == torch.float32


def head_dim_pad(head_dim: int) -> int:
    """Tile width for the head dim: a power of two, at least 16 (tl.dot's minimum)."""
    return max(16, triton.next_power_of_2(head_dim))


def cache_strides(kv_cache: torch.Tensor) -> dict[str, int]:
    """The cache's strides as the kernels' keyword arguments ([num_blocks, 2, block_size, Hkv, D]
    order: block, K/V, slot, head, head_dim)."""
    names = ("stride_cb", "stride_ckv", "stride_cs", "stride_ch", "stride_cd")
    return dict(zip(names, kv_cache.stride(), strict=True))


def check_cache(kv_cache: torch.Tensor) -> tuple[int, int, int]:
    """(block_size, num_kv_heads, head_dim) of a ``[num_blocks, 2, bs, Hkv, D]`` cache."""
    assert kv_cache.dim() == 5 and kv_cache.shape[1] == 2, "kv_cache must be [N, 2, bs, Hkv, D]"
    block_size = kv_cache.shape[2]
    assert block_size >= 16 and block_size & (block_size - 1) == 0, (
        f"block_size must be a power of two >= 16 (one KV block is one tile), got {block_size}"
    )
    return block_size, kv_cache.shape[3], kv_cache.shape[4]


@triton.jit
def paged_attn_block_loop(
    acc,  # [M, HEAD_DIM_PAD] fp32: running sum of p @ V
    m_i,  # [M] fp32: running max of the (log2-scaled) scores
    l_i,  # [M] fp32: running sum of exp2(score - m_i)
    q,  # [M, HEAD_DIM_PAD]: query rows (fp32 if UPCAST, else the cache dtype)
    q_pos,  # [M] int: position of each query row; it sees keys at positions <= it
    kv_head_ptr,  # [num_blocks, 2, BLOCK_SIZE, Hkv, D] cache, advanced to this KV head
    block_table_ptr,  # [max_blocks] this request's block table row (int32/int64)
    num_blocks,  # blocks of the table to visit: 0 .. num_blocks-1
    seq_len,  # keys at positions >= seq_len are never seen
    qk_scale,  # softmax scale * log2(e)
    stride_cb,  # cache stride between blocks
    stride_ckv,  # cache stride between K (0) and V (1)
    stride_cs,  # cache stride between slots of a block
    stride_cd,  # cache stride along head_dim
    BLOCK_SIZE: tl.constexpr,  # tokens per KV block = keys per tile
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    UPCAST: tl.constexpr,  # cast K/V to fp32 after load and use exact fp32 dots
):
    """Visit the first num_blocks KV blocks of a block table, one block per iteration,
    folding each into the online-softmax state (acc, m_i, l_i), which it returns."""
    offs_s = tl.arange(0, BLOCK_SIZE)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    d_mask = offs_d[None, :] < HEAD_DIM
    tile_offs = offs_s[:, None] * stride_cs + offs_d[None, :] * stride_cd  # [BLOCK_SIZE, D_PAD]
    for j in range(0, num_blocks):
        block_id = tl.load(block_table_ptr + j).to(tl.int64)
        k_pos = j * BLOCK_SIZE + offs_s  # [BLOCK_SIZE] positions of this block's keys
        # Slots past seq_len hold stale or uninitialised data (maybe NaN, and 0 * NaN = NaN
        # in p @ V): load zeros there instead.
        kv_mask = d_mask & (k_pos[:, None] < seq_len)
        k_ptrs = kv_head_ptr + block_id * stride_cb + tile_offs
        k = tl.load(k_ptrs, mask=kv_mask, other=0.0)  # [BLOCK_SIZE, D_PAD]
        v = tl.load(k_ptrs + stride_ckv, mask=kv_mask, other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
            s = tl.dot(q, tl.trans(k), input_precision="ieee")  # [M, BLOCK_SIZE]
        else:
            s = tl.dot(q, tl.trans(k))
        visible = (k_pos[None, :] <= q_pos[:, None]) & (k_pos[None, :] < seq_len)
        s = tl.where(visible, s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row that has seen no key yet keeps max -inf; shift it by 0 so exp2 gives 0, not nan.
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_shift)
        p = tl.exp2(s - m_shift[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if UPCAST:
            pv = tl.dot(p, v, input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    return acc, m_i, l_i
