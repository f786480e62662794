"""Triton kernels vs their torch references, and the references vs dense attention.

The Triton checks need ``TRITON_INTERPRET=1`` set before triton is imported, and other test
modules of the same session import triton without it; so this module runs them in a
subprocess (this file as a script, env set there only), once, and each test asserts on the
result of its case. The reference checks run in-process.

Everything is compared in fp32: the interpreter stores bf16 as raw uint16 and computes bf16
arithmetic wrongly, so the kernels cast to fp32 right after loading (the bf16-cache cases
check exactly that path).
"""

from __future__ import annotations

import os

if __name__ == "__main__":  # the interpreter subprocess: before triton is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import json
import math
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from pdserve.kernels.reference import (  # noqa: E402
    paged_decode_attention_ref,
    paged_prefill_attention_ref,
    reshape_and_cache_ref,
)

# --------------------------------------------------------------------------------------
# Case construction (shared by the in-process and the interpreter checks)
# --------------------------------------------------------------------------------------


def build_paged(
    seed: int,
    seq_lens: list[int],
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    cache_dtype: torch.dtype = torch.float32,
    table_dtype: torch.dtype = torch.int64,
    garbage: float = float("nan"),
) -> dict:
    """A paged cache holding each request's dense K/V ([L, Hkv, D], fp32 values exactly
    representable in cache_dtype) in shuffled, non-contiguous blocks. Every slot the
    requests don't own (null block, spare blocks, the tail of each last block) holds
    ``garbage`` (NaN by default), so a read outside the context shows up."""
    g = torch.Generator().manual_seed(seed)
    n_blocks = [math.ceil(n / block_size) for n in seq_lens]
    num_blocks = 1 + sum(n_blocks) + 5  # null block + used + spare
    cache = torch.full((num_blocks, 2, block_size, num_kv_heads, head_dim), garbage)
    ids = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()  # never the null block
    max_blocks = max(n_blocks) + 2  # extra null padding columns
    tables = torch.zeros(len(seq_lens), max_blocks, dtype=table_dtype)
    dense_k, dense_v = [], []
    for b, n in enumerate(seq_lens):
        k = torch.randn(n, num_kv_heads, head_dim, generator=g).to(cache_dtype).float()
        v = torch.randn(n, num_kv_heads, head_dim, generator=g).to(cache_dtype).float()
        dense_k.append(k)
        dense_v.append(v)
        for j in range(n_blocks[b]):
            blk = ids.pop()
            tables[b, j] = blk
            piece = slice(j * block_size, min(n, (j + 1) * block_size))
            m = piece.stop - piece.start
            cache[blk, 0, :m] = k[piece]
            cache[blk, 1, :m] = v[piece]
    return dict(cache=cache.to(cache_dtype), tables=tables, k=dense_k, v=dense_v, gen=g)


