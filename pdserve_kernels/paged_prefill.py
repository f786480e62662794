"""Triton varlen prefill attention over the paged KV cache: several query tokens per
request (prefill chunks after a cached prefix, speculative verification), causal."""

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
def _paged_prefill_kernel(
    out_ptr,  # [T, Hq, D]
    q_ptr,  # [T, Hq, D]: queries of all requests, flattened
    kv_cache_ptr,  # [num_blocks, 2, BLOCK_SIZE, Hkv, D]
    block_tables_ptr,  # [B, max_blocks] int32/int64, padded with the null block 0
    query_start_loc_ptr,  # [B + 1] int32/int64: request b's queries are rows qsl[b]:qsl[b+1]
    seq_lens_ptr,  # [B] int32/int64: context length including this step's tokens
    qk_scale,  # softmax scale * log2(e)
    stride_qt,
    stride_qh,
    stride_qd,
    stride_ot,
    stride_oh,
    stride_od,
    stride_cb,
    stride_ckv,
    stride_cs,
    stride_ch,
    stride_cd,
    stride_btb,  # block table stride between requests
    QUERY_GROUP: tl.constexpr,  # Hq // Hkv
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,  # query tokens per program
    BLOCK_SIZE: tl.constexpr,  # tokens per KV block = keys per inner-loop tile
    UPCAST: tl.constexpr,  # compute in fp32 (interpreter, fp32 cache)
):
    # grid = (cdiv(max_query_len, BLOCK_M), B, Hq): one program per (tile of BLOCK_M query
    # tokens of one request, query head). Requests shorter than max_query_len leave their
    # trailing programs with no rows; those return at once.
    m_blk = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)  # int64 so stride products cannot overflow
    h = tl.program_id(2).to(tl.int64)
    q_start = tl.load(query_start_loc_ptr + b).to(tl.int64)
    query_len = (tl.load(query_start_loc_ptr + b + 1) - q_start).to(tl.int32)
    if m_blk * BLOCK_M >= query_len:
        return
    seq_len = tl.load(seq_lens_ptr + b).to(tl.int32)
    kvh = h // QUERY_GROUP

    offs_m = m_blk * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M] query index in the request
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    mask = (offs_m[:, None] < query_len) & (offs_d[None, :] < HEAD_DIM)
    rows = q_start + offs_m
    q = tl.load(
        q_ptr + rows[:, None] * stride_qt + h * stride_qh + offs_d[None, :] * stride_qd,
        mask=mask,
        other=0.0,
    )
    if UPCAST:
        q = q.to(tl.float32)
    else:
        q = q.to(kv_cache_ptr.dtype.element_ty)
    # Query i of the request sits at position seq_len - query_len + i.
    context_before = seq_len - query_len
    q_pos = context_before + offs_m
    # Causal: the tile's last row sees keys up to its position, none beyond seq_len.
    keys_seen = tl.minimum(context_before + (m_blk + 1) * BLOCK_M, seq_len)

    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc, m_i, l_i = paged_attn_block_loop(
        acc,
        m_i,
        l_i,
        q,
        q_pos,
        kv_cache_ptr + kvh * stride_ch,
        block_tables_ptr + b * stride_btb,
        tl.cdiv(keys_seen, BLOCK_SIZE),
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
    l_i = tl.where(l_i == 0.0, 1.0, l_i)  # rows past query_len: never stored
    out = acc / l_i[:, None]
    tl.store(
        out_ptr + rows[:, None] * stride_ot + h * stride_oh + offs_d[None, :] * stride_od,
        out.to(out_ptr.dtype.element_ty),
        mask=mask,
    )


def paged_prefill_attention(
    q: torch.Tensor,  # [T, Hq, D]
    kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, Hkv, D]
    block_tables: torch.Tensor,  # [B, max_blocks] int32/int64, padded with 0
    query_start_loc: torch.Tensor,  # [B + 1]
    seq_lens: torch.Tensor,  # [B]: context length including this step's tokens
    scale: float,
    *,
    max_query_len: int | None = None,  # known by the caller: saves a device->host sync
    out: torch.Tensor | None = None,  # [T, Hq, D] to write into (e.g. a slice of a batch)
    block_m: int = 64,  # query tokens per program (capped by max_query_len)
) -> torch.Tensor:  # [T, Hq, D]
    """Same contract as ``pdserve_kernels.reference.paged_prefill_attention_ref``."""
    block_size, num_kv_heads, head_dim = check_cache(kv_cache)
    num_tokens, num_q_heads, _ = q.shape
    assert q.shape[2] == head_dim and num_q_heads % num_kv_heads == 0
    batch = block_tables.shape[0]
    assert query_start_loc.shape == (batch + 1,) and seq_lens.shape == (batch,)
    if out is None:
        out = torch.empty_like(q)
    if batch == 0 or num_tokens == 0:
        return out
    if max_query_len is None:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max())
    if max_query_len == 0:
        return out
    block_m = max(16, min(block_m, triton.next_power_of_2(max_query_len)))
    grid = (triton.cdiv(max_query_len, block_m), batch, num_q_heads)
    _paged_prefill_kernel[grid](
        out_ptr=out,
        q_ptr=q,
        kv_cache_ptr=kv_cache,
        block_tables_ptr=block_tables,
        query_start_loc_ptr=query_start_loc,
        seq_lens_ptr=seq_lens,
        qk_scale=float(scale) * LOG2E,
        stride_qt=q.stride(0),
        stride_qh=q.stride(1),
        stride_qd=q.stride(2),
        stride_ot=out.stride(0),
        stride_oh=out.stride(1),
        stride_od=out.stride(2),
        **cache_strides(kv_cache),
        stride_btb=block_tables.stride(0),
        QUERY_GROUP=num_q_heads // num_kv_heads,
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_dim_pad(head_dim),
        BLOCK_M=block_m,
        BLOCK_SIZE=block_size,
        UPCAST=upcast_for(kv_cache),
    )
    return out
