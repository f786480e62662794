"""Triton paged-attention decode: one query token per request over its paged KV cache.

Split-K (flash-decoding): each request's context is cut into ``num_splits`` partitions of
whole KV blocks (with a sliding window: of the blocks the window touches, the first partition
starting at the window's first key, mid-block or not); one program per (request, KV head,
partition) attends the partition with all the query heads of that KV head at once (GQA: each
K/V tile is loaded once per KV head) and writes an unnormalised partial result; a second
kernel merges the partitions (log-sum-exp). With one partition the first kernel writes the
output itself and the merge is skipped.
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
    multiprocessor_count,
    query_in_dot_dtype,
    upcast_for,
)

PROGRAMS_PER_SM = 2
"""Programs the automatic split count aims for per SM: more than one hides memory latency."""
MIN_KEYS_PER_SPLIT = 128
"""The automatic split count leaves each partition at least this many keys (else the merge
and the per-program setup outweigh the parallelism won)."""
MAX_SPLITS = 64


@triton.jit
def _paged_decode_kernel(
    out_ptr,  # [B, Hq, D]: written when not SPLIT
    part_acc_ptr,  # [B, Hq, num_splits, HEAD_DIM_PAD] fp32, contiguous: unnormalised p @ V
    part_ml_ptr,  # [B, Hq, num_splits, 2] fp32, contiguous: running max (log2 domain), sum
    q_ptr,  # [B, Hq, D]
    kv_cache_ptr,  # [num_blocks, 2, BLOCK_SIZE, Hkv, D]
    block_tables_ptr,  # [B, max_blocks] int32/int64, padded with the null block 0
    seq_lens_ptr,  # [B] int32/int64: context length including the query token
    num_splits,  # partitions per request (the grid's third dim)
    window,  # sliding window: keys from seq_len - window on; 0: the whole context
    num_q_heads,
    qk_scale,  # softmax scale * log2(e) * k_scale
    v_scale,  # dequantization scale of V (1.0 unless the cache is fp8)
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
    BLOCK_N: tl.constexpr,  # keys per inner-loop tile
    SPLIT: tl.constexpr,  # write partials for the merge kernel instead of the output
    UPCAST: tl.constexpr,  # compute in fp32 (interpreter, fp32 cache)
    FP8_CACHE: tl.constexpr,  # the cache is float8_e4m3fn
):
    # grid = (B, Hkv, num_splits): one program per (request, KV head, partition). The
    # QUERY_GROUP query heads that share this KV head are the rows of one tile.
    b = tl.program_id(0).to(tl.int64)  # int64 so stride products cannot overflow
    kvh = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b).to(tl.int32)
    # The query sees keys [window_start, seq_len). Partition `split` holds blocks
    # [first_block + split * per_split, first_block + (split + 1) * per_split) of the
    # request's blocks from the window's first on (short requests leave their last partitions
    # empty); the first partition starts at window_start itself: no key before it is read.
    window_start = tl.where(window > 0, tl.maximum(seq_len - window, 0), 0)
    first_block = window_start // BLOCK_SIZE
    per_split = tl.cdiv(tl.cdiv(seq_len, BLOCK_SIZE) - first_block, num_splits)
    block_start = (first_block + split * per_split) * BLOCK_SIZE
    kv_start = tl.maximum(tl.minimum(block_start, seq_len), window_start)
    kv_end = tl.minimum(block_start + per_split * BLOCK_SIZE, seq_len)

    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    heads = kvh * QUERY_GROUP + offs_g  # [GROUP_PAD] query heads of this program
    row_mask = offs_g < QUERY_GROUP
    mask = row_mask[:, None] & (offs_d[None, :] < HEAD_DIM)
    q = tl.load(
        q_ptr + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :] * stride_qd,
        mask=mask,
        other=0.0,
    )
    q = query_in_dot_dtype(q, kv_cache_ptr, UPCAST=UPCAST, FP8_CACHE=FP8_CACHE)
    # Every row is the request's newest token, at position seq_len - 1: it sees every key of
    # [kv_start, kv_end).
    q_pos = tl.zeros([GROUP_PAD], dtype=tl.int32) + (seq_len - 1)

    acc = tl.zeros([GROUP_PAD, HEAD_DIM_PAD], dtype=tl.float32)
    m_i = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([GROUP_PAD], dtype=tl.float32)
    acc, m_i, l_i = attend_kv_range(
        acc, m_i, l_i, q, q_pos, seq_len - 1, seq_len - 1,
        kv_cache_ptr + kvh * stride_ch, block_tables_ptr + b * stride_btb, kv_start, kv_end,
        window, qk_scale, stride_cb, stride_ckv, stride_cs, stride_cd,
        BLOCK_SIZE=BLOCK_SIZE, BLOCK_N=BLOCK_N, HEAD_DIM=HEAD_DIM, HEAD_DIM_PAD=HEAD_DIM_PAD,
        UPCAST=UPCAST,
    )  # fmt: skip
    if SPLIT:
        row = (b * num_q_heads + heads) * num_splits + split  # [GROUP_PAD] (b, head, split)
        acc_ptrs = part_acc_ptr + row[:, None] * HEAD_DIM_PAD + offs_d[None, :]
        tl.store(acc_ptrs, acc, mask=row_mask[:, None])
        tl.store(part_ml_ptr + row * 2, m_i, mask=row_mask)
        tl.store(part_ml_ptr + row * 2 + 1, l_i, mask=row_mask)
    else:
        l_i = tl.where(l_i == 0.0, 1.0, l_i)  # seq_len 0 (padding request): output zeros
        out = acc * (v_scale / l_i)[:, None]
        tl.store(
            out_ptr + b * stride_ob + heads[:, None] * stride_oh + offs_d[None, :] * stride_od,
            out.to(out_ptr.dtype.element_ty),
            mask=mask,
        )


@triton.jit
def _merge_splits_kernel(
    out_ptr,  # [B, Hq, D]
    part_acc_ptr,  # [B, Hq, num_splits, HEAD_DIM_PAD] fp32, contiguous
    part_ml_ptr,  # [B, Hq, num_splits, 2] fp32, contiguous: (max, sum) per split
    num_splits,
    v_scale,  # dequantization scale of V
    stride_ob,
    stride_oh,
    stride_od,
    num_q_heads,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    SPLITS_PAD: tl.constexpr,  # num_splits rounded up to a power of two
):
    # grid = (B, Hq): one program per (request, query head), merging its partitions.
    b = tl.program_id(0).to(tl.int64)  # int64 so stride products cannot overflow
    h = tl.program_id(1).to(tl.int64)
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    s_mask = offs_s < num_splits
    row = (b * num_q_heads + h) * num_splits + offs_s  # [SPLITS_PAD] (request, head, split)
    m_s = tl.load(part_ml_ptr + row * 2, mask=s_mask, other=float("-inf"))
    l_s = tl.load(part_ml_ptr + row * 2 + 1, mask=s_mask, other=0.0)
    acc_s = tl.load(
        part_acc_ptr + row[:, None] * HEAD_DIM_PAD + offs_d[None, :],
        mask=s_mask[:, None],
        other=0.0,
    )  # [SPLITS_PAD, HEAD_DIM_PAD]
    # Empty partitions have max -inf and weigh 0; a request with no key at all (seq_len 0)
    # has every max -inf: shift by 0 and output zeros.
    m = tl.max(m_s, 0)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(m_s - m)  # [SPLITS_PAD]
    l_sum = tl.sum(w * l_s, 0)
    l_sum = tl.where(l_sum == 0.0, 1.0, l_sum)
    out = tl.sum(acc_s * w[:, None], 0) * (v_scale / l_sum)  # [HEAD_DIM_PAD]
    tl.store(
        out_ptr + b * stride_ob + h * stride_oh + offs_d * stride_od,
        out.to(out_ptr.dtype.element_ty),
        mask=offs_d < HEAD_DIM,
    )


def auto_num_splits(
    batch: int,
    num_kv_heads: int,
    max_blocks: int,
    block_size: int,
    device: torch.device,
    window: int | None = None,
) -> int:
    """Partitions per request: 1 when (request, KV head) programs alone fill the device's SMs
    (PROGRAMS_PER_SM each); else enough to fill them, with at least MIN_KEYS_PER_SPLIT keys
    per partition of the longest possible context (max_blocks: the block table's width; with
    a sliding window, the most blocks a window touches). From shapes only: no device sync."""
    if window:
        max_blocks = min(max_blocks, triton.cdiv(window - 1, block_size) + 1)
    programs = batch * num_kv_heads
    target = PROGRAMS_PER_SM * multiprocessor_count(device)
    if programs >= target:
        return 1
    by_context = max_blocks * block_size // MIN_KEYS_PER_SPLIT
    return max(1, min(triton.cdiv(target, programs), by_context, MAX_SPLITS))


def paged_decode_attention(
    q: torch.Tensor,  # [B, Hq, D]: one query token per request
    kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, Hkv, D]
    block_tables: torch.Tensor,  # [B, max_blocks] int32/int64, padded with 0
    seq_lens: torch.Tensor,  # [B]: context length including the query token
    scale: float,
    *,
    out: torch.Tensor | None = None,  # [B, Hq, D] to write into (e.g. a slice of a batch)
    k_scale: float = 1.0,  # fp8 cache: K = stored * k_scale (must be 1.0 otherwise)
    v_scale: float = 1.0,  # fp8 cache: V = stored * v_scale
    num_splits: int | None = None,  # partitions per request; None: auto_num_splits
    block_n: int | None = None,  # keys per inner-loop tile (power of two >= 16; None: 64)
    window: int | None = None,  # sliding window: keys from seq_len - window on (None/0: all)
) -> torch.Tensor:  # [B, Hq, D]
    """Same contract as ``pdserve_kernels.reference.paged_decode_attention_ref``."""
    block_size, num_kv_heads, head_dim = check_cache(kv_cache)
    check_scales(kv_cache, k_scale, v_scale)
    batch, num_q_heads, _ = q.shape
    assert q.shape[2] == head_dim and num_q_heads % num_kv_heads == 0
    assert block_tables.shape[0] == batch and seq_lens.shape == (batch,)
    if out is None:
        out = torch.empty_like(q)
    if batch == 0:
        return out
    window = window or 0
    assert window >= 0, f"window must be >= 0, got {window}"
    if num_splits is None:
        num_splits = auto_num_splits(
            batch, num_kv_heads, block_tables.shape[1], block_size, q.device, window
        )
    assert num_splits >= 1, f"num_splits must be >= 1, got {num_splits}"
    group = num_q_heads // num_kv_heads
    d_pad = head_dim_pad(head_dim)
    split = num_splits > 1
    # [B, Hq, S, D_PAD] and [B, Hq, S, 2]; a 1-element stand-in when not split (never read)
    part_shape = (batch, num_q_heads, num_splits) if split else (1, 1, 1)
    part_acc = torch.empty(*part_shape, d_pad, dtype=torch.float32, device=q.device)
    part_ml = torch.empty(*part_shape, 2, dtype=torch.float32, device=q.device)
    _paged_decode_kernel[(batch, num_kv_heads, num_splits)](
        out_ptr=out,
        part_acc_ptr=part_acc,
        part_ml_ptr=part_ml,
        q_ptr=q,
        kv_cache_ptr=kv_cache,
        block_tables_ptr=block_tables,
        seq_lens_ptr=seq_lens,
        num_splits=num_splits,
        window=window,
        num_q_heads=num_q_heads,
        qk_scale=float(scale) * LOG2E * float(k_scale),
        v_scale=float(v_scale),
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
        HEAD_DIM_PAD=d_pad,
        BLOCK_SIZE=block_size,
        BLOCK_N=key_tile(block_n),
        SPLIT=split,
        UPCAST=upcast_for(kv_cache, q),
        FP8_CACHE=kv_cache.dtype == FP8_DTYPE,
    )
    if split:
        _merge_splits_kernel[(batch, num_q_heads)](
            out_ptr=out,
            part_acc_ptr=part_acc,
            part_ml_ptr=part_ml,
            num_splits=num_splits,
            v_scale=float(v_scale),
            stride_ob=out.stride(0),
            stride_oh=out.stride(1),
            stride_od=out.stride(2),
            num_q_heads=num_q_heads,
            HEAD_DIM=head_dim,
            HEAD_DIM_PAD=d_pad,
            SPLITS_PAD=triton.next_power_of_2(num_splits),
        )
    return out
