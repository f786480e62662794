"""The compiled CPU decode kernel against the pure-torch paged attention and a dense reference."""

from __future__ import annotations

import time

import pytest
import torch
import torch.nn.functional as F

from pdserve.engine import attention
from pdserve.engine.attention import (
    AttentionKernels,
    AttentionMetadata,
    PrefillSeq,
    paged_attention,
)
from pdserve.engine.models.llama import apply_rope
from pdserve.kernels.cpu import cpu_ops


@pytest.fixture(scope="module")
def ops():
    module = cpu_ops()
    assert module is not None, "the CPU kernels must build on this machine (gcc + ninja)"
    return module


def dense_decode(q, keys, values, scale):
    """Naive attention of one query [Hq, D] over keys/values [L, Hkv, D], in float64."""
    hq, hkv = q.shape[0], keys.shape[1]
    k = keys.double().repeat_interleave(hq // hkv, dim=1)
    v = values.double().repeat_interleave(hq // hkv, dim=1)
    scores = torch.einsum("hd,lhd->hl", q.double(), k) * scale
    return torch.einsum("hl,lhd->hd", scores.softmax(-1), v)


def paged_cache(seq_lens, num_blocks, hkv, block_size, d, dtype, g):
    """Random K/V in num_blocks shuffled blocks (never the null block 0) and the block tables
    [len(seq_lens), max blocks] giving each sequence its own blocks."""
    max_blocks = -(-max(seq_lens) // block_size)
    cache = torch.randn(num_blocks, 2, hkv, block_size, d, generator=g).to(dtype)
    perm = torch.randperm(num_blocks - 1, generator=g) + 1
    tables = torch.zeros(len(seq_lens), max_blocks, dtype=torch.long)
    used = 0
    for i, n in enumerate(seq_lens):
        nb = -(-n // block_size)
        tables[i, :nb] = perm[used : used + nb]
        used += nb
    return cache, tables


def assert_matches_dense(out, q, cache, tables, seq_lens, scale, tol):
    """Each request's output row against dense_decode over its gathered K/V."""
    _, _, hkv, block_size, d = cache.shape
    for i, n in enumerate(seq_lens):
        blocks = cache[tables[i, : -(-n // block_size)]]  # [nb, 2, Hkv, bs, D]
        keys = blocks[:, 0].transpose(1, 2).reshape(-1, hkv, d)[:n]
        values = blocks[:, 1].transpose(1, 2).reshape(-1, hkv, d)[:n]
        want = dense_decode(q[i], keys, values, scale)
        torch.testing.assert_close(out[i].double(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hq,hkv,d", [(8, 2, 64), (4, 1, 32), (6, 6, 48), (6, 2, 128)])
@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_decode_kernel_matches_dense_and_torch_path(ops, dtype, hq, hkv, d, block_size):
    g = torch.Generator().manual_seed(hq * 1000 + d + block_size)
    seq_lens = [1, block_size, block_size + 1, 3 * block_size - 1, 170]
    max_blocks = -(-max(seq_lens) // block_size)
    cache, tables = paged_cache(seq_lens, 64, hkv, block_size, d, dtype, g)
    q = torch.randn(len(seq_lens), hq, d, generator=g).to(dtype)
    lens = torch.tensor(seq_lens)
    scale = d**-0.5
    out = ops.paged_decode_attention(q, cache, tables, lens, scale)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert_matches_dense(out, q, cache, tables, seq_lens, scale, tol)
    # the engine's torch path gives the same answer as the kernel
    mask = (torch.arange(max_blocks * block_size)[None] < lens[:, None])[:, None, None, :]
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(0, dtype=torch.long),
        num_decode_tokens=len(seq_lens),
        decode_block_tables=tables,
        decode_seq_lens=lens,
        decode_mask=mask,
        prefills=[],
        block_size=block_size,
    )
    torch_out = attention._decode_attention(q, cache, meta, scale)
    torch.testing.assert_close(out.float(), torch_out.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("score_scale", [20.0, 200.0])
def test_decode_kernel_softmax_over_far_apart_scores(ops, score_scale):
    """Scores hundreds apart: most softmax weights underflow and one or a few keys take
    all the weight; the vectorised softmax's clamped exp and masked tail lanes must still give
    the dense answer (lengths around multiples of 8)."""
    g = torch.Generator().manual_seed(int(score_scale))
    seq_lens = [1, 7, 8, 9, 15, 17, 33]
    cache, tables = paged_cache(seq_lens, 16, 2, 8, 64, torch.float32, g)
    q = torch.randn(len(seq_lens), 6, 64, generator=g)
    scale = score_scale * 64**-0.5
    out = ops.paged_decode_attention(q, cache, tables, torch.tensor(seq_lens), scale)
    assert torch.isfinite(out).all()
    assert_matches_dense(out, q, cache, tables, seq_lens, scale, 1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hq,hkv,d", [(10, 2, 64), (14, 2, 64), (20, 2, 64), (16, 1, 128)])
def test_decode_kernel_large_groups_many_requests(ops, dtype, hq, hkv, d):
    """Query-head groups of 5, 7, 10 and 16 (V accumulated 8 heads at a time, then the rest)
    and enough requests of very different lengths for the per-request, work-balanced split."""
    block_size = 16
    g = torch.Generator().manual_seed(hq * 100 + d)
    seq_lens = [int(n) for n in torch.randint(1, 300, (24,), generator=g)] + [1, 299, 16, 17]
    num_blocks = 1 + sum(-(-n // block_size) for n in seq_lens)
    cache, tables = paged_cache(seq_lens, num_blocks, hkv, block_size, d, dtype, g)
    q = torch.randn(len(seq_lens), hq, d, generator=g).to(dtype)
    scale = d**-0.5
    out = ops.paged_decode_attention(q, cache, tables, torch.tensor(seq_lens), scale)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert_matches_dense(out, q, cache, tables, seq_lens, scale, tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_kernel_far_below_max_scores_and_float_mode_restored(ops, dtype):
    """Scores spread so that most softmax weights fall into the denormal range (the kernel
    flushes them to zero for speed): the output still matches the dense reference, and the
    calling thread's float mode is restored after (a denormal survives a multiply)."""
    block_size, hkv, hq, d = 16, 2, 6, 64
    g = torch.Generator().manual_seed(7)
    seq_lens = [300, 170, 33, 1] * 4
    num_blocks = 1 + sum(-(-n // block_size) for n in seq_lens)
    cache, tables = paged_cache(seq_lens, num_blocks, hkv, block_size, d, dtype, g)
    q = (torch.randn(len(seq_lens), hq, d, generator=g) * 12).to(dtype)
    scale = d**-0.5
    torch.set_flush_denormal(False)
    out = ops.paged_decode_attention(q, cache, tables, torch.tensor(seq_lens), scale)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert_matches_dense(out, q, cache, tables, seq_lens, scale, tol)
    tiny = torch.tensor([1e-39]) * torch.tensor([1.0])
    assert tiny.item() != 0.0, "the kernel left denormals flushed in the calling thread"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_kernel_reads_and_writes_row_strided_views(ops, dtype):
    """q as a view into a fused qkv output and out as rows of a wider tensor (what the engine
    passes): the same values as the contiguous call, and nothing outside out's view written."""
    block_size, hkv, hq, d = 16, 2, 6, 64
    g = torch.Generator().manual_seed(11)
    seq_lens = [40, 1, 17, 160, 3]
    num_blocks = 1 + sum(-(-n // block_size) for n in seq_lens)
    cache, tables = paged_cache(seq_lens, num_blocks, hkv, block_size, d, dtype, g)
    qkv = torch.randn(len(seq_lens), (hq + 2 * hkv) * d, generator=g).to(dtype)
    q = qkv[:, : hq * d].view(len(seq_lens), hq, d)
    lens = torch.tensor(seq_lens)
    want = ops.paged_decode_attention(q.contiguous(), cache, tables, lens, d**-0.5)
    wide = torch.full((len(seq_lens) + 2, hq + 1, d), 7.0, dtype=dtype)
    out = wide[1:-1, 1:]  # row stride (hq + 1) * d, packed heads
    ops.paged_decode_attention_out(q, cache, tables, lens, d**-0.5, out)
    assert torch.equal(out, want)
    assert torch.equal(ops.paged_decode_attention(q, cache, tables, lens, d**-0.5), want)
    assert (wide[0] == 7).all() and (wide[-1] == 7).all() and (wide[:, 0] == 7).all()
    with pytest.raises(RuntimeError, match="packed heads"):
        ops.paged_decode_attention_out(q.transpose(0, 1), cache, tables, lens, 0.1, out)


def test_engine_routes_decodes_through_kernel(ops):
    calls = []

    def spy(*args):
        calls.append(args[0].shape)
        return ops.paged_decode_attention_out(*args)

    cache = torch.zeros(4, 2, 1, 16, 8)
    q = torch.randn(1, 2, 8)
    k = v = torch.randn(1, 1, 8)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor([16]),
        num_decode_tokens=1,
        decode_block_tables=torch.tensor([[1]]),
        decode_seq_lens=torch.tensor([1]),
        decode_mask=torch.ones(1, 1, 1, 16, dtype=torch.bool),
        prefills=[],
        block_size=16,
    )
    out = paged_attention(q, k, v, cache, meta, 1.0, kernels=AttentionKernels(decode=spy))
    assert calls == [torch.Size([1, 2, 8])]
    # one key: attention returns its value for every query head
    torch.testing.assert_close(out[0], v[0].expand(2, 8))


def windowed_meta(tables, seq_lens, block_size, max_blocks):
    """Decode-only AttentionMetadata over the given block tables."""
    lens = torch.tensor(seq_lens)
    mask = (torch.arange(max_blocks * block_size)[None] < lens[:, None])[:, None, None, :]
    return AttentionMetadata(
        slot_mapping=torch.zeros(0, dtype=torch.long),
        num_decode_tokens=len(seq_lens),
        decode_block_tables=tables,
        decode_seq_lens=lens,
        decode_mask=mask,
        prefills=[],
        block_size=block_size,
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hq,hkv,d", [(4, 1, 32), (6, 2, 48), (4, 1, 256)])
@pytest.mark.parametrize("block_size", [8, 16])
@pytest.mark.parametrize("many", [False, True])
def test_decode_kernel_sliding_window(ops, dtype, hq, hkv, d, block_size, many):
    """window > 0: each request attends to its last `window` positions only (the query at p
    sees keys in (p - window, p]), starting inside a block or on its boundary; on the AVX-512
    path (head_dim 32, 256) and the generic one (48). The torch path's windowed bias agrees.
    many: enough requests that a task takes all of a request's kv heads (AVX-512 and AVX2)."""
    g = torch.Generator().manual_seed(hq * 1000 + d + block_size)
    seq_lens = [1, 5, block_size, block_size + 3, 40, 170]
    if many:
        seq_lens += [3, 17, 33, 64, 65, 90, 129, 150]
    max_blocks = -(-max(seq_lens) // block_size)
    num_blocks = 1 + sum(-(-n // block_size) for n in seq_lens)
    cache, tables = paged_cache(seq_lens, num_blocks, hkv, block_size, d, dtype, g)
    q = torch.randn(len(seq_lens), hq, d, generator=g).to(dtype)
    lens = torch.tensor(seq_lens)
    scale = d**-0.5
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    meta = windowed_meta(tables, seq_lens, block_size, max_blocks)
    for window in (1, 5, 16, 40, 1000):
        out = ops.paged_decode_attention(q, cache, tables, lens, scale, window)
        for i, n in enumerate(seq_lens):
            blocks = cache[tables[i, : -(-n // block_size)]]
            keys = blocks[:, 0].transpose(1, 2).reshape(-1, hkv, d)[:n]
            values = blocks[:, 1].transpose(1, 2).reshape(-1, hkv, d)[:n]
            first = max(0, n - window)
            want = dense_decode(q[i], keys[first:], values[first:], scale)
            torch.testing.assert_close(out[i].double(), want, atol=tol, rtol=tol)
        torch_out = attention._decode_attention(q, cache, meta, scale, window)
        torch.testing.assert_close(out.float(), torch_out.float(), atol=tol, rtol=tol)
    full = ops.paged_decode_attention(q, cache, tables, lens, scale)
    assert torch.equal(ops.paged_decode_attention(q, cache, tables, lens, scale, 0), full)
    with pytest.raises(RuntimeError, match="window"):
        ops.paged_decode_attention(q, cache, tables, lens, scale, -1)


def dense_windowed(q, keys, values, q_positions, window, scale):
    """Reference attention of queries q [Tq, Hq, D] at q_positions over keys/values
    [L, Hkv, D] (positions 0..L-1), each query seeing keys in (p - window, p]."""
    out = torch.empty(q.shape, dtype=torch.float64)
    for i, p in enumerate(q_positions):
        first = max(0, p - window + 1)
        out[i] = dense_decode(q[i], keys[first : p + 1], values[first : p + 1], scale)
    return out


@pytest.mark.parametrize("path", ["torch", "kernel"])
@pytest.mark.parametrize("block_size", [8, 16])
def test_paged_attention_sliding_window(ops, path, block_size):
    """One step of a sliding-window layer: two decodes, a prefill chunk over cached context
    longer than the window, a fresh prefill longer than the window (padded to 64 query rows)
    and a short one; every query's output equals dense attention over its window."""
    kernels = None
    if path != "torch":
        kernels = AttentionKernels(ops.paged_decode_attention_out, ops.paged_prefill_attention_out)
    window, hq, hkv, d = 12, 4, 2, 32
    g = torch.Generator().manual_seed(block_size)
    # (tokens cached before the step, tokens computed in it); decodes first
    seqs = [(29, 1), (6, 1), (25, 20), (0, 40), (0, 5)]
    kv = [torch.randn(2, c + n, hkv, d, generator=g) for c, n in seqs]
    tables, next_block = [], 1
    cache = torch.zeros(64, 2, hkv, block_size, d)
    for (cached, n), kv_all in zip(seqs, kv, strict=True):
        nb = -(-(cached + n) // block_size)
        table = list(range(next_block, next_block + nb))
        next_block += nb
        tables.append(table)
        for pos in range(cached):
            slot_block, offset = table[pos // block_size], pos % block_size
            cache[slot_block, :, :, offset] = kv_all[:, pos]
    q_parts, k_parts, v_parts, slots, prefills, start = [], [], [], [], [], 0
    for (cached, n), kv_all, table in zip(seqs, kv, tables, strict=True):
        q_parts.append(torch.randn(n, hq, d, generator=g))
        k_parts.append(kv_all[0, cached:])
        v_parts.append(kv_all[1, cached:])
        slots += [
            table[p // block_size] * block_size + p % block_size for p in range(cached, cached + n)
        ]
        if n > 1:
            prefills.append(PrefillSeq(start, n, cached + n, torch.tensor(table)))
        start += n
    decode_lens = [c + n for c, n in seqs[:2]]
    max_blocks = max(len(t) for t in tables[:2])
    decode_tables = torch.tensor([t + [0] * (max_blocks - len(t)) for t in tables[:2]])
    meta = windowed_meta(decode_tables, decode_lens, block_size, max_blocks)
    meta.slot_mapping, meta.prefills = torch.tensor(slots), prefills
    q, k, v = torch.cat(q_parts), torch.cat(k_parts), torch.cat(v_parts)
    out = paged_attention(q, k, v, cache, meta, d**-0.5, window, kernels)
    start = 0
    for (cached, n), kv_all, q_seq in zip(seqs, kv, q_parts, strict=True):
        positions = list(range(cached, cached + n))
        want = dense_windowed(q_seq, kv_all[0], kv_all[1], positions, window, d**-0.5)
        torch.testing.assert_close(out[start : start + n].double(), want, atol=1e-5, rtol=1e-5)
        start += n


def torch_rms_norm(x, w, eps):
    """engine/models/llama.py RMSNorm's torch path."""
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens,hidden", [(1, 768), (37, 512), (5, 40)])
def test_fused_layers_match_torch(ops, dtype, tokens, hidden):
    """bf16: bit-identical to the torch ops (same roundings) except silu, whose exp differs in
    the last float bit; fp32: within float rounding."""
    g = torch.Generator().manual_seed(tokens * 7 + hidden)
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    w = (torch.rand(hidden, generator=g) + 0.5).to(dtype)
    res = torch.randn(tokens, hidden, generator=g).to(dtype)
    exact = dict(atol=0, rtol=0) if dtype == torch.bfloat16 else dict(atol=2e-6, rtol=2e-6)
    torch.testing.assert_close(ops.rms_norm(x, w, 1e-5), torch_rms_norm(x, w, 1e-5), **exact)

    xx, rr = x.clone(), res.clone()
    ops.fused_add_rms_norm(xx, rr, w, 1e-5)
    torch.testing.assert_close(rr, res + x, atol=0, rtol=0)
    torch.testing.assert_close(xx, torch_rms_norm(res + x, w, 1e-5), **exact)

    gate_up = torch.randn(tokens, 2 * hidden, generator=g).to(dtype) * 4
    gate, up = gate_up.chunk(2, dim=-1)
    want = F.silu(gate) * up
    got = ops.silu_and_mul(gate_up)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    if dtype == torch.bfloat16:
        assert (got != want).float().mean() < 0.01, "only last-bit differences"


def torch_gemma_rms_norm(x, w, eps):
    """engine/models/gemma3.py GemmaRMSNorm's torch path (transformers' Gemma3RMSNorm)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * (1.0 + w.float())).to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens,hidden", [(1, 640), (37, 512), (5, 40)])
def test_gemma_layers_match_torch(ops, dtype, tokens, hidden):
    """Gemma 3's norm (plain, on strided q heads of a fused qkv row, and added to the residual
    in place) and GeGLU against the torch ops they replace: fp32 within float rounding (the
    sum of squares is added in another order), bf16 within one rounding step at most on a few
    elements; the residual sum is exact."""
    g = torch.Generator().manual_seed(tokens * 5 + hidden)
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    w = torch.randn(hidden, generator=g).to(dtype)  # (1 + w): weights around 0, as Gemma's
    res = torch.randn(tokens, hidden, generator=g).to(dtype)
    close = dict(atol=2e-6, rtol=2e-6) if dtype == torch.float32 else dict(atol=2e-2, rtol=1e-2)

    def check(got, want):
        torch.testing.assert_close(got, want, **close)
        if dtype == torch.bfloat16:
            assert (got != want).float().mean() < 0.02, "only last-bit differences"

    check(ops.gemma_rms_norm(x, w, 1e-6), torch_gemma_rms_norm(x, w, 1e-6))
    heads, dim = 3, 64
    qkv = torch.randn(tokens, (heads + 2) * dim, generator=g).to(dtype)
    q = qkv[:, : heads * dim].view(tokens, heads, dim)  # rows heads*dim+2*dim apart
    wq = torch.randn(dim, generator=g).to(dtype)
    got = ops.gemma_rms_norm(q, wq, 1e-6)
    assert got.is_contiguous() and got.shape == q.shape
    check(got, torch_gemma_rms_norm(q, wq, 1e-6))

    xx, rr = x.clone(), res.clone()
    ops.gemma_add_rms_norm(xx, rr, w, 1e-6)
    torch.testing.assert_close(rr, res + x, atol=0, rtol=0)
    check(xx, torch_gemma_rms_norm(res + x, w, 1e-6))

    # GeGLU: gelu's 1 + tanh(y) cancels below g ~ -3 (torch's own fp32 result is off there
    # by up to 100%: a gelu of ~1e-5 and less); the kernel's g * sigmoid(2y) keeps it, so it
    # is held to the exact value, and to torch's bits where gelu matters.
    gate_up = torch.randn(tokens, 2 * hidden, generator=g).to(dtype) * 4
    gate, up = gate_up.chunk(2, dim=-1)
    exact = F.gelu(gate.double(), approximate="tanh")
    got = ops.gelu_tanh_and_mul(gate_up)
    if dtype == torch.float32:
        torch.testing.assert_close(got.double(), exact * up.double(), atol=1e-6, rtol=1e-5)
    else:
        rounded = exact.to(dtype).double() * up.double()  # gelu rounded, as torch rounds it
        torch.testing.assert_close(got.double(), rounded, atol=1e-2, rtol=1e-2)
        want = F.gelu(gate, approximate="tanh") * up
        away = exact.abs() > 1e-2
        assert (got != want)[away].float().mean() < 0.02, "only last-bit differences"
    extreme = torch.tensor([-1e4, -100.0, -20.0, -3.0, 0.0, 3.0, 20.0, 100.0, 1e4] * 4)
    ones = torch.ones_like(extreme)
    got = ops.gelu_tanh_and_mul(torch.cat([extreme, ones])[None].to(dtype))
    want = F.gelu(extreme.to(dtype).double(), approximate="tanh")
    assert torch.isfinite(got).all(), got
    torch.testing.assert_close(got.double(), want[None], atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul_of_extreme_gates_is_finite(ops, dtype):
    """Gates far below -88 (exp(-g) overflows) give silu 0, not NaN, on every path: the
    AVX-512 loop and the scalar one (all of it on an AVX2 CPU, where -ffast-math's reciprocal
    once turned 1 / inf into NaN and a LoRA test's outputs into token 0)."""
    gate = torch.tensor([-1e4, -500.0, -100.0, -89.0, -88.0, -20.0, 0.0, 20.0, 100.0, 1e4] * 4)
    up = torch.linspace(-3, 3, gate.numel())
    gate_up = torch.cat([gate, up])[None].to(dtype)  # 40 wide: vector body and scalar tail
    got = ops.silu_and_mul(gate_up)
    want = F.silu(gate.to(dtype).double()) * up.to(dtype).double()
    assert torch.isfinite(got).all(), got
    torch.testing.assert_close(got.double(), want[None], atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hq,hkv,d", [(12, 4, 64), (4, 2, 40)])
def test_rotary_embedding_in_place_on_qkv_views(ops, dtype, hq, hkv, d):
    g = torch.Generator().manual_seed(hq + d)
    tokens = 9
    qkv = torch.randn(tokens, (hq + 2 * hkv) * d, generator=g).to(dtype)
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    q, k = q.view(tokens, hq, d), k.view(tokens, hkv, d)
    cos = torch.randn(tokens, d // 2, generator=g).to(dtype)
    sin = torch.randn(tokens, d // 2, generator=g).to(dtype)
    want_q, want_k, want_v = apply_rope(q, cos, sin), apply_rope(k, cos, sin), v.clone()
    ops.rotary_embedding(q, k, cos, sin)
    torch.testing.assert_close(q, want_q, atol=0, rtol=0)
    torch.testing.assert_close(k, want_k, atol=0, rtol=0)
    torch.testing.assert_close(v, want_v, atol=0, rtol=0)  # v, between them in memory, untouched


def test_fused_layers_reject_bad_input(ops):
    x = torch.randn(4, 16)
    with pytest.raises(RuntimeError, match="weight"):
        ops.rms_norm(x, torch.ones(8), 1e-5)
    with pytest.raises(RuntimeError, match="contiguous"):
        ops.rms_norm(x.t(), torch.ones(4), 1e-5)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        ops.silu_and_mul(x.double())
    with pytest.raises(RuntimeError, match="residual"):
        ops.fused_add_rms_norm(x, torch.randn(4, 8), torch.ones(16), 1e-5)
    q = torch.randn(2, 2, 8)
    with pytest.raises(RuntimeError, match="cos / sin"):
        ops.rotary_embedding(q, q.clone(), torch.randn(2, 3), torch.randn(2, 3))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_kv_matches_the_torch_write(ops, dtype):
    """The compiled K/V store puts every token's K and V rows (strided views into a fused qkv
    output, as the model passes them) where the torch index_copy_ path puts them, and touches
    nothing else; a slot outside the cache is refused."""
    hkv, block_size, d, num_blocks = 3, 8, 16, 12
    g = torch.Generator().manual_seed(3)
    qkv = torch.randn(7, (4 + 2 * hkv) * d, generator=g).to(dtype)
    k = qkv[:, 4 * d : (4 + hkv) * d].view(7, hkv, d)
    v = qkv[:, (4 + hkv) * d :].view(7, hkv, d)
    slots = torch.tensor([8, 9, 23, 40, 41, 42, 95])  # blocks 1, 2, 5, 11; offsets vary
    meta = AttentionMetadata(
        slots,
        0,
        torch.zeros(0, 1, dtype=torch.long),
        torch.zeros(0, dtype=torch.long),
        None,
        [],
        block_size,
    )
    start = torch.randn(num_blocks, 2, hkv, block_size, d, generator=g).to(dtype)
    ours, want = start.clone(), start.clone()
    ops.store_kv(k, v, ours, slots)
    attention.write_kv(want, k, v, meta)  # no kernels: the torch path
    assert torch.equal(ours, want)
    assert not torch.equal(ours, start)
    with pytest.raises(RuntimeError, match="outside the cache"):
        ops.store_kv(k, v, ours, torch.tensor([8, 9, 23, 40, 41, 42, num_blocks * block_size]))


@pytest.mark.parametrize("n", [1, 7, 16, 31, 32, 33, 63, 100, 8192, 49152])
def test_argmax_rows_is_torch_argmax(ops, n):
    """First index of the maximum on ties, NaN wins (its first index), -inf rows, widths below,
    at and across the vector widths (16 lanes on AVX-512, 4 x 8 on AVX2)."""
    g = torch.Generator().manual_seed(n)
    x = torch.randn(9, n, generator=g)
    x[1] = 0.5  # all tied: index 0
    x[2] = float("-inf")
    x[3, n // 2 :] = 9.0  # tie between the middle and the end: the middle
    x[4, n - 1] = float("nan")
    x[5, :] = float("nan")
    x[6, n // 3] = float("inf")
    x[7] = torch.randint(0, 3, (n,), generator=g).float()  # many ties
    x[8, n - 1] = 99.0  # the maximum in the tail past the last full vector
    want = x.argmax(dim=-1)
    assert torch.equal(ops.argmax_rows(x), want)
    from pdserve.engine import sampler

    assert torch.equal(sampler.argmax_rows(x, ops), want)
    half = x[:, : max(1, n // 2)]  # rows not contiguous: torch's argmax, the same answer
    assert torch.equal(sampler.argmax_rows(half, ops), half.argmax(-1))
    with pytest.raises(RuntimeError, match="float32"):
        ops.argmax_rows(x.double())


def test_kernels_run_without_the_gil(ops):
    """Another Python thread runs while a kernel computes (a serving node's asyncio thread
    during the engine's step), as it does during torch's own operators. With a switch interval
    of 0.5 s the spinning thread only gets the GIL inside the call if the call released it."""
    import sys
    import threading

    x = torch.ones(8192, 4096)
    w = torch.ones(4096)
    spins = [0]
    stop = threading.Event()

    def spin():
        while not stop.is_set():
            spins[0] += 1

    old = sys.getswitchinterval()
    sys.setswitchinterval(0.5)
    thread = threading.Thread(target=spin, daemon=True)
    try:
        thread.start()
        while spins[0] == 0:
            time.sleep(0.001)
        time.sleep(0.001)  # back from a sleep: the spinner's wait for the GIL starts over
        before = spins[0]
        out = ops.rms_norm(x, w, 1e-5)
        during = spins[0] - before  # before out is freed (torch frees without the GIL)
    finally:
        stop.set()
        sys.setswitchinterval(old)
        thread.join(timeout=10)
    assert not thread.is_alive()
    assert during > 0, "the spinning thread never ran: rms_norm held the GIL"
    torch.testing.assert_close(out[:2], torch_rms_norm(x[:2], w, 1e-5))
