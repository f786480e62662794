"""Triton paged-attention decode: one query token per request over its paged KV cache."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.kernels._paged_common import (
    LOG2E,
    cache_strides,
    check_cache,
    head_dim_pad,
    paged_attn_block_loop,
    upcast_for,
)


@triton.jit
def _paged_decode_kernel(
    out_ptr,  # [B, Hq, D]
    q_ptr,  # [B, Hq, D]
    kv_cache_ptr,  # [num_blocks, 2, BLOCK_SIZE, Hkv, D]
    block_tables_ptr,  # [B, max_blocks] int32/int64, padded with the null block 0
    seq_lens_ptr,  # [B] int32/int64: context length including the query token
    qk_scale,  # softmax scale * log2(e)
    stride_qb,
    stride_qh,
    stride_qd,
    stride_ob,
    stride_oh,
    stride_od,
    stride_cb,
    stride_ckv,
    stride_cs,
    stride_ch,
    stride_cd,
    stride_btb,  # block table stride between requests
    QUERY_GROUP: tl.constexpr,  # Hq // Hkv: query heads sharing one KV head
    GROUP_PAD: tl.constexpr,  # QUERY_GROUP rounded up to a power of two >= 16 (tl.dot rows)
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    UPCAST: tl.constexpr,  # compute in fp32 (interpreter, fp32 cache)
):
    # grid = (B, Hkv): one program per (request, KV head). The QUERY_GROUP query heads that
    # share this KV head are the rows of one tile, so each K/V block is loaded once per KV
    # head (GQA/MQA), not once per query head.
    b = tl.program_id(0).to(tl.int64)  # int64 so stride products cannot overflow
    kvh = tl.program_id(1).to(tl.int64)
    seq_len = tl.load(seq_lens_ptr + b).to(tl.int32)

    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    heads = kvh * QUERY_GROUP + offs_g  # [GROUP_PAD] query heads of this program
    mask = (offs_g[:, None] < QUERY_GROUP) & (offs_d[None, :] < HEAD_DIM)
    q = tl.load(
        q_ptr + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :] * stride_qd,
        mask=mask,
        other=0.0,
    )
    if UPCAST:
        q = q.to(tl.float32)
    else:
        q = q.to(kv_cache_ptr.dtype.element_ty)
    # Every row is the request's newest token, at position seq_len - 1.
    q_pos = tl.zeros([GROUP_PAD], dtype=tl.int32) + (seq_len - 1)

    acc = tl.zeros([GROUP_PAD, HEAD_DIM_PAD], dtype=tl.float32)
    m_i = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([GROUP_PAD], dtype=tl.float32)
    acc, m_i, l_i = paged_attn_block_loop(
        acc,
        m_i,
        l_i,
        q,
        q_pos,
        kv_cache_ptr + kvh * stride_ch,
        block_tables_ptr + b * stride_btb,
        tl.cdiv(seq_len, BLOCK_SIZE),
        seq_len,
        qk_scale,
        stride_cb,
        stride_ckv,
        stride_cs,
        stride_cd,
        BLOCK_SIZE=BLOCK_SIZE,
        HEAD_DIM=HEAD_DIM,
        HEAD_DIM_PAD=HEAD_DIM_PAD,
        UPCAST=UPCAST,
    )
    l_i = tl.where(l_i == 0.0, 1.0, l_i)  # seq_len 0 (padding request): output zeros
    out = acc / l_i[:, None]
    tl.store(
        out_ptr + b * stride_ob + heads[:, None] * stride_oh + offs_d[None, :] * stride_od,
        out.to(out_ptr.dtype.element_ty),
        mask=mask,
    )


def paged_decode_attention(
    q: torch.Tensor,  # [B, Hq, D]: one query token per request
    kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, Hkv, D]
    block_tables: torch.Tensor,  # [B, max_blocks] int32/int64, padded with 0
    seq_lens: torch.Tensor,  # [B]: context length including the query token
    scale: float,
    *,
    out: torch.Tensor | None = None,  # [B, Hq, D] to write into (e.g. a slice of a batch)
) -> torch.Tensor:  # [B, Hq, D]
    """Same contract as ``pdserve_kernels.reference.paged_decode_attention_ref``."""
    block_size, num_kv_heads, head_dim = check_cache(kv_cache)
    batch, num_q_heads, _ = q.shape
    assert q.shape[2] == head_dim and num_q_heads % num_kv_heads == 0
    assert block_tables.shape[0] == batch and seq_lens.shape == (batch,)
    if out is None:
        out = torch.empty_like(q)
    if batch == 0:
        return out
    group = num_q_heads // num_kv_heads
    _paged_decode_kernel[(batch, num_kv_heads)](
        out_ptr=out,
        q_ptr=q,
        kv_cache_ptr=kv_cache,
        block_tables_ptr=block_tables,
        seq_lens_ptr=seq_lens,
        qk_scale=float(scale) * LOG2E,
        stride_qb=q.stride(0),
        stride_qh=q.stride(1),
        stride_qd=q.stride(2),
        stride_ob=out.stride(0),
        stride_oh=out.stride(1),
        stride_od=out.stride(2),
        **cache_strides(kv_cache),
        stride_btb=block_tables.stride(0),
        QUERY_GROUP=group,
        GROUP_PAD=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_dim_pad(head_dim),
        BLOCK_SIZE=block_size,
        UPCAST=upcast_for(kv_cache),
    )
    return out
