"""Attention over the paged KV cache.

KV cache layout, everywhere (model runner, wire format): one tensor per layer of shape
``[num_blocks, 2, num_kv_heads, block_size, head_dim]`` (index 0 = K, 1 = V), head-major inside
a block so that gathering a request's blocks yields ``[kv_heads, tokens, head_dim]`` directly
(one index_select, no transposing copy: the CPU decode path is bound by these copies). Block 0
is the null block: it pads block tables and is never allocated to a request. A *slot* is
``block_id * block_size + offset``. The Triton kernels take the same memory through the
stride view ``kv_cache.transpose(2, 3)`` (``[num_blocks, 2, block_size, kv_heads, head_dim]``).

The batch is flattened: tokens of all requests in one ``[num_tokens, ...]`` tensor, decodes
(one query token each) first, then the multi-token requests (prefill chunks, speculative
verification). CPU path with the compiled kernels (CpuAttention): one decode kernel
call for the decodes, one prefill kernel call for every multi-token request (both read K/V
straight out of the paged cache). Pure-torch path (the reference, and the fallback without a
compiler): decodes batched into grouped matmuls over the padded contexts, each multi-token
request one scaled_dot_product_attention of its own.

Sliding-window layers (Gemma 3's local layers; ``window`` of ``paged_attention``): the query at
position p attends to keys in (p - window, p], as transformers masks them. The cache keeps every
position for every layer (one tensor over all layers, the same blocks for each); the window is
applied when attending: the decode kernel starts each request's keys at seq_len - window, the
torch decode path adds a windowed bias, the torch prefill path a windowed mask (and gathers no
block before the first query's window), the prefill kernel reads no K/V tile before a query
tile's window. With window None nothing of this runs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from types import ModuleType
from typing import NamedTuple

import torch
import torch.nn.functional as F


class PrefillBatch(NamedTuple):
    """The multi-token requests of a step as the prefill kernel takes them."""

    query_start: torch.Tensor
    """[num_seqs] int64: each request's first query row in the flattened batch."""
    query_len: torch.Tensor
    """[num_seqs] int64."""
    context_len: torch.Tensor
    """[num_seqs] int64."""
    block_tables: torch.Tensor
    """[num_seqs, max_blocks] int64, padded with the null block 0."""


@dataclass
class PrefillSeq:
    """One multi-token request in the flattened batch."""

    query_start: int
    """Index of its first query token in the flattened batch."""
    query_len: int
    """Tokens computed this step."""
    context_len: int
    """Tokens in the cache once this step's are written (computed before + query_len)."""
    block_table: torch.Tensor
    """[ceil(context_len / block_size)] int64 block ids."""


