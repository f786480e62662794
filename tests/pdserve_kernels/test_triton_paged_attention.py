"""Split-K paged decode, GQA-shared paged prefill, sliding windows and the fp8 KV cache vs the
torch references, under Triton's CPU interpreter, in fp32 (and fp16/bf16 inputs computed in
fp32).

As in test_kernels.py, the kernels run in a subprocess (this file as a script, with
``TRITON_INTERPRET=1`` set before triton is imported); each test asserts on its case's result.
The checks of the references themselves (fp8 quantization, the automatic split count) run
in-process.
"""

from __future__ import annotations

import os

if __name__ == "__main__":  # the interpreter subprocess: before triton is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import json
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).parent))

from test_kernels import (  # noqa: E402
    build_paged,
    interpreter_results_of,
    naive_causal,
    run_checks,
)

from pdserve.kernels.reference import (  # noqa: E402
    FP8_MAX,
    paged_decode_attention_ref,
    paged_prefill_attention_ref,
    quantize,
    reshape_and_cache_ref,
)

FP8 = torch.float8_e4m3fn


def split_lens(num_splits: int, bs: int) -> list[int]:
    """A mixed batch around a partition boundary of num_splits partitions of two blocks each
    (P = num_splits * 2 * bs tokens): P - 1, P, P + 1 (one more block: partitions of three
    blocks, the last ones short or empty), plus 1-token, one-block and empty requests (most
    partitions empty)."""
    p = num_splits * 2 * bs
    return [p - 1, 1, p, bs, p + 1, bs + 1, 0]


# Decode cases: GQA ratios 8, 1, 3, 4 (and MQA 8 with the automatic split count), key tiles
# smaller than, equal to and larger than a block, head dims 32/40/64.
DECODE = {
    "decode_s1_gqa8_bn16": dict(splits=1, hq=8, hkv=1, d=32, bs=16, block_n=16),
    "decode_s2_mha_d40_bn32": dict(splits=2, hq=4, hkv=4, d=40, bs=16, block_n=32),
    "decode_s3_gqa3_bs32_bn16_int32": dict(
        splits=3, hq=6, hkv=2, d=32, bs=32, block_n=16, table_dtype=torch.int32
    ),
    "decode_s7_gqa4_bn64": dict(splits=7, hq=8, hkv=2, d=64, bs=16, block_n=64),
    # auto: B=2 MQA programs on the interpreter's 4 stand-in SMs: 4 splits of the longest
    "decode_auto_mqa8": dict(splits=None, lens=[1, 513], hq=8, hkv=1, d=32, bs=16, block_n=32),
    "decode_s3_fp16": dict(splits=3, hq=4, hkv=2, d=32, bs=16, block_n=32, dtype=torch.float16),
}

# Prefill cases: (seq_len, query_len) pairs with cached prefixes of 0 tokens, exactly one
# block, one block +-1, many blocks, one key tile - 2 (the first row sees all but the last
# key of that tile), a speculative verification and a single token; rows = positions x group
# heads with 16/32/64 rows (positions per tile 16, 10, 8, 2).
PREFILL = {
    "prefill_mha_m16_bn16": dict(
        lens=[20, 100, 260, 33, 1, 30],
        qlens=[20, 37, 5, 1, 1, 16],
        hq=2,
        hkv=2,
        d=32,
        bs=16,
        m=16,
        n=16,
    ),
    "prefill_gqa3_m32_bn64": dict(
        lens=[40, 31, 50, 80], qlens=[24, 16, 33, 33], hq=6, hkv=2, d=32, bs=16, m=32, n=64
    ),
    "prefill_gqa4_bs32_m64_bn16_int32": dict(
        lens=[64, 97, 40],
        qlens=[64, 33, 8],
        hq=8,
        hkv=2,
        d=32,
        bs=32,
        m=64,
        n=16,
        table_dtype=torch.int32,
    ),  # fmt: skip
    "prefill_gqa8_d40_m16_bn32": dict(
        lens=[17, 70, 48], qlens=[17, 6, 15], hq=8, hkv=1, d=40, bs=16, m=16, n=32
    ),
    "prefill_gqa4_bf16": dict(
        lens=[45, 90], qlens=[45, 30], hq=4, hkv=1, d=32, bs=16, m=32, n=32, dtype=torch.bfloat16
    ),
}

