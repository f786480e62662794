"""GPU path of ``engine.attention.paged_attention``: the same contract, on the Triton
kernels of ``pdserve_kernels/`` (store the new K/V, decode kernel on the decode part, varlen
prefill kernel on the multi-token requests), sliding-window layers included: the kernels take
the window."""

from __future__ import annotations

import torch

from pdserve.engine.attention import AttentionMetadata
from pdserve.kernels import paged_decode_attention, paged_prefill_attention, reshape_and_cache


def triton_paged_attention(
    q: torch.Tensor,  # [T, Hq, D]
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    kv_cache: torch.Tensor,  # [num_blocks, 2, Hkv, block_size, D] (engine layout)
    meta: AttentionMetadata,
    scale: float,
    window: int | None = None,  # sliding window: the query at p sees keys in (p - window, p]
) -> torch.Tensor:  # [T, Hq, D]
    """Causal attention of q over each request's cached context plus this step's k/v, which
    are written into kv_cache first. Same contract as ``engine.attention.paged_attention``."""
    # The kernels index [num_blocks, 2, block_size, Hkv, D] through strides: same memory.
    kv_cache = kv_cache.transpose(2, 3)
    reshape_and_cache(k, v, kv_cache, meta.slot_mapping)
    out = torch.empty_like(q)
    nd = meta.num_decode_tokens
    if nd:
        paged_decode_attention(
            q[:nd],
            kv_cache,
            meta.decode_block_tables,
            meta.decode_seq_lens,
            scale,
            out=out[:nd],
            window=window,
        )
    if meta.prefills:
        first, end, query_start_loc, seq_lens, block_tables = _prefill_args(meta, q.device)
        paged_prefill_attention(
            q[first:end],
            kv_cache,
            block_tables,
            query_start_loc,
            seq_lens,
            scale,
            max_query_len=max(s.query_len for s in meta.prefills),
            out=out[first:end],
            window=window,
        )
    return out


def _prefill_args(
    meta: AttentionMetadata, device: torch.device
) -> tuple[int, int, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(first row, end row, query_start_loc, seq_lens, block_tables) of the step's prefills on
    device: built once per step (the first layer) and shared by every layer."""
    args = meta.__dict__.get("_triton_prefill")
    if args is not None:
        return args
    seqs = meta.prefills
    first = seqs[0].query_start
    assert first == meta.num_decode_tokens, "the multi-token requests follow the decodes"
    # The prefills are contiguous and in batch order: one varlen launch over q[first:end].
    starts = [s.query_start - first for s in seqs]
    for s, nxt in zip(seqs, starts[1:], strict=False):
        assert s.query_start - first + s.query_len == nxt, "prefills must be contiguous"
    end = seqs[-1].query_start + seqs[-1].query_len
    query_start_loc = torch.tensor(starts + [end - first], dtype=torch.int32)
    seq_lens = torch.tensor([s.context_len for s in seqs], dtype=torch.int32)
    block_tables = torch.nn.utils.rnn.pad_sequence(
        [s.block_table.to(device, torch.int64) for s in seqs],
        batch_first=True,
        padding_value=0,  # pad with the null block
    )
    args = (
        first,
        end,
        query_start_loc.to(device, non_blocking=True),
        seq_lens.to(device, non_blocking=True),
        block_tables,
    )
    meta.__dict__["_triton_prefill"] = args
    return args