@dataclass
class AttentionMetadata:
    """Where each token's K/V goes and what each query attends to, for one step."""

    slot_mapping: torch.Tensor
    """[num_tokens] int64: cache slot each new token's K/V is written to."""
    num_decode_tokens: int
    """The first num_decode_tokens tokens are single-token decodes, one per request."""
    decode_block_tables: torch.Tensor
    """[num_decode_tokens, max_blocks] int64, padded with the null block 0."""
    decode_seq_lens: torch.Tensor
    """[num_decode_tokens] int64: context length including the new token."""
    decode_mask: torch.Tensor | None
    """[num_decode_tokens, 1, 1, max_blocks * block_size] bool: key positions each decode sees."""
    prefills: list[PrefillSeq]
    """The multi-token requests, in batch order after the decodes."""
    block_size: int
    backend: AttentionBackend = field(default_factory=lambda: TorchAttention())
    """How the layers attend (the runner's choice; pure torch by default)."""

    # Derived once per step and shared by every layer.

    @cached_property
    def prefill_batch(self) -> PrefillBatch:
        """The prefills as the CPU prefill kernel's arguments."""
        seqs = self.prefills
        tables = torch.zeros(len(seqs), max(len(s.block_table) for s in seqs), dtype=torch.long)
        for i, s in enumerate(seqs):
            tables[i, : len(s.block_table)] = s.block_table
        return PrefillBatch(
            torch.tensor([s.query_start for s in seqs], dtype=torch.long),
            torch.tensor([s.query_len for s in seqs], dtype=torch.long),
            torch.tensor([s.context_len for s in seqs], dtype=torch.long),
            tables,
        )

    def kv_rows(self, num_kv_heads: int) -> torch.Tensor:
        """Row ids of the new tokens' K (per head), computed once per step for every layer."""
        rows = self.__dict__.get("_kv_rows")
        if rows is None:
            bs = self.block_size
            blocks, offsets = self.slot_mapping // bs, self.slot_mapping % bs
            heads = torch.arange(num_kv_heads, device=self.slot_mapping.device)
            rows = ((blocks * 2 * num_kv_heads).unsqueeze(1) + heads) * bs + offsets.unsqueeze(1)
            rows = rows.reshape(-1)
            self.__dict__["_kv_rows"] = rows
        return rows

    @cached_property
    def decode_bias(self) -> torch.Tensor | None:
        """[num_decode_tokens, 1, 1, L] float32: 0 where a decode may attend, -inf elsewhere."""
        if self.decode_mask is None:
            return None
        return _bias(self.decode_mask)

    def decode_window_bias(self, window: int) -> torch.Tensor | None:
        """decode_bias of a sliding-window layer: each decode also blind to keys before
        seq_len - window. Computed once per step per window, shared by the layers."""
        if self.decode_mask is None:
            return None
        biases = self.__dict__.setdefault("_window_biases", {})
        if window not in biases:
            positions = torch.arange(self.decode_mask.shape[-1], device=self.decode_mask.device)
            in_window = positions >= (self.decode_seq_lens - window).unsqueeze(1)
            biases[window] = _bias(self.decode_mask & in_window[:, None, None, :])
        return biases[window]


def _bias(mask: torch.Tensor) -> torch.Tensor:
    """float32 additive attention bias: 0 where mask is True, -inf elsewhere."""
    bias = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
    return bias.masked_fill_(~mask, float("-inf"))


@dataclass(frozen=True)
class AttentionKernels:
    """The compiled CPU kernels paged_attention routes through (pdserve_kernels/cpu); None
    for any of them takes the pure-torch path. decode: paged_decode_attention_out(q [B, Hq,
    D], kv_cache, block_tables [B, nb] int64, seq_lens [B] int64, scale, out [B, Hq, D], window
    (0: none)); prefill: paged_prefill_attention_out(q [T, Hq, D], kv_cache, *PrefillBatch,
    scale, out, window); store: store_kv(k, v, kv_cache, slot_mapping)."""

    decode: Callable[..., torch.Tensor] | None = None
    prefill: Callable[..., None] | None = None
    store: Callable[..., None] | None = None

    @classmethod
    def of(cls, ops: ModuleType | None) -> AttentionKernels:
        """The kernels of a compiled module (cpu_ops()); none with None."""
        if ops is None:
            return cls()
        return cls(ops.paged_decode_attention_out, ops.paged_prefill_attention_out, ops.store_kv)


class AttentionBackend:
    """How a runner's layers attend over the paged cache, chosen once per runner
    (attention_backend()) and carried by every step's AttentionMetadata: no process-wide
    switch. Same contract as paged_attention. Pickles by name (tensor-parallel workers make
    their own)."""

    name = ""

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        window: int | None = None,
    ) -> torch.Tensor:
        raise NotImplementedError

    def __reduce__(self) -> tuple[Callable[[str], AttentionBackend], tuple[str]]:
        return attention_backend, (self.name,)

    def __repr__(self) -> str:
        return f"AttentionBackend({self.name!r})"


class TorchAttention(AttentionBackend):
    """The pure-torch reference (and the fallback without a compiler)."""

    name = "torch"

    def __call__(self, q, k, v, kv_cache, meta, scale, window=None):
        return paged_attention(q, k, v, kv_cache, meta, scale, window)