# Sliding windows (each case runs every window of "windows"): windows smaller than, equal to
# and larger than the contexts, starting mid-block and at block boundaries (lens around
# multiples of the block size), one key (window 1), a block (16), over split counts 1/2/3 and
# auto. The K/V no query may see (before each request's window) are NaN in the kernel's cache:
# a kernel that reads them (or ignores the window) fails.
DECODE_WINDOW = {
    "decode_window_s1_gqa4_bn16": dict(
        splits=1, lens=[1, 16, 20, 32, 47, 48, 100, 0], windows=(1, 16, 20), hq=8, hkv=2, d=32,
        bs=16, block_n=16,
    ),
    "decode_window_s2_mha_bn32": dict(
        splits=2, lens=[1, 20, 21, 36, 40, 90, 130], windows=(20, 32, 90), hq=2, hkv=2, d=32,
        bs=16, block_n=32,
    ),
    "decode_window_s3_gqa3_bs32_int32": dict(
        splits=3, lens=[50, 100, 101, 150, 260, 0], windows=(64, 100, 1000), hq=6, hkv=2,
        d=32, bs=32, block_n=16, table_dtype=torch.int32,
    ),
    # auto: 4 splits without the window; a window of 300 touches at most 20 blocks: 2 splits
    "decode_window_auto_mqa8": dict(
        splits=None, lens=[1, 513], windows=(300, 37), hq=8, hkv=1, d=32, bs=16, block_n=32,
        auto_splits=2,
    ),
}  # fmt: skip

# Windowed prefill: a prefix hit whose first query's window starts inside the cached prefix
# (mid-block), chunks longer than the window, windows narrower than a query tile's positions
# (no key tile every row sees), a window of 1 and one longer than every context; GQA.
PREFILL_WINDOW = {
    "prefill_window_gqa4_m32_bn16": dict(
        lens=[100, 80, 40, 17, 300], qlens=[30, 80, 8, 17, 50], windows=(40, 16), hq=8, hkv=2,
        d=32, bs=16, m=32, n=16,
    ),
    "prefill_window_mha_m16_bn16": dict(
        lens=[64, 50, 33], qlens=[64, 20, 1], windows=(5, 1), hq=1, hkv=1, d=32, bs=16, m=16,
        n=16,
    ),
    "prefill_window_gqa3_bs32_m64_bn64_int32": dict(
        lens=[130, 97, 70], qlens=[33, 97, 3], windows=(33, 1000), hq=6, hkv=2, d=32, bs=32,
        m=64, n=64, table_dtype=torch.int32,
    ),
}  # fmt: skip

# fp8 round trips: the Triton store quantizes K/V into an fp8 cache, the kernels read it back.
FP8_CASES = {
    "fp8_store_bitexact": dict(kind="store"),
    "fp8_decode_roundtrip": dict(kind="decode", splits=(1, 3)),
    "fp8_prefill_roundtrip": dict(kind="prefill"),
}

TOL = dict(atol=2e-5, rtol=1e-5)  # fp32 math vs fp64
K_SCALE, V_SCALE = 0.02, 0.01  # K of every 5th token (x40) saturates at +-448


def _compare(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype = torch.float32) -> dict:
    """ok: allclose at fp32 tolerance (one 16-bit rounding of the output for 16-bit outputs)
    and no NaN."""
    atol, rtol = {torch.float32: (2e-5, 1e-5), torch.float16: (2e-3, 2e-3)}.get(dtype, (2e-2, 2e-2))
    out, ref = out.float(), ref.float()
    close = bool(torch.allclose(out, ref, atol=atol, rtol=rtol))
    return dict(max_err=(out - ref).abs().max().item(), ok=close and not out.isnan().any().item())


