"""Pieces shared by the paged-attention kernels: the loop over a range of keys (online
softmax, K/V tiles gathered through the block table) and the launch-parameter helpers of the
Python wrappers."""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
FP8_DTYPE = torch.float8_e4m3fn
"""The fp8 KV-cache dtype (Triton's float8e4nv): values stored as value / scale."""
FP8_MAX = 448.0
"""Largest finite float8_e4m3fn; quantized values saturate to +-FP8_MAX."""


def interpreting() -> bool:
    """True when Triton runs kernels on the CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "yes", "on")


def upcast_for(kv_cache: torch.Tensor, q: torch.Tensor | None = None) -> bool:
    """Whether the kernels cast loaded Q/K/V to fp32 (and use exact fp32 dots) instead of
    feeding 16-bit values to the tensor cores. Always under the interpreter, which stores bf16
    as raw uint16 and computes bf16 arithmetic wrongly; for an fp32 cache; and for an fp8 cache
    read by fp32 queries (an fp8 cache with 16-bit queries computes in the queries' dtype)."""
    if interpreting() or kv_cache.dtype == torch.float32:
        return True
    return kv_cache.dtype == FP8_DTYPE and (q is None or q.dtype == torch.float32)


def check_scales(kv_cache: torch.Tensor, k_scale: float, v_scale: float) -> None:
    """Scales only mean something for an fp8 cache; elsewhere they must stay 1.0."""
    assert k_scale > 0 and v_scale > 0, f"scales must be positive, got {k_scale}, {v_scale}"
    if kv_cache.dtype != FP8_DTYPE:
        assert k_scale == 1.0 and v_scale == 1.0, (
            f"k_scale/v_scale apply to a float8_e4m3fn cache only, not {kv_cache.dtype}"
        )


def head_dim_pad(head_dim: int) -> int:
    """Tile width for the head dim: a power of two, at least 16 (tl.dot's minimum)."""
    return max(16, triton.next_power_of_2(head_dim))


def key_tile(block_n: int | None) -> int:
    """Keys per inner-loop tile: a power of two >= 16 (tl.dot's minimum); 64 by default."""
    block_n = 64 if block_n is None else block_n
    assert block_n >= 16 and block_n & (block_n - 1) == 0, (
        f"block_n must be a power of two >= 16, got {block_n}"
    )
    return block_n


@functools.cache
def multiprocessor_count(device: torch.device) -> int:
    """SMs of a CUDA device. Elsewhere (the interpreter on the CPU) a small stand-in, so that
    the automatic split count splits there too and the tests exercise that path."""
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


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
        f"block_size must be a power of two >= 16, got {block_size}"
    )
    return block_size, kv_cache.shape[3], kv_cache.shape[4]


