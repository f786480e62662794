"""The compiled CPU prefill attention kernel against a dense float64 reference and the engine's
torch path: plain prefills, chunks over a cached prefix, prefix hits at every block offset,
shuffled block tables, GQA, sliding windows, bf16, and no reads past a sequence's blocks."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.attention import (
    AttentionKernels,
    AttentionMetadata,
    PrefillSeq,
    paged_attention,
)
from pdserve.kernels.cpu import cpu_ops


@pytest.fixture(scope="module")
def ops():
    module = cpu_ops()
    assert module is not None, "the CPU kernels must build on this machine (gcc + ninja)"
    return module


class Batch:
    """Prefill sequences (query_len, context_len) with random K/V in a paged cache of shuffled
    blocks; every block no sequence owns (the null block 0 included) is NaN. key_ramp: keys
    scaled from 1x at position 0 to key_ramp x at the last, so scores keep growing along the
    context (every new K/V tile moves the softmax's running max)."""

    def __init__(self, seqs, hq, hkv, d, block_size, dtype, seed=0, key_ramp=None):
        g = torch.Generator().manual_seed(seed)
        self.seqs, self.block_size = seqs, block_size
        counts = [-(-ctx // block_size) for _, ctx in seqs]
        num_blocks = sum(counts) + 3
        self.cache = torch.full((num_blocks, 2, hkv, block_size, d), float("nan"), dtype=dtype)
        perm = torch.randperm(num_blocks - 1, generator=g) + 1
        self.tables = torch.zeros(len(seqs), max(counts), dtype=torch.long)
        self.keys, self.values, used = [], [], 0
        for i, ((_, ctx), nb) in enumerate(zip(seqs, counts, strict=True)):
            self.tables[i, :nb] = perm[used : used + nb]
            used += nb
            k = torch.randn(ctx, hkv, d, generator=g)
            if key_ramp is not None:
                k *= torch.linspace(1.0, key_ramp, ctx).view(ctx, 1, 1)
            k = k.to(dtype)
            v = torch.randn(ctx, hkv, d, generator=g).to(dtype)
            for pos in range(ctx):
                block = self.tables[i, pos // block_size]
                self.cache[block, 0, :, pos % block_size] = k[pos]
                self.cache[block, 1, :, pos % block_size] = v[pos]
            self.keys.append(k)
            self.values.append(v)
        total = sum(q for q, _ in seqs)
        self.q = torch.randn(total, hq, d, generator=g).to(dtype)
        self.query_len = torch.tensor([q for q, _ in seqs])
        self.context_len = torch.tensor([c for _, c in seqs])
        self.query_start = torch.cumsum(self.query_len, 0) - self.query_len

    def run(self, ops, scale, window=0):
        out = torch.zeros_like(self.q)
        ops.paged_prefill_attention_out(
            self.q, self.cache, self.query_start, self.query_len, self.context_len,
            self.tables, scale, out, window,
        )  # fmt: skip
        return out

    def reference(self, scale, window=0):
        """Dense float64 attention, sequence by sequence, with the causal (+ window) mask."""
        outs = []
        for i, (qlen, ctx) in enumerate(self.seqs):
            start = int(self.query_start[i])
            q = self.q[start : start + qlen].double()  # [Tq, Hq, D]
            group = q.shape[1] // self.keys[i].shape[1]
            k = self.keys[i].double().repeat_interleave(group, dim=1)
            v = self.values[i].double().repeat_interleave(group, dim=1)
            scores = torch.einsum("qhd,khd->hqk", q, k) * scale
            q_pos = torch.arange(ctx - qlen, ctx).unsqueeze(1)
            k_pos = torch.arange(ctx).unsqueeze(0)
            visible = k_pos <= q_pos
            if window:
                visible &= k_pos > q_pos - window
            scores = scores.masked_fill(~visible, float("-inf"))
            outs.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), v))
        return torch.cat(outs)


def check(
    ops,
    seqs,
    hq,
    hkv,
    d,
    block_size,
    dtype=torch.float32,
    window=0,
    seed=0,
    key_ramp=None,
    fp32_tol=1e-5,
):
    batch = Batch(seqs, hq, hkv, d, block_size, dtype, seed, key_ramp)
    scale = d**-0.5
    out = batch.run(ops, scale, window)
    assert torch.isfinite(out).all(), "read a NaN block outside a sequence's context"
    tol = fp32_tol if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.double(), batch.reference(scale, window), atol=tol, rtol=tol)


# (query_len, context_len): plain prefills (query_len == context_len) of lengths around the
# kernel's 32-row query tiles and 64-key K/V tiles, chunks over a cached prefix, one-token chunks.
MIXED = [(1, 1), (5, 5), (31, 31), (33, 33), (64, 64), (65, 65), (130, 130), (1, 200),
         (17, 100), (64, 300), (200, 777)]  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hq,hkv,d", [(4, 4, 64), (9, 3, 64), (8, 2, 128), (16, 2, 64)])
