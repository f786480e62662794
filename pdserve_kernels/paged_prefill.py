"""Triton varlen prefill attention over the paged KV cache: several query tokens per
request (prefill chunks after a cached prefix, speculative verification), causal; with a
sliding window the query at position p sees keys in (p - window, p] only, and a query tile
reads no K/V before its first row's window.

GQA head sharing: a program's query tile holds consecutive query positions of one request
times all the query heads of one KV head (row r = position r // QUERY_GROUP, head
r % QUERY_GROUP), so each K/V tile is loaded once for the whole group.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.kernels._paged_common import (
    FP8_DTYPE,
    LOG2E,
    attend_kv_range,
    cache_strides,
    check_cache,
    check_scales,
    head_dim_pad,
    key_tile,
    query_in_dot_dtype,
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
    window,  # sliding window: the query at p sees keys in (p - window, p]; 0: no window
    qk_scale,  # softmax scale * log2(e) * k_scale
    v_scale,  # dequantization scale of V (1.0 unless the cache is fp8)
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
    BLOCK_M: tl.constexpr,  # query rows per program: positions x QUERY_GROUP heads (+ pad)
    BLOCK_SIZE: tl.constexpr,  # tokens per KV block
    BLOCK_N: tl.constexpr,  # keys per inner-loop tile
    UPCAST: tl.constexpr,  # compute in fp32 (interpreter, fp32 cache)
    FP8_CACHE: tl.constexpr,  # the cache is float8_e4m3fn
):
    # grid = (cdiv(max_query_len, POSITIONS), B, Hkv): one program per (tile of POSITIONS
    # query tokens of one request, KV head). Requests shorter than max_query_len leave their
    # trailing programs with no rows; those return at once.
    POSITIONS: tl.constexpr = BLOCK_M // QUERY_GROUP
    m_blk = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)  # int64 so stride products cannot overflow
    kvh = tl.program_id(2).to(tl.int64)
    q_start = tl.load(query_start_loc_ptr + b).to(tl.int64)
    query_len = (tl.load(query_start_loc_ptr + b + 1) - q_start).to(tl.int32)
    if m_blk * POSITIONS >= query_len:
        return
    seq_len = tl.load(seq_lens_ptr + b).to(tl.int32)

    offs_r = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    offs_m = m_blk * POSITIONS + offs_r // QUERY_GROUP  # [BLOCK_M] query index in the request
    heads = kvh * QUERY_GROUP + offs_r % QUERY_GROUP  # [BLOCK_M] query head of each row
    row_ok = (offs_r < POSITIONS * QUERY_GROUP) & (offs_m < query_len)
    mask = row_ok[:, None] & (offs_d[None, :] < HEAD_DIM)
    rows = q_start + offs_m
    q_offs = rows[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :] * stride_qd
    q = tl.load(q_ptr + q_offs, mask=mask, other=0.0)
    q = query_in_dot_dtype(q, kv_cache_ptr, UPCAST=UPCAST, FP8_CACHE=FP8_CACHE)
    # Query i of the request sits at position seq_len - query_len + i (after a cached prefix).
    context_before = seq_len - query_len
    q_pos = context_before + offs_m
    first_q_pos = context_before + m_blk * POSITIONS
    # Causal: the tile's last position sees keys up to itself; tiles past it are skipped.
    kv_end = tl.minimum(first_q_pos + POSITIONS, seq_len)
    # Window: keys before the first row's window are seen by no row; they are skipped.
    kv_start = tl.where(window > 0, tl.maximum(first_q_pos - window + 1, 0), 0)

    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc, m_i, l_i = attend_kv_range(
        acc, m_i, l_i, q, q_pos, first_q_pos, kv_end - 1,
        kv_cache_ptr + kvh * stride_ch, block_tables_ptr + b * stride_btb, kv_start, kv_end,
        window, qk_scale, stride_cb, stride_ckv, stride_cs, stride_cd,
        BLOCK_SIZE=BLOCK_SIZE, BLOCK_N=BLOCK_N, HEAD_DIM=HEAD_DIM, HEAD_DIM_PAD=HEAD_DIM_PAD,
        UPCAST=UPCAST,
    )  # fmt: skip
    l_i = tl.where(l_i == 0.0, 1.0, l_i)  # rows past query_len: never stored
    out = acc * (v_scale / l_i)[:, None]
    o_offs = rows[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :] * stride_od
    tl.store(out_ptr + o_offs, out.to(out_ptr.dtype.element_ty), mask=mask)


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
    block_m: int = 128,  # query rows per program (query tokens x the KV group's query heads)
    k_scale: float = 1.0,  # fp8 cache: K = stored * k_scale (must be 1.0 otherwise)
    v_scale: float = 1.0,  # fp8 cache: V = stored * v_scale
    block_n: int | None = None,  # keys per inner-loop tile (power of two >= 16; None: 64)
    window: int | None = None,  # sliding window: query at p sees keys in (p - window, p]
) -> torch.Tensor:  # [T, Hq, D]
    """Same contract as ``pdserve_kernels.reference.paged_prefill_attention_ref``."""
    block_size, num_kv_heads, head_dim = check_cache(kv_cache)
    check_scales(kv_cache, k_scale, v_scale)
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
    window = window or 0
    assert window >= 0, f"window must be >= 0, got {window}"
    group = num_q_heads // num_kv_heads
    # rows: a power of two >= 16 (tl.dot), at least one position's group, no more than needed
    block_m = max(16, triton.next_power_of_2(group), min(block_m, max_query_len * group))
    block_m = triton.next_power_of_2(block_m)
    positions = block_m // group
    grid = (triton.cdiv(max_query_len, positions), batch, num_kv_heads)
    _paged_prefill_kernel[grid](
        out_ptr=out,
        q_ptr=q,
        kv_cache_ptr=kv_cache,
        block_tables_ptr=block_tables,
        query_start_loc_ptr=query_start_loc,
        seq_lens_ptr=seq_lens,
        window=window,
        qk_scale=float(scale) * LOG2E * float(k_scale),
        v_scale=float(v_scale),
        stride_qt=q.stride(0),
        stride_qh=q.stride(1),
        stride_qd=q.stride(2),
        stride_ot=out.stride(0),
        stride_oh=out.stride(1),
        stride_od=out.stride(2),
        **cache_strides(kv_cache),
        stride_btb=block_tables.stride(0),
        QUERY_GROUP=group,
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_dim_pad(head_dim),
        BLOCK_M=block_m,
        BLOCK_SIZE=block_size,
        BLOCK_N=key_tile(block_n),
        UPCAST=upcast_for(kv_cache, q),
        FP8_CACHE=kv_cache.dtype == FP8_DTYPE,
        num_warps=8 if block_m >= 128 and not upcast_for(kv_cache, q) else 4,
    )
    return out