@triton.jit
def _attend_tiles(
    acc,  # [M, HEAD_DIM_PAD] fp32: running sum of p @ V
    m_i,  # [M] fp32: running max of the (log2-scaled) scores
    l_i,  # [M] fp32: running sum of exp2(score - m_i)
    q,  # [M, HEAD_DIM_PAD]: query rows, in the dtype the dots take (fp32 if UPCAST)
    q_pos,  # [M] int: position of each query row; it sees keys at positions <= it
    q_lo,  # [M] int: each row sees keys at positions > it (its window's edge; -1: no window)
    kv_head_ptr,  # [num_blocks, 2, BLOCK_SIZE, Hkv, D] cache, advanced to this KV head
    block_table_ptr,  # [max_blocks] this request's block table row (int32/int64)
    kv_start,  # first key position of the range (any position: a tile may start mid-block)
    kv_end,  # keys at positions >= kv_end are not visited
    qk_scale,  # softmax scale * log2(e) * k_scale
    stride_cb,  # cache stride between blocks
    stride_ckv,  # cache stride between K (0) and V (1)
    stride_cs,  # cache stride between slots of a block
    stride_cd,  # cache stride along head_dim
    BLOCK_SIZE: tl.constexpr,  # tokens per KV block
    BLOCK_N: tl.constexpr,  # keys per tile (may span several blocks, or part of one)
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    UPCAST: tl.constexpr,  # cast K/V to fp32 after load and use exact fp32 dots
    MASKED: tl.constexpr,  # False: every tile is whole and every row sees every key in it
):
    """Fold the keys kv_start .. kv_end-1 into the online-softmax state, BLOCK_N keys a
    tile, each key's slot found through the block table."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    d_mask = offs_d[None, :] < HEAD_DIM
    for start in range(kv_start, kv_end, BLOCK_N):
        k_pos = start + offs_n  # [BLOCK_N] key positions
        if MASKED:
            in_range = k_pos < kv_end
            block_id = tl.load(block_table_ptr + k_pos // BLOCK_SIZE, mask=in_range, other=0)
            # Slots past kv_end may hold stale or uninitialised data (maybe NaN, and
            # 0 * NaN = NaN in p @ V): load zeros there instead.
            kv_mask = d_mask & in_range[:, None]
        else:
            block_id = tl.load(block_table_ptr + k_pos // BLOCK_SIZE)
            kv_mask = d_mask
        offs = (
            block_id.to(tl.int64)[:, None] * stride_cb
            + (k_pos % BLOCK_SIZE)[:, None] * stride_cs
            + offs_d[None, :] * stride_cd
        )  # [BLOCK_N, HEAD_DIM_PAD]
        k = tl.load(kv_head_ptr + offs, mask=kv_mask, other=0.0).to(q.dtype)
        v = tl.load(kv_head_ptr + stride_ckv + offs, mask=kv_mask, other=0.0).to(q.dtype)
        if UPCAST:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")  # [M, BLOCK_N]
        else:
            s = tl.dot(q, tl.trans(k))
        s = s * qk_scale
        if MASKED:
            visible = in_range[None, :] & (k_pos[None, :] <= q_pos[:, None])
            visible = visible & (k_pos[None, :] > q_lo[:, None])
            s = tl.where(visible, s, float("-inf"))
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


@triton.jit
def attend_kv_range(
    acc,  # [M, HEAD_DIM_PAD] fp32: running sum of p @ V
    m_i,  # [M] fp32: running max of the (log2-scaled) scores
    l_i,  # [M] fp32: running sum of exp2(score - m_i)
    q,  # [M, HEAD_DIM_PAD]: query rows, in the dtype the dots take
    q_pos,  # [M] int: position of each query row; it sees keys at positions <= it
    first_q_pos,  # the smallest position of a valid row: keys <= it are seen by every row
    last_q_pos,  # the largest position of a valid row (its window starts last)
    kv_head_ptr,  # [num_blocks, 2, BLOCK_SIZE, Hkv, D] cache, advanced to this KV head
    block_table_ptr,  # [max_blocks] this request's block table row (int32/int64)
    kv_start,  # first key position of the range (>= the first row's window start)
    kv_end,  # end of the range (exclusive), <= the request's seq_len
    window,  # sliding window: the row at p sees keys in (p - window, p]; 0: no window
    qk_scale,  # softmax scale * log2(e) * k_scale
    stride_cb,
    stride_ckv,
    stride_cs,
    stride_cd,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """Fold keys kv_start .. kv_end-1 into (acc, m_i, l_i) and return them, in three stretches:
    [kv_start, shared_start) masked, where the rows' windows begin (empty without a window,
    and for a decode, whose caller starts at its one row's window); [shared_start, full_end)
    the whole tiles every row sees in full, without masks; [full_end, kv_end) masked (the
    causal diagonal, the range's ragged end). Keys past the last row's position are the
    caller's to cut."""
    # Every valid row sees keys in [last_q_pos - window + 1, first_q_pos].
    q_lo = tl.where(window > 0, q_pos - window, -1)  # [M]: each row sees keys > q_lo
    shared_start = tl.where(window > 0, tl.maximum(kv_start, last_q_pos - window + 1), kv_start)
    shared_start = tl.minimum(shared_start, kv_end)
    full_end = tl.minimum(first_q_pos + 1, kv_end)
    full_end = shared_start + tl.maximum(full_end - shared_start, 0) // BLOCK_N * BLOCK_N
    acc, m_i, l_i = _attend_tiles(
        acc, m_i, l_i, q, q_pos, q_lo, kv_head_ptr, block_table_ptr, kv_start, shared_start,
        qk_scale, stride_cb, stride_ckv, stride_cs, stride_cd,
        BLOCK_SIZE=BLOCK_SIZE, BLOCK_N=BLOCK_N, HEAD_DIM=HEAD_DIM, HEAD_DIM_PAD=HEAD_DIM_PAD,
        UPCAST=UPCAST, MASKED=True,
    )  # fmt: skip
    acc, m_i, l_i = _attend_tiles(
        acc, m_i, l_i, q, q_pos, q_lo, kv_head_ptr, block_table_ptr, shared_start, full_end,
        qk_scale, stride_cb, stride_ckv, stride_cs, stride_cd,
        BLOCK_SIZE=BLOCK_SIZE, BLOCK_N=BLOCK_N, HEAD_DIM=HEAD_DIM, HEAD_DIM_PAD=HEAD_DIM_PAD,
        UPCAST=UPCAST, MASKED=False,
    )  # fmt: skip
    acc, m_i, l_i = _attend_tiles(
        acc, m_i, l_i, q, q_pos, q_lo, kv_head_ptr, block_table_ptr, full_end, kv_end, qk_scale,
        stride_cb, stride_ckv, stride_cs, stride_cd,
        BLOCK_SIZE=BLOCK_SIZE, BLOCK_N=BLOCK_N, HEAD_DIM=HEAD_DIM, HEAD_DIM_PAD=HEAD_DIM_PAD,
        UPCAST=UPCAST, MASKED=True,
    )  # fmt: skip
    return acc, m_i, l_i


@triton.jit
def query_in_dot_dtype(
    q,  # [M, HEAD_DIM_PAD] as loaded
    kv_cache_ptr,  # the cache pointer (its element type)
    UPCAST: tl.constexpr,
    FP8_CACHE: tl.constexpr,
):
    """The query tile in the dtype of the dots: fp32 if UPCAST; the query's own 16-bit dtype
    over an fp8 cache (K/V are cast to it, exactly); else the cache's dtype."""
    if UPCAST:
        q = q.to(tl.float32)
    elif not FP8_CACHE:
        q = q.to(kv_cache_ptr.dtype.element_ty)
    return q