def naive_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Dense causal attention in fp64 with explicit loops: q [ql, Hq, D] are the last ql
    positions of a context whose keys/values are k, v [L, Hkv, D]."""
    ql, hq, _ = q.shape
    n, hkv, _ = k.shape
    out = torch.empty(ql, hq, q.shape[2], dtype=torch.float64)
    for h in range(hq):
        kh = h // (hq // hkv)
        for i in range(ql):
            pos = n - ql + i
            s = (k[: pos + 1, kh].double() @ q[i, h].double()) * scale
            out[i, h] = torch.softmax(s, 0) @ v[: pos + 1, kh].double()
    return out


def decode_case(
    seed,
    seq_lens,
    hq,
    hkv,
    d,
    bs,
    cache_dtype=torch.float32,
    q_dtype=torch.float32,
    table_dtype=torch.int64,
):
    c = build_paged(seed, seq_lens, bs, hkv, d, cache_dtype, table_dtype)
    q = torch.randn(len(seq_lens), hq, d, generator=c["gen"]).to(q_dtype)
    seq = torch.tensor(seq_lens, dtype=table_dtype)
    return dict(c, q=q, seq_lens=seq, scale=d**-0.5)


def prefill_case(
    seed,
    seq_lens,
    query_lens,
    hq,
    hkv,
    d,
    bs,
    cache_dtype=torch.float32,
    q_dtype=torch.float32,
    table_dtype=torch.int64,
):
    c = build_paged(seed, seq_lens, bs, hkv, d, cache_dtype, table_dtype)
    q = torch.randn(sum(query_lens), hq, d, generator=c["gen"]).to(q_dtype)
    qsl = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=table_dtype)
    seq = torch.tensor(seq_lens, dtype=table_dtype)
    return dict(c, q=q, qsl=qsl, seq_lens=seq, scale=d**-0.5)


# Kernel cases, by name: (kind, builder kwargs, extra). Mixed lengths cover 1 token, block
# boundaries +-1 and contexts crossing up to 19 shuffled blocks.
MIXED_DECODE = [1, 15, 16, 17, 130, 300]
CASES: dict[str, dict] = {
    # decode
    "decode_gqa_bs16": dict(kind="decode", seed=1, seq_lens=MIXED_DECODE, hq=8, hkv=2, d=64, bs=16),
    "decode_mqa_bs32": dict(
        kind="decode", seed=2, seq_lens=[5, 64, 65, 257, 31], hq=4, hkv=1, d=32, bs=32
    ),
    "decode_mha_d40_int32_pad0": dict(
        kind="decode",
        seed=3,
        seq_lens=[0, 3, 48, 200],
        hq=4,
        hkv=4,
        d=40,
        bs=16,
        table_dtype=torch.int32,
    ),
    "decode_gqa_bf16cache_bs32": dict(
        kind="decode",
        seed=4,
        seq_lens=[7, 33, 190],
        hq=6,
        hkv=2,
        d=64,
        bs=32,
        cache_dtype=torch.bfloat16,
    ),
    "decode_all_bf16_bs16": dict(
        kind="decode",
        seed=5,
        seq_lens=[2, 50, 161],
        hq=8,
        hkv=2,
        d=32,
        bs=16,
        cache_dtype=torch.bfloat16,
        q_dtype=torch.bfloat16,
    ),
    # prefill: (seq_len, query_len) = fresh prompt, chunk after a cached prefix, speculative
    # verification (few queries, long context), single token
    "prefill_gqa_bs16_m16": dict(
        kind="prefill",
        seed=11,
        seq_lens=[20, 100, 260, 33, 1],
        query_lens=[20, 37, 5, 1, 1],
        hq=8,
        hkv=2,
        d=64,
        bs=16,
        block_m=16,
    ),
    "prefill_mqa_bs32": dict(
        kind="prefill",
        seed=12,
        seq_lens=[64, 300, 70],
        query_lens=[64, 64, 3],
        hq=4,
        hkv=1,
        d=32,
        bs=32,
    ),
    "prefill_mha_d48_int32_bf16cache": dict(
        kind="prefill",
        seed=13,
        seq_lens=[40, 129],
        query_lens=[17, 50],
        hq=2,
        hkv=2,
        d=48,
        bs=16,
        table_dtype=torch.int32,
        cache_dtype=torch.bfloat16,
        block_m=32,
    ),
    "prefill_gqa_all_bf16_bs32": dict(
        kind="prefill",
        seed=14,
        seq_lens=[90, 45],
        query_lens=[30, 45],
        hq=4,
        hkv=2,
        d=32,
        bs=32,
        cache_dtype=torch.bfloat16,
        q_dtype=torch.bfloat16,
    ),
    # store
    "store_fp32_bs16": dict(kind="store", seed=21, T=40, hkv=2, d=64, bs=16),
    "store_bf16_bs32_int32_hkv3_d40": dict(
        kind="store",
        seed=22,
        T=33,
        hkv=3,
        d=40,
        bs=32,
        dtype=torch.bfloat16,
        slot_dtype=torch.int32,
    ),
    "store_fp32_into_bf16": dict(
        kind="store", seed=23, T=20, hkv=2, d=32, bs=16, cache_dtype=torch.bfloat16
    ),
    "store_noncontiguous_kv": dict(kind="store", seed=24, T=25, hkv=2, d=32, bs=16, fused=True),
    # engine.attention_triton vs engine.attention
    "engine_mixed_batch_gqa_bs16": dict(kind="engine", seed=31, bs=16, hq=8, hkv=2, d=32),
}

_BUILD_KEYS = {
    "seed",
    "seq_lens",
    "query_lens",
    "hq",
    "hkv",
    "d",
    "bs",
    "cache_dtype",
    "q_dtype",
    "table_dtype",
}


def _tol(spec: dict) -> tuple[float, float]:
    """(atol, rtol): tight for fp32 outputs; for bf16 outputs, one bf16 rounding (the
    interpreter truncates fp32 -> bf16 where torch rounds to nearest)."""
    if spec.get("q_dtype") == torch.bfloat16:
        return 2e-2, 1.6e-2
    return 2e-5, 1e-5


# --------------------------------------------------------------------------------------
# The interpreter checks (run in the subprocess)
# --------------------------------------------------------------------------------------


def _check_decode(spec: dict) -> dict:
    from pdserve.kernels import paged_decode_attention

    c = decode_case(**{k: v for k, v in spec.items() if k in _BUILD_KEYS})
    ref = paged_decode_attention_ref(c["q"], c["cache"], c["tables"], c["seq_lens"], c["scale"])
    out = paged_decode_attention(c["q"], c["cache"], c["tables"], c["seq_lens"], c["scale"])
    return _compare(out, ref, spec)


def _check_prefill(spec: dict) -> dict:
    from pdserve.kernels import paged_prefill_attention

    c = prefill_case(**{k: v for k, v in spec.items() if k in _BUILD_KEYS})
    args = (c["q"], c["cache"], c["tables"], c["qsl"], c["seq_lens"], c["scale"])
    ref = paged_prefill_attention_ref(*args)
    out = paged_prefill_attention(*args, block_m=spec.get("block_m", 64))
    return _compare(out, ref, spec)


def _store_inputs(spec: dict):
    g = torch.Generator().manual_seed(spec["seed"])
    t, hkv, d, bs = spec["T"], spec["hkv"], spec["d"], spec["bs"]
    dtype = spec.get("dtype", torch.float32)
    num_blocks = 2 + t // bs * 2 + 4
    cache = torch.randn(num_blocks, 2, bs, hkv, d, generator=g).to(spec.get("cache_dtype", dtype))
    if spec.get("fused"):  # k and v as views into one [T, 2 * Hkv, D] projection output
        kv = torch.randn(t, 2 * hkv, d, generator=g).to(dtype)
        k, v = kv[:, :hkv], kv[:, hkv:]
    else:
        k = torch.randn(t, hkv, d, generator=g).to(dtype)
        v = torch.randn(t, hkv, d, generator=g).to(dtype)
    # distinct slots, shuffled, never in the null block; every 7th token is padding (-1)
    slots = torch.randperm((num_blocks - 1) * bs, generator=g)[:t] + bs
    slots[::7] = -1
    return k, v, cache, slots.to(spec.get("slot_dtype", torch.int64))


def _check_store(spec: dict) -> dict:
    from pdserve.kernels import reshape_and_cache

    k, v, cache, slots = _store_inputs(spec)
    ref = cache.clone()
    reshape_and_cache_ref(k, v, ref, slots)
    out = cache.clone()
    reshape_and_cache(k, v, out, slots)
    if k.dtype == out.dtype:  # a copy: bit-exact
        return dict(
            max_err=(out.float() - ref.float()).abs().max().item(), ok=torch.equal(out, ref)
        )
    # fp32 -> bf16: the interpreter truncates where torch rounds; allow one bf16 ulp
    return _compare(out, ref, dict(q_dtype=torch.bfloat16))


# (context_len once this step is written, query_len): 3 decodes, a fresh prompt, a chunk
# after a cached prefix, a speculative verification (query_len 4)
ENGINE_REQS = [(1, 1), (40, 1), (97, 1), (23, 23), (70, 30), (150, 4)]
ENGINE_DECODES = 3


def engine_case(
    seed: int,
    bs: int,
    hq: int,
    hkv: int,
    d: int,
    garbage: float = 0.0,
    reqs: list[tuple[int, int]] = ENGINE_REQS,
    nd: int = ENGINE_DECODES,
):
    """A mixed batch (reqs: (context_len, query_len), the first nd of them decodes) for
    engine.attention.paged_attention."""
    from pdserve.engine.attention import AttentionMetadata, PrefillSeq

    c = build_paged(seed, [n for n, _ in reqs], bs, hkv, d, garbage=garbage)
    g = c["gen"]
    tables = c["tables"]
    t = sum(ql for _, ql in reqs)
    q = torch.randn(t, hq, d, generator=g)
    k = torch.empty(t, hkv, d)
    v = torch.empty(t, hkv, d)
    slots = torch.empty(t, dtype=torch.int64)
    cache = c["cache"].clone()
    prefills, start = [], 0
    for b, (n, ql) in enumerate(reqs):
        # this step's K/V are the request's last ql tokens: take them out of the cache
        # (garbage there) and pass them as k, v so the call has to write them back
        k[start : start + ql] = c["k"][b][n - ql :]
        v[start : start + ql] = c["v"][b][n - ql :]
        for i, pos in enumerate(range(n - ql, n)):
            blk = int(tables[b, pos // bs])
            slots[start + i] = blk * bs + pos % bs
            cache[blk, :, pos % bs] = garbage
        if b >= nd:
            nb = math.ceil(n / bs)
            prefills.append(
                PrefillSeq(
                    query_start=start,
                    query_len=ql,
                    context_len=n,
                    block_table=tables[b, :nb].clone(),
                )
            )
        start += ql
    seq_lens = torch.tensor([n for n, _ in reqs[:nd]])
    dec_tables = tables[:nd]
    mask = (torch.arange(dec_tables.shape[1] * bs)[None, :] < seq_lens[:, None])[:, None, None, :]
    meta = AttentionMetadata(
        slot_mapping=slots,
        num_decode_tokens=nd,
        decode_block_tables=dec_tables,
        decode_seq_lens=seq_lens,
        decode_mask=mask,
        prefills=prefills,
        block_size=bs,
    )
    # the engine stores KV head-major: [num_blocks, 2, Hkv, block_size, D]
    engine_cache = cache.transpose(2, 3).contiguous()
    return dict(q=q, k=k, v=v, cache=engine_cache, meta=meta, scale=d**-0.5, dense=c)


def _check_engine(spec: dict) -> dict:
    from pdserve.engine.attention import paged_attention
    from pdserve.engine.attention_triton import triton_paged_attention

    c = engine_case(spec["seed"], spec["bs"], spec["hq"], spec["hkv"], spec["d"])
    cache_ref, cache_out = c["cache"].clone(), c["cache"].clone()
    ref = paged_attention(c["q"], c["k"], c["v"], cache_ref, c["meta"], c["scale"])
    out = triton_paged_attention(c["q"], c["k"], c["v"], cache_out, c["meta"], c["scale"])
    res = _compare(out, ref, spec)
    res["ok"] = res["ok"] and torch.equal(cache_out, cache_ref)
    return res


def _compare(out: torch.Tensor, ref: torch.Tensor, spec: dict) -> dict:
    atol, rtol = _tol(spec)
    out, ref = out.float(), ref.float()
    return dict(
        max_err=(out - ref).abs().max().item(),
        ok=bool(torch.allclose(out, ref, atol=atol, rtol=rtol)) and not out.isnan().any().item(),
    )


def run_checks(cases: list[tuple[str, Callable[[dict], dict], dict]]) -> dict:
    """{name: check(spec) with its seconds} of each (name, check, spec); an exception is a
    failed result carrying its traceback (the pytest side reports it)."""
    results = {}
    for name, check, spec in cases:
        t0 = time.perf_counter()
        try:
            res = check(spec)
        except Exception:
            res = dict(ok=False, error=traceback.format_exc())
        res["seconds"] = round(time.perf_counter() - t0, 3)
        results[name] = res
    return results


def interpreter_results_of(script: str) -> dict:
    """Run a test module as a script under TRITON_INTERPRET=1 (set before triton is imported:
    a process of its own) and return the results it prints."""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(REPO))
    proc = subprocess.run(
        [sys.executable, script], cwd=REPO, env=env, capture_output=True, text=True, timeout=600
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULTS ")]
    assert proc.returncode == 0 and lines, f"interpreter run failed:\n{proc.stdout}\n{proc.stderr}"
    return json.loads(lines[-1][len("RESULTS ") :])


def run_interpreter_checks(names: list[str]) -> dict:
    check = dict(
        decode=_check_decode, prefill=_check_prefill, store=_check_store, engine=_check_engine
    )
    return run_checks([(name, check[CASES[name]["kind"]], CASES[name]) for name in names])


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET") == "1"
    torch.set_num_threads(1)
    print("RESULTS " + json.dumps(run_interpreter_checks(sys.argv[1:] or list(CASES))))
    sys.exit(0)


# --------------------------------------------------------------------------------------
# pytest: the kernels (via the interpreter subprocess)
# --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def interpreter_results() -> dict:
    return interpreter_results_of(__file__)


@pytest.mark.parametrize("name", list(CASES))
def test_kernel_matches_reference(interpreter_results: dict, name: str) -> None:
    res = interpreter_results[name]
    assert "error" not in res, res["error"]
    assert res["ok"], f"{name}: max abs err {res['max_err']}"


def test_triton_available_is_false_without_cuda() -> None:
    from pdserve.kernels import triton_available

    assert triton_available() == torch.cuda.is_available()


# --------------------------------------------------------------------------------------
# pytest: the references against dense, unpaged attention (in-process, no Triton)
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("hq,hkv,bs", [(4, 2, 16), (3, 1, 32), (2, 2, 16)])
def test_decode_ref_matches_dense(hq: int, hkv: int, bs: int) -> None:
    c = decode_case(seed=41 + hq, seq_lens=[1, 16, 17, 75], hq=hq, hkv=hkv, d=16, bs=bs)
    out = paged_decode_attention_ref(c["q"], c["cache"], c["tables"], c["seq_lens"], c["scale"])
    assert not out.isnan().any()
    for b in range(len(c["k"])):
        want = naive_causal(c["q"][b : b + 1], c["k"][b], c["v"][b], c["scale"])[0]
        torch.testing.assert_close(out[b].double(), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("hq,hkv,bs", [(4, 2, 16), (3, 1, 32), (2, 2, 16)])
def test_prefill_ref_matches_dense(hq: int, hkv: int, bs: int) -> None:
    seq_lens, query_lens = [9, 50, 70, 33], [9, 18, 3, 1]  # fresh, chunk, spec verify, 1 token
    c = prefill_case(
        seed=51 + hq, seq_lens=seq_lens, query_lens=query_lens, hq=hq, hkv=hkv, d=16, bs=bs
    )
    out = paged_prefill_attention_ref(
        c["q"], c["cache"], c["tables"], c["qsl"], c["seq_lens"], c["scale"]
    )
    assert not out.isnan().any()
    for b in range(len(seq_lens)):
        rows = slice(int(c["qsl"][b]), int(c["qsl"][b + 1]))
        want = naive_causal(c["q"][rows], c["k"][b], c["v"][b], c["scale"])
        torch.testing.assert_close(out[rows].double(), want, atol=1e-5, rtol=1e-5)


def test_prefill_ref_with_one_query_equals_decode_ref() -> None:
    c = decode_case(seed=61, seq_lens=[3, 32, 33, 90], hq=4, hkv=1, d=16, bs=16)
    qsl = torch.arange(len(c["k"]) + 1)
    pre = paged_prefill_attention_ref(
        c["q"], c["cache"], c["tables"], qsl, c["seq_lens"], c["scale"]
    )
    dec = paged_decode_attention_ref(c["q"], c["cache"], c["tables"], c["seq_lens"], c["scale"])
    torch.testing.assert_close(pre, dec)


def test_reshape_and_cache_ref_writes_each_slot() -> None:
    spec = dict(seed=71, T=30, hkv=2, d=8, bs=16)
    k, v, cache, slots = _store_inputs(spec)
    out = cache.clone()
    reshape_and_cache_ref(k, v, out, slots)
    want = cache.clone()
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            want[slot // 16, 0, slot % 16] = k[t]
            want[slot // 16, 1, slot % 16] = v[t]
    assert torch.equal(out, want)
    assert not torch.equal(out, cache)


def _assert_engine_case_matches_dense(c: dict, reqs: list[tuple[int, int]]) -> None:
    """engine.attention.paged_attention on an engine_case equals dense causal attention."""
    from pdserve.engine.attention import paged_attention

    out = paged_attention(c["q"], c["k"], c["v"], c["cache"].clone(), c["meta"], c["scale"])
    dense = c["dense"]
    start = 0
    for b, (_, ql) in enumerate(reqs):
        want = naive_causal(c["q"][start : start + ql], dense["k"][b], dense["v"][b], c["scale"])
        torch.testing.assert_close(out[start : start + ql].double(), want, atol=1e-5, rtol=1e-5)
        start += ql


@pytest.mark.parametrize("seed", [5, 6])
def test_engine_prefill_query_lengths_around_the_sdpa_padding(seed: int) -> None:
    """Fresh prompts and chunks after cached context whose query lengths are and are not
    multiples of the 32 rows the CPU path pads SDPA's queries to: the same as dense attention."""
    reqs = [(33, 33), (64, 64), (45, 45), (130, 70), (200, 96), (100, 33), (40, 40)]
    c = engine_case(seed=seed, bs=16, hq=6, hkv=2, d=16, reqs=reqs, nd=0)
    _assert_engine_case_matches_dense(c, reqs)


def test_engine_case_refs_agree() -> None:
    """The engine's torch paged_attention on the engine case matches the dense attention,
    so the engine check in the interpreter compares against a right answer."""
    c = engine_case(seed=31, bs=16, hq=4, hkv=2, d=16)
    _assert_engine_case_matches_dense(c, ENGINE_REQS)
