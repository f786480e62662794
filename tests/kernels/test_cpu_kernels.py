"""The compiled CPU decode kernel against the pure-torch paged attention and a dense reference."""

from __future__ import annotations

import pytest
import torch

from engine import attention
from engine.attention import AttentionMetadata, paged_attention
from kernels.cpu import cpu_ops


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hq,hkv,d", [(8, 2, 64), (4, 1, 32), (6, 6, 48)])
@pytest.mark.parametrize("block_size", [16, 32])
def test_decode_kernel_matches_dense_and_torch_path(ops, dtype, hq, hkv, d, block_size):
    g = torch.Generator().manual_seed(hq * 1000 + d + block_size)
    num_blocks = 64
    seq_lens = [1, block_size, block_size + 1, 3 * block_size - 1, 170]
    max_blocks = -(-max(seq_lens) // block_size)
    cache = torch.randn(num_blocks, 2, hkv, block_size, d, generator=g).to(dtype)
    perm = torch.randperm(num_blocks - 1, generator=g) + 1  # shuffled, never the null block
    tables = torch.zeros(len(seq_lens), max_blocks, dtype=torch.long)
    used = 0
    for i, n in enumerate(seq_lens):
        nb = -(-n // block_size)
        tables[i, :nb] = perm[used : used + nb]
        used += nb
    q = torch.randn(len(seq_lens), hq, d, generator=g).to(dtype)
    lens = torch.tensor(seq_lens)
    scale = d**-0.5
    out = ops.paged_decode_attention(q, cache, tables, lens, scale)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for i, n in enumerate(seq_lens):
        blocks = cache[tables[i, : -(-n // block_size)]]  # [nb, 2, Hkv, bs, D]
        keys = blocks[:, 0].transpose(1, 2).reshape(-1, hkv, d)[:n]
        values = blocks[:, 1].transpose(1, 2).reshape(-1, hkv, d)[:n]
        want = dense_decode(q[i], keys, values, scale)
        torch.testing.assert_close(out[i].double(), want, atol=tol, rtol=tol)
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


def test_engine_routes_decodes_through_kernel(ops, monkeypatch):
    calls = []

    def spy(*args):
        calls.append(args[0].shape)
        return ops.paged_decode_attention(*args)

    monkeypatch.setattr(attention, "_decode_kernel", spy)
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
    out = paged_attention(q, k, v, cache, meta, 1.0)
    assert calls == [torch.Size([1, 2, 8])]
    # one key: attention returns its value for every query head
    torch.testing.assert_close(out[0], v[0].expand(2, 8))
