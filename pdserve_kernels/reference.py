"""Pure-torch references for the Triton kernels in this package.

Written for clarity, not speed: one request at a time, softmax in fp32. The kernel tests
compare every kernel against these, and test these against a dense (unpaged) causal
attention, so a wrong reference cannot hide a wrong kernel.

KV cache layout (see ``engine/attention.py``): ``[num_blocks, 2, block_size, Hkv, D]``,
index 0 = K, 1 = V; block 0 is the null block; slot = block_id * block_size + offset.

fp8 cache (``torch.float8_e4m3fn``): K is stored as k / k_scale saturated to +-448 (V
likewise with v_scale) and read back as stored * k_scale. Other caches take scales of 1.0.
"""

from __future__ import annotations

import torch

FP8_MAX = 448.0  # largest finite float8_e4m3fn


def quantize(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """x as stored in a cache of dtype: x / scale saturated and cast to fp8, else a cast."""
    if dtype == torch.float8_e4m3fn:
        return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(dtype)
    assert scale == 1.0, f"a scale applies to a float8_e4m3fn cache only, not {dtype}"
    return x.to(dtype)


def reshape_and_cache_ref(
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, Hkv, D], written in place
    slot_mapping: torch.Tensor,  # [T] int: slot of each token; < 0 = padding, skipped
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Store each token's K and V at its slot of the cache (quantized if it is fp8)."""
    block_size = kv_cache.shape[2]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    blocks, offsets = slots // block_size, slots % block_size
    kv_cache[blocks, 0, offsets] = quantize(k[keep], k_scale, kv_cache.dtype)
    kv_cache[blocks, 1, offsets] = quantize(v[keep], v_scale, kv_cache.dtype)


def _gather(
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_len: int,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
):
    """K and V ([seq_len, Hkv, D]) of one request's first seq_len cached positions, in fp32
    (dequantized: stored * scale)."""
    block_size = kv_cache.shape[2]
    nb = -(-seq_len // block_size)
    kv = kv_cache[block_table[:nb].long()]  # [nb, 2, bs, Hkv, D]
    k = kv[:, 0].reshape(nb * block_size, *kv.shape[-2:])[:seq_len]
    v = kv[:, 1].reshape(nb * block_size, *kv.shape[-2:])[:seq_len]
    return k.float() * k_scale, v.float() * v_scale


def _attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_pos: torch.Tensor,
    scale: float,
    window: int | None = None,
):
    """q [Tq, Hq, D] at positions q_pos [Tq] over k, v [L, Hkv, D] at positions 0..L-1,
    causal (key position <= query position; with a window, also > query position - window),
    GQA by repeating KV heads. fp32 math."""
    hq, hkv = q.shape[1], k.shape[1]
    group = hq // hkv
    qf = q.float().transpose(0, 1)  # [Hq, Tq, D]
    kf = k.float().repeat_interleave(group, dim=1).transpose(0, 1)  # [Hq, L, D]
    vf = v.float().repeat_interleave(group, dim=1).transpose(0, 1)
    scores = (qf @ kf.transpose(1, 2)) * scale  # [Hq, Tq, L]
    k_pos = torch.arange(k.shape[0], device=q.device)
    q_pos = q_pos[:, None].to(q.device)
    visible = k_pos[None, :] <= q_pos  # [Tq, L]
    if window:
        visible &= k_pos[None, :] > q_pos - window
    scores = scores.masked_fill(~visible, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return (probs @ vf).transpose(0, 1).to(q.dtype)  # [Tq, Hq, D]


def paged_decode_attention_ref(
    q: torch.Tensor,  # [B, Hq, D]: one query token per request
    kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, Hkv, D]
    block_tables: torch.Tensor,  # [B, max_blocks] int32/int64, padded with 0
    seq_lens: torch.Tensor,  # [B]: context length including the query token
    scale: float,
    *,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    window: int | None = None,
) -> torch.Tensor:  # [B, Hq, D]
    """Each request's query (at position seq_len - 1) over its seq_len cached tokens (with a
    sliding window, over the last window of them; None/0: all)."""
    out = torch.zeros_like(q)
    for b in range(q.shape[0]):
        seq_len = int(seq_lens[b])
        if seq_len == 0:
            continue
        k, v = _gather(kv_cache, block_tables[b], seq_len, k_scale, v_scale)
        q_pos = torch.tensor([seq_len - 1])
        out[b] = _attend(q[b : b + 1], k, v, q_pos, scale, window)[0]
    return out


def paged_prefill_attention_ref(
    q: torch.Tensor,  # [T, Hq, D]: the query tokens of all requests, flattened
    kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, Hkv, D]
    block_tables: torch.Tensor,  # [B, max_blocks] int32/int64, padded with 0
    query_start_loc: torch.Tensor,  # [B + 1]: request b's queries are q[qsl[b]:qsl[b+1]]
    seq_lens: torch.Tensor,  # [B]: context length including this step's tokens
    scale: float,
    *,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    window: int | None = None,
) -> torch.Tensor:  # [T, Hq, D]
    """Causal attention over the paged context: query i of a request with query_len ql and
    seq_len L sits at position L - ql + i and sees the keys at positions <= it (with a
    sliding window, those in (position - window, position]; None/0: no window). Covers
    prefill chunks after a cached prefix and speculative verification."""
    out = torch.zeros_like(q)
    for b in range(block_tables.shape[0]):
        start, end = int(query_start_loc[b]), int(query_start_loc[b + 1])
        seq_len, ql = int(seq_lens[b]), end - start
        if ql == 0:
            continue
        k, v = _gather(kv_cache, block_tables[b], seq_len, k_scale, v_scale)
        q_pos = torch.arange(seq_len - ql, seq_len)
        out[start:end] = _attend(q[start:end], k, v, q_pos, scale, window)
    return out