def _paged(spec: dict, lens: list[int]) -> dict:
    """build_paged for a case spec: NaN in every slot no request owns."""
    dtype, table_dtype = spec.get("dtype", torch.float32), spec.get("table_dtype", torch.int64)
    return build_paged(sum(lens), lens, spec["bs"], spec["hkv"], spec["d"], dtype, table_dtype)


def _poison_before(cache: torch.Tensor, tables: torch.Tensor, starts: list[int]) -> torch.Tensor:
    """A copy of cache with request b's K/V at positions < starts[b] set to NaN: keys no query
    sees, which a windowed kernel must not read (masking is not enough: 0 * NaN V = NaN)."""
    cache, bs = cache.clone(), cache.shape[2]
    for b, start in enumerate(starts):
        for pos in range(start):
            cache[int(tables[b, pos // bs]), :, pos % bs] = float("nan")
    return cache


def _merge(results: list[dict]) -> dict:
    return dict(
        max_err=max(r["max_err"] for r in results), ok=all(r["ok"] for r in results)
    )  # fmt: skip


def _check_decode(spec: dict) -> dict:
    from pdserve.kernels import paged_decode_attention
    from pdserve.kernels.paged_decode import auto_num_splits

    dtype = spec.get("dtype", torch.float32)
    lens = spec.get("lens") or split_lens(spec["splits"], spec["bs"])
    c = _paged(spec, lens)
    q = torch.randn(len(lens), spec["hq"], spec["d"], generator=c["gen"]).to(dtype)
    seq = torch.tensor(lens, dtype=c["tables"].dtype)
    results = []
    for window in spec.get("windows", (None,)):
        args = (q, c["cache"], c["tables"], seq, spec["d"] ** -0.5)
        ref = paged_decode_attention_ref(*args, window=window)
        if window is not None:
            poisoned = _poison_before(c["cache"], c["tables"], [max(0, n - window) for n in lens])
            args = (q, poisoned, c["tables"], seq, spec["d"] ** -0.5)
        out = paged_decode_attention(
            *args, num_splits=spec["splits"], block_n=spec["block_n"], window=window
        )
        results.append(_compare(out, ref, dtype))
    res = _merge(results)
    if spec["splits"] is None:  # the split count chosen: it must have split
        window = spec.get("windows", (None,))[0]
        chosen = auto_num_splits(
            len(lens), spec["hkv"], c["tables"].shape[1], spec["bs"], q.device, window
        )
        want = spec.get("auto_splits")
        res.update(num_splits=chosen, ok=res["ok"] and chosen > 1 and want in (None, chosen))
    return res


def _check_prefill(spec: dict) -> dict:
    from pdserve.kernels import paged_prefill_attention

    dtype = spec.get("dtype", torch.float32)
    lens, qlens = spec["lens"], spec["qlens"]
    c = _paged(spec, lens)
    q = torch.randn(sum(qlens), spec["hq"], spec["d"], generator=c["gen"]).to(dtype)
    qsl = torch.tensor([0, *torch.tensor(qlens).cumsum(0).tolist()], dtype=c["tables"].dtype)
    seq = torch.tensor(lens, dtype=c["tables"].dtype)
    results = []
    for window in spec.get("windows", (None,)):
        args = (q, c["cache"], c["tables"], qsl, seq, spec["d"] ** -0.5)
        ref = paged_prefill_attention_ref(*args, window=window)
        if window is not None:  # keys before the first query's window: seen by no query
            starts = [max(0, n - ql - window + 1) for n, ql in zip(lens, qlens, strict=True)]
            poisoned = _poison_before(c["cache"], c["tables"], starts)
            args = (q, poisoned, c["tables"], qsl, seq, spec["d"] ** -0.5)
        out = paged_prefill_attention(*args, block_m=spec["m"], block_n=spec["n"], window=window)
        results.append(_compare(out, ref, dtype))
    return _merge(results)


def fp8_source(seed: int, lens: list[int], hkv: int, d: int, bs: int) -> dict:
    """A batch's fp32 K/V as this step's tokens (k, v [T, Hkv, D], T = sum(lens)), their
    slots in shuffled blocks, an fp8 cache (NaN-free zeros: fp8 has no room for the NaN
    garbage and the kernels never read unowned slots) and the block tables."""
    c = build_paged(seed, lens, bs, hkv, d)
    k, v = torch.cat(c["k"]), torch.cat(c["v"])
    k[::5] *= 40.0  # some values past K_SCALE * 448: saturated
    v[1::5] *= 2e-3  # values around V_SCALE * 2^-6: fp8 subnormals and the smallest normals
    tables = c["tables"]
    slots = [int(tables[b, i // bs]) * bs + i % bs for b, n in enumerate(lens) for i in range(n)]
    cache = torch.zeros(c["cache"].shape, dtype=FP8)
    return dict(k=k, v=v, slots=torch.tensor(slots), cache=cache, tables=c["tables"], gen=c["gen"])


def _check_fp8(spec: dict) -> dict:
    from pdserve.kernels import paged_decode_attention, paged_prefill_attention, reshape_and_cache

    lens, hq, hkv, d, bs = [1, 33, 100, 16], 8, 2, 32, 16
    src = fp8_source(7, lens, hkv, d, bs)
    ref_cache, cache = src["cache"].clone(), src["cache"].clone()
    reshape_and_cache_ref(src["k"], src["v"], ref_cache, src["slots"], K_SCALE, V_SCALE)
    reshape_and_cache(src["k"], src["v"], cache, src["slots"], k_scale=K_SCALE, v_scale=V_SCALE)
    stored = bool(torch.equal(cache.view(torch.uint8), ref_cache.view(torch.uint8)))
    if spec["kind"] == "store":  # also from 16-bit K/V; max_err: bytes that differ
        saturated = int((cache.float().abs() == FP8_MAX).sum())
        diff = int((cache.view(torch.uint8) != ref_cache.view(torch.uint8)).sum())
        for dtype in (torch.bfloat16, torch.float16):
            k, v, slots = src["k"].to(dtype), src["v"].to(dtype), src["slots"]
            ref_cache, cache = src["cache"].clone(), src["cache"].clone()
            reshape_and_cache_ref(k, v, ref_cache, slots, K_SCALE, V_SCALE)
            reshape_and_cache(k, v, cache, slots, k_scale=K_SCALE, v_scale=V_SCALE)
            diff += int((cache.view(torch.uint8) != ref_cache.view(torch.uint8)).sum())
        return dict(max_err=diff, saturated=saturated, ok=stored and diff == 0 and saturated > 0)
    scales = dict(k_scale=K_SCALE, v_scale=V_SCALE)
    seq = torch.tensor(lens)
    if spec["kind"] == "decode":
        q = torch.randn(len(lens), hq, d, generator=src["gen"])
        args = (q, cache, src["tables"], seq, d**-0.5)
        ref = paged_decode_attention_ref(*args, **scales)
        outs = [paged_decode_attention(*args, num_splits=s, **scales) for s in spec["splits"]]
        results = [_compare(out, ref) for out in outs]
        return dict(
            max_err=max(r["max_err"] for r in results),
            ok=stored and all(r["ok"] for r in results),
        )
    qlens = [1, 20, 37, 16]
    q = torch.randn(sum(qlens), hq, d, generator=src["gen"])
    qsl = torch.tensor([0, *torch.tensor(qlens).cumsum(0).tolist()])
    args = (q, cache, src["tables"], qsl, seq, d**-0.5)
    out = paged_prefill_attention(*args, block_m=32, block_n=16, **scales)
    res = _compare(out, paged_prefill_attention_ref(*args, **scales))
    return dict(res, ok=res["ok"] and stored)


def run_interpreter_checks() -> dict:
    cases = [(n, _check_decode, s) for n, s in {**DECODE, **DECODE_WINDOW}.items()]
    cases += [(n, _check_prefill, s) for n, s in {**PREFILL, **PREFILL_WINDOW}.items()]
    cases += [(n, _check_fp8, s) for n, s in FP8_CASES.items()]
    return run_checks(cases)


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET") == "1"
    torch.set_num_threads(1)
    print("RESULTS " + json.dumps(run_interpreter_checks()))
    sys.exit(0)


# --------------------------------------------------------------------------------------
# pytest: the kernels (via the interpreter subprocess)
# --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def interpreter_results() -> dict:
    return interpreter_results_of(__file__)


@pytest.mark.parametrize("name", [*DECODE, *DECODE_WINDOW, *PREFILL, *PREFILL_WINDOW, *FP8_CASES])
def test_triton_kernel_matches_reference(interpreter_results: dict, name: str) -> None:
    res = interpreter_results[name]
    assert "error" not in res, res["error"]
    assert res["ok"], f"{name}: {res}"


# --------------------------------------------------------------------------------------
# pytest: the automatic split count and the fp8 references (in-process, no kernel runs)
# --------------------------------------------------------------------------------------


def test_auto_num_splits_fills_the_sms_and_stops_at_the_context(monkeypatch) -> None:
    from pdserve.kernels import paged_decode

    cpu = torch.device("cpu")  # 4 stand-in SMs: a target of 8 programs
    assert paged_decode.auto_num_splits(1, 8, 512, 16, cpu) == 1  # 8 programs already
    assert paged_decode.auto_num_splits(1, 1, 512, 16, cpu) == 8
    assert paged_decode.auto_num_splits(2, 1, 512, 16, cpu) == 4
    assert paged_decode.auto_num_splits(1, 1, 16, 16, cpu) == 2  # 256 keys: 2 x 128
    assert paged_decode.auto_num_splits(1, 1, 7, 16, cpu) == 1  # 112 keys: no split
    monkeypatch.setattr(paged_decode, "multiprocessor_count", lambda device: 132)  # an H200
    assert paged_decode.auto_num_splits(1, 8, 512, 16, cpu) == 33  # B=1, ctx 8192
    assert paged_decode.auto_num_splits(8, 8, 512, 16, cpu) == 5
    assert paged_decode.auto_num_splits(64, 8, 512, 16, cpu) == 1
    assert paged_decode.auto_num_splits(1, 1, 4096, 16, cpu) == 64  # capped at MAX_SPLITS
    # a window of 512 touches at most 33 blocks of 16: the context the splits divide
    assert paged_decode.auto_num_splits(1, 1, 4096, 16, cpu, window=512) == 4
    assert paged_decode.auto_num_splits(1, 8, 512, 16, cpu, window=512) == 4  # (33 without)
    assert paged_decode.auto_num_splits(1, 1, 4096, 16, cpu, window=100) == 1  # 8 blocks


def test_window_references_match_dense_attention() -> None:
    """The windowed references against dense attention over each query's window (keys at
    positions (p - window, p]), and window None/0/longer than the context as no window."""
    lens, hq, hkv, d, bs = [1, 20, 45], 4, 2, 16, 16
    c = build_paged(5, lens, bs, hkv, d, garbage=0.0)
    seq, scale = torch.tensor(lens), d**-0.5
    qlens = [1, 9, 45]
    q = torch.randn(sum(qlens), hq, d, generator=c["gen"])
    qsl = torch.tensor([0, *torch.tensor(qlens).cumsum(0).tolist()])
    for window in (1, 7, 16):
        pre = paged_prefill_attention_ref(
            q, c["cache"], c["tables"], qsl, seq, scale, window=window
        )
        for b, (n, ql) in enumerate(zip(lens, qlens, strict=True)):
            for i in range(ql):
                pos, lo = n - ql + i, max(0, n - ql + i - window + 1)
                k, v = c["k"][b][lo : pos + 1], c["v"][b][lo : pos + 1]
                want = naive_causal(q[qsl[b] + i][None], k, v, scale)[0]
                torch.testing.assert_close(pre[qsl[b] + i].double(), want, **TOL)
        last = qsl[1:] - 1  # each request's last query: its decode
        dec = paged_decode_attention_ref(
            q[last], c["cache"], c["tables"], seq, scale, window=window
        )
        torch.testing.assert_close(dec, pre[last], **TOL)
    whole = paged_prefill_attention_ref(q, c["cache"], c["tables"], qsl, seq, scale)
    for window in (0, 45, 1000):
        got = paged_prefill_attention_ref(
            q, c["cache"], c["tables"], qsl, seq, scale, window=window
        )
        torch.testing.assert_close(got, whole, **TOL)


def test_fp8_quantize_rounds_to_nearest_and_saturates() -> None:
    grid = torch.arange(256, dtype=torch.uint8).view(FP8).float()
    grid = grid[grid.isfinite()]
    # values on the fp8 grid (times the scale) come back exactly
    assert torch.equal(quantize(grid * 0.5, 0.5, FP8).float(), grid)
    x = torch.randn(10_000, generator=torch.Generator().manual_seed(0)) * 100
    back = quantize(x, 2.0, FP8).float() * 2.0
    stored = (x / 2.0).abs()
    inside = (stored >= 2**-6) & (stored <= FP8_MAX)  # normals: 3 mantissa bits
    rel = ((back - x).abs() / x.abs())[inside]
    assert 0 < rel.max().item() <= 2**-4  # half an ulp: rounded to nearest, not truncated
    assert torch.equal(back[x / 2.0 > FP8_MAX], torch.full_like(back[x / 2.0 > FP8_MAX], 896.0))
    with pytest.raises(AssertionError, match="float8_e4m3fn cache only"):
        quantize(x, 2.0, torch.bfloat16)


def test_fp8_references_track_the_fp32_attention() -> None:
    """Decode and prefill references on an fp8 cache stay within fp8's rounding of the same
    attention on the unquantized K/V: the scales are applied, and in the right direction."""
    lens, hq, hkv, d, bs = [5, 40, 70], 4, 2, 16, 16
    c = build_paged(3, lens, bs, hkv, d, garbage=0.0)
    k8, v8 = quantize(c["cache"][:, 0], K_SCALE, FP8), quantize(c["cache"][:, 1], V_SCALE, FP8)
    cache8 = torch.stack([k8, v8], 1)
    q = torch.randn(len(lens), hq, d, generator=c["gen"])
    seq = torch.tensor(lens)
    scales = dict(k_scale=K_SCALE, v_scale=V_SCALE)
    out = paged_decode_attention_ref(q, cache8, c["tables"], seq, d**-0.5, **scales)
    for b in range(len(lens)):
        want = naive_causal(q[b : b + 1], c["k"][b], c["v"][b], d**-0.5)[0]
        torch.testing.assert_close(out[b].double(), want, atol=0.08, rtol=0.08)
    qsl = torch.arange(len(lens) + 1)
    pre = paged_prefill_attention_ref(q, cache8, c["tables"], qsl, seq, d**-0.5, **scales)
    torch.testing.assert_close(pre, out)


def test_kernels_refuse_scales_on_a_non_fp8_cache() -> None:
    from pdserve.kernels import paged_decode_attention, reshape_and_cache

    cache = torch.zeros(2, 2, 16, 1, 16)
    x = torch.zeros(1, 1, 16)
    with pytest.raises(AssertionError, match="float8_e4m3fn cache only"):
        reshape_and_cache(x, x, cache, torch.zeros(1, dtype=torch.int64), k_scale=0.5)
    table, seq = torch.zeros(1, 1, dtype=torch.int64), torch.ones(1, dtype=torch.int64)
    with pytest.raises(AssertionError, match="float8_e4m3fn cache only"):
        paged_decode_attention(x, cache, table, seq, 1.0, v_scale=2.0)
