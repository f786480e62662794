"""Triton kernel: write this step's K/V into the paged cache at their slots (quantized to
float8_e4m3fn, value / scale, when the cache is fp8)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.kernels._paged_common import FP8_DTYPE, FP8_MAX, cache_strides, check_scales

_FP8_MAX = tl.constexpr(FP8_MAX)  # the kernels read globals only as constexpr


@triton.jit
def _quantize_fp8(
    x,  # any shape, any float dtype
    scale,  # fp32 scale: the stored value is x / scale
):
    """x / scale, saturated to +-FP8_MAX and rounded half-to-even onto the float8_e4m3fn grid,
    still in fp32, so that the cast which follows is exact. (Triton's interpreter casts fp32 to
    fp8 without carrying a round-up into the exponent: 31.2 became 16, not 32.)"""
    y = tl.math.div_rn(x.to(tl.float32), scale)
    y = tl.minimum(tl.maximum(y, -_FP8_MAX), _FP8_MAX)
    a = tl.abs(y)
    # Normals (a >= 2^-6): keep 3 of fp32's 23 mantissa bits, rounding half to even on the
    # 20 dropped ones; a carry runs on into the exponent, as it should.
    bits = a.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -0x100000
    normal = bits.to(tl.float32, bitcast=True)
    # Subnormals (a < 2^-6) are multiples of 2^-9: the ulp of 1.5 * 2^14, so adding and
    # subtracting that rounds to them (half to even, by the fp32 adder).
    subnormal = (a + 24576.0) - 24576.0
    r = tl.where(a < 0.015625, subnormal, normal)
    sign = y.to(tl.int32, bitcast=True) & -0x80000000  # kept for -0.0 too
    return (r.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def _store_tile(
    src_ptr,  # [Hkv, D] one token's K (or V), already advanced to that token
    dst_ptr,  # [Hkv, D] the cache slot, already advanced to block, K/V index and offset
    offs_h,  # [HKV_PAD] head indices
    offs_d,  # [D_PAD] head_dim indices
    mask,  # [HKV_PAD, D_PAD] in-bounds
    stride_sh,
    stride_sd,  # source strides (heads, head_dim)
    stride_ch,
    stride_cd,  # cache strides (heads, head_dim)
    scale,  # fp8 cache: the stored value is x / scale
    QUANTIZE_FP8: tl.constexpr,  # the cache is float8_e4m3fn
):
    x = tl.load(src_ptr + offs_h[:, None] * stride_sh + offs_d[None, :] * stride_sd, mask=mask)
    if QUANTIZE_FP8:
        x = _quantize_fp8(x, scale)
    tl.store(
        dst_ptr + offs_h[:, None] * stride_ch + offs_d[None, :] * stride_cd,
        x.to(dst_ptr.dtype.element_ty),
        mask=mask,
    )


@triton.jit
def _reshape_and_cache_kernel(
    k_ptr,  # [T, Hkv, D]
    v_ptr,  # [T, Hkv, D]
    kv_cache_ptr,  # [num_blocks, 2, BLOCK_SIZE, Hkv, D]
    slot_mapping_ptr,  # [T] int32/int64; slot < 0 = padding token, not stored
    k_scale,  # fp8 cache: K is stored as k / k_scale
    v_scale,
    stride_kt,
    stride_kh,
    stride_kd,
    stride_vt,
    stride_vh,
    stride_vd,
    stride_cb,
    stride_ckv,
    stride_cs,
    stride_ch,
    stride_cd,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HKV_PAD: tl.constexpr,  # NUM_KV_HEADS rounded up to a power of two
    HEAD_DIM_PAD: tl.constexpr,  # HEAD_DIM rounded up to a power of two
    BLOCK_SIZE: tl.constexpr,
    QUANTIZE_FP8: tl.constexpr,  # the cache is float8_e4m3fn: scale, saturate, round
):
    # grid = (T,): one program per token, moving its whole [Hkv, D] K and V.
    t = tl.program_id(0).to(tl.int64)  # int64 so the offsets below cannot overflow
    slot = tl.load(slot_mapping_ptr + t).to(tl.int64)
    if slot < 0:  # padding token
        return
    block_id = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    offs_h = tl.arange(0, HKV_PAD)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    mask = (offs_h[:, None] < NUM_KV_HEADS) & (offs_d[None, :] < HEAD_DIM)
    dst = kv_cache_ptr + block_id * stride_cb + offset * stride_cs
    _store_tile(
        k_ptr + t * stride_kt, dst, offs_h, offs_d, mask, stride_kh, stride_kd,
        stride_ch, stride_cd, k_scale, QUANTIZE_FP8=QUANTIZE_FP8,
    )  # fmt: skip
    _store_tile(
        v_ptr + t * stride_vt, dst + stride_ckv, offs_h, offs_d, mask, stride_vh, stride_vd,
        stride_ch, stride_cd, v_scale, QUANTIZE_FP8=QUANTIZE_FP8,
    )  # fmt: skip


def reshape_and_cache(
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, Hkv, D], written in place
    slot_mapping: torch.Tensor,  # [T] int32/int64; < 0 skipped
    k_scale: float = 1.0,  # fp8 cache: K is stored as k / k_scale (must be 1.0 otherwise)
    v_scale: float = 1.0,  # fp8 cache: V is stored as v / v_scale
) -> None:
    """Store each token's K and V at its slot of the cache (same contract as
    ``pdserve_kernels.reference.reshape_and_cache_ref``)."""
    check_scales(kv_cache, k_scale, v_scale)
    num_tokens, num_kv_heads, head_dim = k.shape
    assert v.shape == k.shape and slot_mapping.shape == (num_tokens,)
    assert kv_cache.shape[1] == 2 and kv_cache.shape[3:] == (num_kv_heads, head_dim)
    if num_tokens == 0:
        return
    _reshape_and_cache_kernel[(num_tokens,)](
        k_ptr=k,
        v_ptr=v,
        kv_cache_ptr=kv_cache,
        slot_mapping_ptr=slot_mapping,
        k_scale=float(k_scale),
        v_scale=float(v_scale),
        stride_kt=k.stride(0),
        stride_kh=k.stride(1),
        stride_kd=k.stride(2),
        stride_vt=v.stride(0),
        stride_vh=v.stride(1),
        stride_vd=v.stride(2),
        **cache_strides(kv_cache),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        HKV_PAD=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM_PAD=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=kv_cache.shape[2],
        QUANTIZE_FP8=kv_cache.dtype == FP8_DTYPE,
    )