class CpuAttention(AttentionBackend):
    """The compiled CPU kernels: one decode call, one prefill call, the K/V store."""

    name = "cpu"

    def __init__(self, ops: ModuleType) -> None:
        self.kernels = AttentionKernels.of(ops)

    def __call__(self, q, k, v, kv_cache, meta, scale, window=None):
        return paged_attention(q, k, v, kv_cache, meta, scale, window, self.kernels)


class TritonAttention(AttentionBackend):
    """The Triton kernels of pdserve_kernels/ (engine/attention_triton.py): CUDA, or the CPU
    under TRITON_INTERPRET=1 (slow; fp32 only: the interpreter gets bf16 wrong). Sliding-window
    layers too: the kernels take the window."""

    name = "triton"

    def __call__(self, q, k, v, kv_cache, meta, scale, window=None):
        from pdserve.engine.attention_triton import triton_paged_attention

        return triton_paged_attention(q, k, v, kv_cache, meta, scale, window)


ATTENTION_BACKENDS = ("auto", "torch", "cpu", "triton")


def attention_backend(name: str = "auto", device: str = "cpu") -> AttentionBackend:
    """The backend called name; "auto": the CPU kernels on a CPU where they build (else
    torch), Triton on CUDA. ValueError naming why when the one asked for cannot run here."""
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got {name!r}")
    cuda = device.startswith("cuda")
    if name == "torch":
        return TorchAttention()
    if name == "triton" or (name == "auto" and cuda):
        from pdserve.kernels._paged_common import interpreting

        if not cuda and not interpreting():
            raise ValueError(
                "the triton attention backend needs CUDA, or TRITON_INTERPRET=1 on a CPU "
                "(set before triton is imported; slow, for tests)"
            )
        try:
            import triton  # noqa: F401
        except ImportError as e:
            raise ValueError(f"the triton attention backend needs triton: {e}") from None
        return TritonAttention()
    from pdserve.kernels.cpu import cpu_ops

    ops = cpu_ops()
    if ops is None:
        if name == "cpu":
            raise ValueError("the cpu attention backend's kernels do not build here")
        return TorchAttention()
    return CpuAttention(ops)


def write_kv(
    kv_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    meta: AttentionMetadata,
    kernels: AttentionKernels | None = None,
) -> None:
    """Store new tokens' K and V ([T, Hkv, D]) at their slots of one layer's cache (a float8
    cache: rounded to it, saturated at its largest finite value; scale 1.0)."""
    if kernels is not None and kernels.store is not None and not kv_cache.is_cuda:
        kernels.store(k, v, kv_cache, meta.slot_mapping)
        return
    _, _, hkv, bs, d = kv_cache.shape
    index = meta.kv_rows(hkv)
    if is_fp8(kv_cache):  # index_copy_ has no float8 kernel: move the bytes
        k, v = (
            to_fp8(k, kv_cache.dtype).view(torch.uint8),
            to_fp8(v, kv_cache.dtype).view(torch.uint8),
        )
        kv_cache = kv_cache.view(torch.uint8)
    rows = kv_cache.view(-1, d)
    rows.index_copy_(0, index, k.reshape(-1, d))
    rows.index_copy_(0, index + hkv * bs, v.reshape(-1, d))


def is_fp8(kv_cache: torch.Tensor) -> bool:
    """Whether kv_cache holds float8 values (CacheConfig.kv_cache_dtype fp8)."""
    return kv_cache.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)