def test_mixed_lengths_gqa_head_dims(ops, dtype, hq, hkv, d):
    check(ops, MIXED, hq, hkv, d, block_size=16, dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d", [32, 48, 256])  # 48: the plain-loop path (not a multiple of 16)
def test_other_head_dims(ops, dtype, d):
    """bf16: 32 takes the AVX512_BF16 dot products, 256 the AMX tiles (where the CPU has them)."""
    check(ops, [(40, 40), (20, 90), (1, 70)], 4, 2, d, block_size=8, dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [1, 8, 16, 32])
def test_prefix_hit_at_every_block_offset(ops, block_size, dtype):
    """A prefix hit of `cached` tokens, then a chunk: every offset within a block (and across
    the K/V tile boundary) as the first query position."""
    seqs = [(ctx - cached, ctx) for cached in range(0, 2 * block_size + 1) for ctx in [cached + 7]]
    seqs += [(50, 50 + cached) for cached in (31, 32, 33, 63, 64, 65, 127, 128, 129)]
    check(ops, seqs, 6, 2, 64, block_size, dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [0, 100])
def test_scores_growing_along_the_context(ops, dtype, window):
    """Keys scaled up along the context (scores up to ~40x larger at the end): the running max
    moves on most K/V tiles, so the accumulators are rescaled mid-row (the bf16 AMX path
    rescales lazily, only when a score exceeds the reference by 2^8) and stay exact. (fp32 at
    1e-4: scores in the hundreds carry ~1e-5 of rounding into their exps on any path.)"""
    seqs = [(700, 700), (300, 1100), (40, 40)]
    check(ops, seqs, 9, 3, 64, 16, dtype=dtype, window=window, key_ramp=40.0, fp32_tol=1e-4)


def test_chunk_boundaries_of_one_prompt(ops):
    """One 700-token prompt computed as chunks of 256: each chunk against its prefix equals the
    same rows of the whole prompt computed at once."""
    whole = Batch([(700, 700)], 9, 3, 64, 16, torch.float32)
    chunks = Batch([(256, 256), (256, 512), (188, 700)], 9, 3, 64, 16, torch.float32)
    chunks.cache, chunks.tables = whole.cache, whole.tables.expand(3, -1).contiguous()
    chunks.q = whole.q
    scale = 0.125
    torch.testing.assert_close(chunks.run(ops, scale), whole.run(ops, scale), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [1, 16, 50, 512])
def test_sliding_window(ops, dtype, window):
    seqs = [(300, 300), (40, 40), (64, 200), (1, 90), (100, 1000)]
    check(ops, seqs, 8, 2, 64, block_size=16, dtype=dtype, window=window)


def test_long_prompt_with_prefix(ops):
    check(ops, [(2048, 2048), (1000, 3000)], 9, 3, 64, block_size=16, dtype=torch.bfloat16)


def test_row_strided_views_and_other_rows_untouched(ops):
    """q a view into a fused qkv projection, out rows of a bigger tensor: only the prefill
    sequences' rows are written."""
    batch = Batch([(70, 70), (10, 40)], 4, 2, 64, 16, torch.float32)
    qkv = torch.randn(80, 8 * 64)
    qkv[:, : 4 * 64] = batch.q.reshape(80, -1)
    q = qkv[:, : 4 * 64].view(80, 4, 64)
    out = torch.full((82, 4, 64), 7.0)
    ops.paged_prefill_attention_out(
        q, batch.cache, batch.query_start, batch.query_len, batch.context_len, batch.tables,
        0.125, out[:80], 0,
    )  # fmt: skip
    torch.testing.assert_close(out[:80].double(), batch.reference(0.125), atol=1e-5, rtol=1e-5)
    assert (out[80:] == 7.0).all()


@pytest.mark.parametrize("window", [None, 24])
def test_engine_routes_prefills_through_kernel(ops, window):
    """One step with a decode, a fresh prompt, a chunk over a cached prefix and padding rows:
    the engine's kernel route makes one prefill call and equals its pure-torch route."""
    calls = []

    def spy(*args):
        calls.append(args[2].tolist())  # query_start
        ops.paged_prefill_attention_out(*args)

    hq, hkv, d, bs = 6, 2, 64, 16
    g = torch.Generator().manual_seed(1)
    cache = torch.randn(40, 2, hkv, bs, d, generator=g)
    q, k, v = (torch.randn(130, h, d, generator=g) for h in (hq, hkv, hkv))
    meta = AttentionMetadata(
        slot_mapping=torch.cat([torch.tensor([16 * 5 + 3]), torch.arange(16 * 10, 16 * 10 + 100),
                                torch.arange(16 * 22 + 4, 16 * 22 + 32)]),
        num_decode_tokens=1,
        decode_block_tables=torch.tensor([[4, 5]]),
        decode_seq_lens=torch.tensor([20]),
        decode_mask=(torch.arange(32) < 20)[None, None, None, :],
        prefills=[PrefillSeq(1, 100, 100, torch.arange(10, 17)),
                  PrefillSeq(101, 28, 60, torch.tensor([30, 31, 21, 22]))],
        block_size=bs,
    )  # fmt: skip
    outs = {}
    for route in ("torch", "kernel"):
        kernels = AttentionKernels(prefill=spy) if route == "kernel" else None
        outs[route] = paged_attention(q, k, v, cache.clone(), meta, d**-0.5, window, kernels)
    assert calls == [[1, 101]]
    torch.testing.assert_close(outs["kernel"], outs["torch"], atol=1e-5, rtol=1e-5)
    assert (outs["kernel"][129:] == 0).all()


def test_rejects_bad_input(ops):
    batch = Batch([(10, 20)], 4, 2, 64, 16, torch.float32)
    with pytest.raises(RuntimeError, match="too few blocks"):
        ops.paged_prefill_attention_out(
            batch.q, batch.cache, batch.query_start, batch.query_len, batch.context_len + 40,
            batch.tables, 0.125, torch.empty_like(batch.q), 0,
        )  # fmt: skip
    with pytest.raises(RuntimeError, match="int64"):
        ops.paged_prefill_attention_out(
            batch.q, batch.cache, batch.query_start.int(), batch.query_len, batch.context_len,
            batch.tables, 0.125, torch.empty_like(batch.q), 0,
        )  # fmt: skip