def to_fp8(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x rounded to a float8 dtype, saturated at its largest finite value (a plain cast turns
    what is out of range into NaN)."""
    limit = torch.finfo(dtype).max
    return x.clamp(-limit, limit).to(dtype)


def gather_kv(
    kv_cache: torch.Tensor, block_table: torch.Tensor, dtype: torch.dtype | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of the blocks in block_table ([..., nb]) as [..., Hkv, nb * block_size, D], in
    dtype (a float8 cache's values widened to it; default: the cache's dtype)."""
    num_blocks, _, hkv, bs, d = kv_cache.shape
    fp8 = is_fp8(kv_cache)
    cache = kv_cache.view(torch.uint8) if fp8 else kv_cache  # index_select: no float8 kernel
    per_head = cache.view(num_blocks * 2 * hkv, bs * d)  # one row = one head of one block
    heads = torch.arange(hkv, device=block_table.device).unsqueeze(-1)  # [Hkv, 1]
    k_rows = block_table.unsqueeze(-2) * (2 * hkv) + heads  # [..., Hkv, nb]
    lead = block_table.shape[:-1]
    nb = block_table.shape[-1]
    keys = per_head.index_select(0, k_rows.reshape(-1)).view(*lead, hkv, nb * bs, d)
    values = per_head.index_select(0, (k_rows + hkv).reshape(-1)).view(*lead, hkv, nb * bs, d)
    if fp8:
        keys, values = keys.view(kv_cache.dtype), values.view(kv_cache.dtype)
    if dtype is not None and dtype != kv_cache.dtype:
        keys, values = keys.to(dtype), values.to(dtype)
    return keys, values


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    window: int | None = None,
    kernels: AttentionKernels | None = None,
) -> torch.Tensor:
    """Causal attention of q ([T, Hq, D]) over each request's cached context plus this step's
    k/v ([T, Hkv, D]), which are written into kv_cache first. Returns [T, Hq, D]. Rows past
    the step's tokens (len(meta.slot_mapping)) are padding (models/llama.py padded_rows):
    their K/V is not stored and their output is zero. window: a sliding-window layer's, the
    query at position p sees keys in (p - window, p] only (None: the whole context).
    kernels: the compiled CPU kernels to use (None, or any of them None: pure torch)."""
    num_tokens = meta.slot_mapping.shape[0]
    write_kv(kv_cache, k[:num_tokens], v[:num_tokens], meta, kernels)
    if is_fp8(kv_cache):  # attend to what the cache holds, fresh keys too (as vLLM reads them)
        k, v = to_fp8(k, kv_cache.dtype).to(k.dtype), to_fp8(v, kv_cache.dtype).to(v.dtype)
    out = torch.empty_like(q)
    if q.shape[0] > num_tokens:
        out[num_tokens:].zero_()
    nd = meta.num_decode_tokens
    decode = kernels.decode if kernels is not None and not q.is_cuda else None
    prefill = kernels.prefill if kernels is not None and not q.is_cuda else None
    if nd and decode is not None:
        # q[:nd] may be a row-strided view of the qkv projection: the kernel reads it in place
        # and writes straight into out's rows
        tables, lens = meta.decode_block_tables, meta.decode_seq_lens
        decode(q[:nd], kv_cache, tables, lens, scale, out[:nd], window or 0)
    elif nd:
        out[:nd] = _decode_attention(q[:nd], kv_cache, meta, scale, window)
    if meta.prefills and prefill is not None:
        # every multi-token request in one call, written straight into out's rows
        prefill(q, kv_cache, *meta.prefill_batch, scale, out, window or 0)
        return out
    for seq in meta.prefills:
        sl = slice(seq.query_start, seq.query_start + seq.query_len)
        out[sl] = _prefill_attention(q[sl], k[sl], v[sl], kv_cache, seq, scale, window)
    return out


def _decode_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """One query per request, batched: [B, Hq, D] over each request's padded context.
    Batched matmuls with the query heads of a KV head grouped (GQA without repeating K/V);
    softmax in fp32. For single-token queries this beats SDPA's CPU kernels several times."""
    keys, values = gather_kv(kv_cache, meta.decode_block_tables, q.dtype)  # [B, Hkv, L, D]
    b, hq, d = q.shape
    _, hkv, length, _ = keys.shape
    group = hq // hkv
    scores = torch.bmm(q.reshape(b * hkv, group, d), keys.view(b * hkv, length, d).transpose(1, 2))
    scores = scores.float().view(b, hkv, group, length) * scale
    bias = meta.decode_bias if window is None else meta.decode_window_bias(window)
    if bias is not None:
        scores += bias
    probs = torch.softmax(scores, dim=-1).to(values.dtype).view(b * hkv, group, length)
    return torch.bmm(probs, values.view(b * hkv, length, d)).view(b, hq, d)


_QUERY_ROWS_MULTIPLE = 32
"""Multi-token queries are padded to a multiple of this many rows before SDPA: torch's CPU
flash attention slows down up to ~3x on other lengths (bf16, 2 threads: 317 query rows
3.6 ms, 320 rows 1.3 ms; masked 317 x 717 keys 5.3 ms, 320 x 720 2.7 ms)."""


def _prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    seq: PrefillSeq,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """Causal attention of one request's query chunk (of a sliding-window layer's: see
    _window_keys). Inputs are made 4-D ([1, H, T, D]):
    on CPU only the batched form reaches SDPA's flash kernel (3-D falls back to the ~4x slower
    math path). Query rows (and, with no cached context, keys) are padded with zeros at the
    end to a multiple of _QUERY_ROWS_MULTIPLE: padded keys sit after every real query, so
    causality hides them, and padded queries' rows are dropped."""
    gqa = q.shape[1] != k.shape[1]
    tq = seq.query_len
    pad = -tq % _QUERY_ROWS_MULTIPLE if tq > _QUERY_ROWS_MULTIPLE and not q.is_cuda else 0
    queries = F.pad(q.transpose(0, 1), (0, 0, 0, pad)).unsqueeze(0)
    if window is not None and seq.context_len > window:  # else the window hides no key
        keys, values, mask = _window_keys(k, v, kv_cache, seq, window, pad)
    elif seq.context_len == tq:
        # Nothing cached before this chunk: attend to the fresh K/V, plain causal.
        keys = F.pad(k.transpose(0, 1), (0, 0, 0, pad))
        values = F.pad(v.transpose(0, 1), (0, 0, 0, pad))
        mask = None
    else:
        keys, values = gather_kv(kv_cache, seq.block_table, q.dtype)  # [Hkv, L, D]
        keys, values = keys[:, : seq.context_len], values[:, : seq.context_len]
        # Query i sits at position context_len - query_len + i and sees keys at positions <= it
        # (a padded query, past the last position, sees them all).
        start = seq.context_len - tq
        q_pos = torch.arange(start, start + tq + pad, device=q.device).unsqueeze(1)
        mask = torch.arange(seq.context_len, device=q.device).unsqueeze(0) <= q_pos  # [Tq+pad, L]
    out = F.scaled_dot_product_attention(
        queries,
        keys.unsqueeze(0),
        values.unsqueeze(0),
        attn_mask=mask,
        is_causal=mask is None,
        scale=scale,
        enable_gqa=gqa,
    )
    return out[0, :, :tq].transpose(0, 1)


def _window_keys(
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    seq: PrefillSeq,
    window: int,
    pad: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Keys and values ([Hkv, L, D]) and mask ([Tq + pad, L]) of a sliding-window layer's
    query chunk: the query at position p sees keys in (p - window, p]. With cached context only
    the blocks from the first query's window on are gathered. Padded queries take the last
    query's position (a row with every key masked would be NaN); their rows are dropped."""
    tq, context_len = seq.query_len, seq.context_len
    start = context_len - tq  # position of the first query
    if start == 0:  # fresh K/V, padded at the end like the queries (causality hides the pad)
        keys = F.pad(k.transpose(0, 1), (0, 0, 0, pad))
        values = F.pad(v.transpose(0, 1), (0, 0, 0, pad))
        first = 0
    else:
        block_size = kv_cache.shape[3]
        first_block = max(0, start - window + 1) // block_size
        keys, values = gather_kv(kv_cache, seq.block_table[first_block:], k.dtype)
        first = first_block * block_size
        keys, values = keys[:, : context_len - first], values[:, : context_len - first]
    device = keys.device
    k_pos = torch.arange(first, first + keys.shape[1], device=device).unsqueeze(0)
    q_pos = torch.arange(start, start + tq + pad, device=device).clamp(max=context_len - 1)
    q_pos = q_pos.unsqueeze(1)
    mask = (k_pos <= q_pos) & (k_pos > q_pos - window)
    return keys, values, mask
