"""Validate and time the Triton kernels of pdserve.kernels on one GPU, in one prepared run.

    # the GPU run (one H200, a few minutes; the repo installed with `pip install --no-deps .`)
    python benchmarks/gpu_kernels.py --out benchmarks/results/gpu_kernels.json
    # the same script on this CPU, under Triton's interpreter: tiny shapes, fp32, seconds
    TRITON_INTERPRET=1 .venv/bin/python benchmarks/gpu_kernels.py --device cpu --smoke \
        --out /tmp/gpu_kernels_smoke.json
    # a rerun of some sections only, e.g. after a timeout
    python benchmarks/gpu_kernels.py --sections environment,decode --budget-s 120
    python benchmarks/gpu_kernels.py --help

Sections, each in its own try/except (an error is recorded and the run goes on), the JSON
rewritten after each one (and after each timed shape), the remaining ones skipped once
--budget-s is spent (the summary always runs):
  environment  torch/triton versions, device name, SM count, memory, measured copy bandwidth
  correctness  paged decode, paged prefill and KV store vs their torch references
               (pdserve.kernels.reference) over dtypes, block sizes 16/32, GQA 32/8 D128 and
               9/3 D64 (SmolLM2), mixed lengths 0..2049 in shuffled non-contiguous blocks, NaN
               in every slot no request owns, the cache in the kernels' token-major layout
               and in the engine's head-major one (a strided view, as engine/attention_triton
               passes it); and each kernel on an fp8 (float8_e4m3fn, scaled) cache
  decode       paged decode: Triton (automatic split-K, fixed split counts, an fp8 cache) vs
               the torch reference vs SDPA on gathered contiguous K/V (gather excluded and
               included; flash SDPA forced: the dense-equivalent problem, and the time ratio
               Triton / flash SDPA); us, KV bytes read / time, fraction of peak
  prefill      paged prefill (one prompt; a chunk after cached context) vs causal SDPA on
               contiguous tensors; us and TFLOP/s, per BLOCK_M (query rows: tokens x group
               heads), on the bf16 and on an fp8 cache
  store        reshape_and_cache into the bench dtype and into fp8: tokens/s and GB/s, vs the
               torch reference
  summary      markdown tables, logged and stored in the JSON ("summary_markdown")

Exit status 0 when no section failed and every correctness case passed, else 1.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import json
import logging
import math
import os
import platform
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

logger = logging.getLogger("gpu_kernels")

H200_PEAK_TBPS = 4.8  # HBM3e datasheet peak; a device-to-device copy measured ~4.3 TB/s

# Tolerance on max |out - ref| / max |ref|, per token (the scale of that token's output: a
# 1-token context outputs one V row, ~1; a 2049-token one averages to ~0.05).
# fp32: exact ieee dots on both sides, only the summation order differs (~1e-6).
# bf16 (8-bit mantissa, ulp 2^-8 ~ 4e-3): the kernel rounds P to bf16 before P @ V and rounds
# the output once more; 2e-2 is ~5 ulp of the token's largest element.
# fp16 (11-bit mantissa, ulp ~1e-3): the same roundings; 5e-3 is ~5 ulp.
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 5e-3}
LAYOUTS = ("token_major", "head_major")  # kernel/reference order; the engine's memory order
FP8 = torch.float8_e4m3fn
FP8_SCALES = {"k_scale": 0.02, "v_scale": 0.01}
"""K/V scales of every fp8 cache here: randn values stored as value / scale, within +-448
but for the rare |K| > 8.96 (saturated, as the reference does too)."""


@dataclasses.dataclass(frozen=True)
class Plan:
    """The shapes one run covers: the GPU plan or the CPU smoke plan."""

    dtypes: tuple[torch.dtype, ...]
    """Cache and query dtypes the correctness cases cover."""
    fp8_query_dtypes: tuple[torch.dtype, ...]
    """Query dtypes of the correctness cases on an fp8 cache (first block size only: each
    new dtype/shape combination costs a compile)."""
    block_sizes: tuple[int, ...]
    """Tokens per KV block in the correctness cases."""
    head_configs: tuple[tuple[int, int, int], ...]
    """(query heads, KV heads, head_dim) of the correctness cases."""
    decode_seq_lens: tuple[int, ...]
    """Context lengths of one decode batch (0 = a padding request)."""
    prefill_seq_lens: tuple[int, ...]
    """Context lengths of one prefill batch, this step's tokens included."""
    prefill_query_lens: tuple[int, ...]
    """This step's tokens per prefill request (== seq_len: fresh prompt; less: a chunk or a
    speculative verification after cached context)."""
    store_tokens: int
    """Tokens one KV-store correctness case writes."""
    bench_heads: tuple[int, int, int]
    """(Hq, Hkv, D) of every timed shape."""
    bench_dtype: torch.dtype
    bench_block_size: int
    decode_batches: tuple[int, ...]
    decode_contexts: tuple[int, ...]
    decode_fixed_splits: tuple[int, ...]
    """num_splits values timed next to the automatic choice (num_splits=None)."""
    prefill_cases: tuple[tuple[str, int, int], ...]
    """(name, seq_len, query_len) of the timed prefills (one request each)."""
    prefill_block_ms: tuple[int, ...]
    """BLOCK_M values (query tokens per program) the prefill timing tries."""
    store_bench_tokens: int
    warmup: int
    """Calls before timing (the first also compiles)."""
    max_reps: int
    """Timed calls at most per measurement (fewer if --max-measure-s runs out)."""


GPU_PLAN = Plan(
    dtypes=(torch.float32, torch.bfloat16, torch.float16),
    fp8_query_dtypes=(torch.bfloat16,),
    block_sizes=(16, 32),
    head_configs=((32, 8, 128), (9, 3, 64)),
    decode_seq_lens=(1, 7, 16, 17, 100, 513, 2049, 0),
    prefill_seq_lens=(1, 7, 16, 17, 100, 513, 2049),
    prefill_query_lens=(1, 7, 16, 4, 100, 200, 300),
    store_tokens=257,
    bench_heads=(32, 8, 128),
    bench_dtype=torch.bfloat16,
    bench_block_size=16,
    decode_batches=(1, 8, 64, 256),
    decode_contexts=(512, 2048, 8192),
    decode_fixed_splits=(1, 16),
    prefill_cases=(
        ("prompt_1024", 1024, 1024),
        ("prompt_4096", 4096, 4096),
        ("chunk_512_after_3584", 4096, 512),
    ),
    prefill_block_ms=(32, 64, 128),
    store_bench_tokens=4096,
    warmup=3,
    max_reps=50,
)

SMOKE_PLAN = Plan(
    dtypes=(torch.float32,),
    fp8_query_dtypes=(torch.float32,),
    block_sizes=(16, 32),
    head_configs=((4, 2, 32), (9, 3, 64)),
    decode_seq_lens=(1, 7, 16, 17, 70, 0),
    prefill_seq_lens=(1, 7, 16, 17, 70),
    prefill_query_lens=(1, 7, 16, 4, 30),
    store_tokens=40,
    bench_heads=(4, 2, 32),
    bench_dtype=torch.float32,
    bench_block_size=16,
    decode_batches=(2,),
    decode_contexts=(48,),
    decode_fixed_splits=(1, 3),
    prefill_cases=(("prompt_32", 32, 32), ("chunk_16_after_32", 48, 16)),
    prefill_block_ms=(16,),
    store_bench_tokens=64,
    warmup=1,
    max_reps=2,
)


@dataclasses.dataclass(frozen=True)
class CaseSpec:
    """One correctness case: a kernel on one dtype, block size, head config and layout."""

    kernel: str  # decode | prefill | store
    dtype: torch.dtype
    block_size: int
    hq: int
    hkv: int
    head_dim: int
    layout: str
    fp8_cache: bool = False
    """The cache is float8_e4m3fn (scaled by FP8_SCALES); dtype is then the queries'."""

    @property
    def index_dtype(self) -> torch.dtype:
        """Block tables, lengths and slots: int32 with bs 32, int64 with bs 16 (both work)."""
        return torch.int32 if self.block_size == 32 else torch.int64

    @property
    def scales(self) -> dict[str, float]:
        """The kernels' k_scale/v_scale keywords: FP8_SCALES on an fp8 cache, else none."""
        return FP8_SCALES if self.fp8_cache else {}

    def label(self) -> str:
        return (
            f"{self.kernel} {dtype_name(self.dtype)}{' fp8kv' if self.fp8_cache else ''} "
            f"bs{self.block_size} {self.hq}/{self.hkv} D{self.head_dim} {self.layout}"
        )


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def correctness_specs(plan: Plan) -> list[CaseSpec]:
    heads = plan.head_configs
    kernels = ("decode", "prefill", "store")
    dtypes = [(d, False, bs) for d in plan.dtypes for bs in plan.block_sizes]
    dtypes += [(d, True, plan.block_sizes[0]) for d in plan.fp8_query_dtypes]
    return [
        CaseSpec(kernel, dtype, bs, hq, hkv, d, layout, fp8)
        for kernel, (dtype, fp8, bs) in itertools.product(kernels, dtypes)
        for hq, hkv, d in heads
        for layout in LAYOUTS
    ]


class BudgetExceeded(Exception):
    """The run's --budget-s is spent: the section stops, keeping the rows it has."""


class Run:
    """The run's settings, clock and results; saves the results JSON on every save()."""

    def __init__(self, args: argparse.Namespace, plan: Plan) -> None:
        self.args, self.plan = args, plan
        self.device = torch.device(args.device)
        self.start = time.monotonic()
        self.results: dict[str, Any] = {
            "argv": sys.argv,
            "smoke": args.smoke,
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "budget_s": args.budget_s,
            "sections": {},
        }

    def elapsed_s(self) -> float:
        return time.monotonic() - self.start

    def check_budget(self) -> None:
        if self.elapsed_s() > self.args.budget_s:
            raise BudgetExceeded(f"budget of {self.args.budget_s} s spent")

    def save(self) -> None:
        """Write the results atomically (a kill mid-write leaves the previous file)."""
        self.results["elapsed_s"] = round(self.elapsed_s(), 2)
        out = Path(self.args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(out.suffix + ".tmp")
        tmp.write_text(json.dumps(self.results, indent=1, default=str))
        os.replace(tmp, out)

    def section(self, name: str, fn: Callable[[Run, list[dict]], dict], always: bool = False):
        """Run one section: fn(run, rows) appends a row per case (kept if it fails midway) and
        returns extra fields. Records status ok/error/budget_exceeded/skipped, then saves."""
        rows: list[dict] = []
        rec: dict[str, Any] = {"status": "running", "rows": rows}
        self.results["sections"][name] = rec
        t0 = time.monotonic()
        try:
            if not always:
                self.check_budget()
            logger.info("== %s (%.0f s into the run)", name, self.elapsed_s())
            rec.update(fn(self, rows))
            rec["status"] = "ok"
        except BudgetExceeded as e:
            rec["status"] = "budget_exceeded" if rows else "skipped"
            logger.warning("%s: %s; %d rows kept", name, e, len(rows))
        except Exception as e:  # noqa: BLE001 - record and go on to the next section
            rec.update(status="error", error=repr(e), traceback=traceback.format_exc())
            logger.exception("%s failed", name)
        rec["seconds"] = round(time.monotonic() - t0, 2)
        self.save()


# --------------------------------------------------------------------------------------
# Timing
# --------------------------------------------------------------------------------------


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@functools.cache
def _l2_flush_buffer(device: str) -> torch.Tensor:
    """256 MiB, zeroed before each timed call so no call finds the last one's data in L2
    (H100/H200: 50 MiB), as triton.testing.do_bench does."""
    return torch.empty(256 * 2**20, dtype=torch.int8, device=device)


def time_us(run: Run, fn: Callable[[], object]) -> dict[str, float]:
    """Median and min microseconds of fn over up to plan.max_reps calls, stopping at about
    --max-measure-s. CUDA: events around each call, L2 flushed before it; CPU: perf_counter."""
    dev = run.device
    t0 = time.perf_counter()
    fn()  # compiles on first use
    sync(dev)
    est_s = max(time.perf_counter() - t0, 1e-6)
    for _ in range(min(run.plan.warmup, int(run.args.max_measure_s / est_s))):
        fn()
    sync(dev)
    t0 = time.perf_counter()
    fn()
    sync(dev)
    est_s = max(time.perf_counter() - t0, 1e-6)
    reps = max(2, min(run.plan.max_reps, int(run.args.max_measure_s / est_s)))
    if dev.type == "cuda":
        flush = _l2_flush_buffer(str(dev))
        events = [
            (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            for _ in range(reps)
        ]
        for start, end in events:
            flush.zero_()
            start.record()
            fn()
            end.record()
        sync(dev)
        times = [start.elapsed_time(end) * 1e3 for start, end in events]
    else:
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e6)
    return {"median_us": statistics.median(times), "min_us": min(times), "reps": reps}


def measure(run: Run, row: dict, key: str, fn: Callable[[], object]) -> float | None:
    """time_us(fn) into row[key + "_us"]; an error goes into row[key + "_error"], not up."""
    try:
        t = time_us(run, fn)
    except Exception as e:  # noqa: BLE001 - one failed baseline must not lose the row
        row[f"{key}_error"] = repr(e)
        logger.warning("%s failed: %r", key, e)
        return None
    row[f"{key}_us"] = round(t["median_us"], 2)
    row[f"{key}_reps"] = t["reps"]
    return t["median_us"]


# --------------------------------------------------------------------------------------
# Case construction
# --------------------------------------------------------------------------------------


def with_layout(cache: torch.Tensor, layout: str) -> torch.Tensor:
    """cache [N, 2, bs, Hkv, D], stored token-major or head-major. Head-major is the engine's
    [N, 2, Hkv, bs, D] memory seen through transpose(2, 3), as engine/attention_triton does."""
    if layout == "head_major":
        return cache.transpose(2, 3).contiguous().transpose(2, 3)
    return cache.contiguous()


def build_paged(
    gen: torch.Generator, seq_lens: tuple[int, ...], spec: CaseSpec
) -> tuple[torch.Tensor, torch.Tensor]:
    """(cache [N, 2, bs, Hkv, D] token-major, block_tables [B, max_blocks]) on the CPU: each
    request's random K/V in shuffled, non-contiguous blocks; NaN in every slot no request owns
    (null block 0, spare blocks, each last block's tail), so a read outside a context shows."""
    block_size, num_kv_heads, head_dim = spec.block_size, spec.hkv, spec.head_dim
    n_blocks = [math.ceil(n / block_size) for n in seq_lens]
    num_blocks = 1 + sum(n_blocks) + 5  # null block + owned + spare
    cache = torch.full((num_blocks, 2, block_size, num_kv_heads, head_dim), float("nan"))
    ids = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()  # never block 0
    tables = torch.zeros(len(seq_lens), max(n_blocks) + 2, dtype=spec.index_dtype)  # null pad
    for b, n in enumerate(seq_lens):
        kv = torch.randn(2, n, num_kv_heads, head_dim, generator=gen)  # [2, n, Hkv, D]
        for j in range(n_blocks[b]):
            tables[b, j] = blk = ids.pop()
            piece = kv[:, j * block_size : (j + 1) * block_size]
            cache[blk, :, : piece.shape[1]] = piece
    return (to_fp8(cache) if spec.fp8_cache else cache.to(spec.dtype)), tables


def to_fp8(cache: torch.Tensor) -> torch.Tensor:
    """cache [N, 2, bs, Hkv, D] quantized to float8_e4m3fn with FP8_SCALES (NaN stays NaN)."""
    from pdserve.kernels.reference import quantize

    k = quantize(cache[:, 0], FP8_SCALES["k_scale"], FP8)
    return torch.stack([k, quantize(cache[:, 1], FP8_SCALES["v_scale"], FP8)], dim=1)


def compare(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> dict:
    """Max abs error, and max over tokens of |out - ref| / max |ref| of that token ([T, H, D]
    outputs); ok when that is within TOLERANCE[dtype] and out is finite."""
    out, ref = out.float(), ref.float()
    err = (out - ref).abs().flatten(1).amax(1)  # [T]
    scale = ref.abs().flatten(1).amax(1).clamp_min(1e-6)  # all-zero rows: padding requests
    rel = (err / scale).max().item()
    finite = bool(torch.isfinite(out).all())
    tol = TOLERANCE[dtype]
    return {
        "max_abs_err": err.max().item(),
        "max_rel_err": rel,
        "tol": tol,
        "finite": finite,
        "ok": finite and rel <= tol,
    }


# --------------------------------------------------------------------------------------
# Sections
# --------------------------------------------------------------------------------------


def section_environment(run: Run, rows: list[dict]) -> dict:
    import triton

    from pdserve.kernels._paged_common import interpreting

    env: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "triton": triton.__version__,
        "triton_interpret": interpreting(),
        "device": str(run.device),
        "host_cpus": os.cpu_count(),
    }
    if run.device.type == "cuda":
        props = torch.cuda.get_device_properties(run.device)
        free, total = torch.cuda.mem_get_info(run.device)
        env.update(
            device_name=props.name,
            sm_count=props.multi_processor_count,
            capability=f"{props.major}.{props.minor}",
            memory_total_gib=round(total / 2**30, 1),
            memory_free_gib=round(free / 2**30, 1),
        )
    else:
        env["device_name"] = platform.processor() or platform.machine()
    # copy bandwidth: read + write of a buffer well past L2
    n = (1 << 30) if run.device.type == "cuda" else (1 << 22)
    src = torch.empty(n, dtype=torch.uint8, device=run.device)
    dst = torch.empty_like(src)
    t = time_us(run, functools.partial(dst.copy_, src))
    env["copy_bandwidth_tbps"] = round(2 * n / t["median_us"] / 1e6, 3)
    for key, value in env.items():
        logger.info("  %s: %s", key, value)
    return {"env": env}


def check_decode(run: Run, spec: CaseSpec, gen: torch.Generator) -> dict:
    from pdserve.kernels import paged_decode_attention, paged_decode_attention_ref

    dev, seq_lens = run.device, run.plan.decode_seq_lens
    cache, tables = build_paged(gen, seq_lens, spec)
    q = torch.randn(len(seq_lens), spec.hq, spec.head_dim, generator=gen)  # [B, Hq, D]
    q = q.to(dev, spec.dtype)
    seq = torch.tensor(seq_lens, dtype=spec.index_dtype, device=dev)
    args = (q, with_layout(cache.to(dev), spec.layout), tables.to(dev), seq, spec.head_dim**-0.5)
    out = paged_decode_attention(*args, **spec.scales)
    return compare(out, paged_decode_attention_ref(*args, **spec.scales), spec.dtype)


def check_prefill(run: Run, spec: CaseSpec, gen: torch.Generator) -> dict:
    from pdserve.kernels import paged_prefill_attention, paged_prefill_attention_ref

    dev, query_lens = run.device, run.plan.prefill_query_lens
    cache, tables = build_paged(gen, run.plan.prefill_seq_lens, spec)
    q = torch.randn(sum(query_lens), spec.hq, spec.head_dim, generator=gen)  # [T, Hq, D]
    q = q.to(dev, spec.dtype)
    starts = [0, *itertools.accumulate(query_lens)]
    qsl = torch.tensor(starts, dtype=spec.index_dtype, device=dev)  # [B + 1]
    seq = torch.tensor(run.plan.prefill_seq_lens, dtype=spec.index_dtype, device=dev)
    cache = with_layout(cache.to(dev), spec.layout)
    args = (q, cache, tables.to(dev), qsl, seq, spec.head_dim**-0.5)
    out = paged_prefill_attention(*args, max_query_len=max(query_lens), **spec.scales)
    return compare(out, paged_prefill_attention_ref(*args, **spec.scales), spec.dtype)


def check_store(run: Run, spec: CaseSpec, gen: torch.Generator) -> dict:
    """Bit-exact: a copy (or the reference's fp8 quantization), and every slot it should not
    write keeps its old value."""
    from pdserve.kernels import reshape_and_cache, reshape_and_cache_ref

    dev, dtype, bs = run.device, spec.dtype, spec.block_size
    t, hkv, d = run.plan.store_tokens, spec.hkv, spec.head_dim
    num_blocks = 1 + 2 * math.ceil(t / bs)
    cache = torch.randn(num_blocks, 2, bs, hkv, d, generator=gen)
    cache = (to_fp8(cache) if spec.fp8_cache else cache.to(dtype)).to(dev)
    # k and v as views into one [T, 2 * Hkv, D] projection output, as a fused KV matmul gives
    kv = torch.randn(t, 2 * hkv, d, generator=gen).to(dev, dtype)
    k, v = kv[:, :hkv], kv[:, hkv:]
    # distinct shuffled slots, never in the null block; every 7th token is padding (-1)
    slots = torch.randperm((num_blocks - 1) * bs, generator=gen)[:t] + bs
    slots[::7] = -1
    slots = slots.to(dev, spec.index_dtype)
    ref = cache.clone()
    reshape_and_cache_ref(k, v, ref, slots, **spec.scales)
    out = with_layout(cache, spec.layout)
    reshape_and_cache(k, v, out, slots, **spec.scales)
    diff = (out.float() - ref.float()).abs().max().item()
    if spec.fp8_cache:  # bit patterns: torch.equal has no fp8 kernels everywhere
        out, ref = out.view(torch.uint8), ref.view(torch.uint8)
    return {"max_abs_err": diff, "tol": 0.0, "ok": bool(torch.equal(out, ref))}


def section_correctness(run: Run, rows: list[dict]) -> dict:
    check = {"decode": check_decode, "prefill": check_prefill, "store": check_store}
    for i, spec in enumerate(correctness_specs(run.plan)):
        run.check_budget()
        dtype = dtype_name(spec.dtype) + (" fp8kv" if spec.fp8_cache else "")
        row: dict[str, Any] = dataclasses.asdict(spec) | {"dtype": dtype}
        t0 = time.monotonic()
        try:
            row.update(check[spec.kernel](run, spec, torch.Generator().manual_seed(i)))
        except Exception as e:  # noqa: BLE001 - a crashing case is a failed case
            row.update(ok=False, error=repr(e), traceback=traceback.format_exc())
        row["seconds"] = round(time.monotonic() - t0, 3)
        rows.append(row)
        err = row.get("max_rel_err", row.get("max_abs_err"))
        verdict = "PASS" if row["ok"] else f"FAIL {row.get('error', '')}"
        logger.info(
            "  %-44s err %-9s %s (%.1f s)", spec.label(), _fmt(err), verdict, row["seconds"]
        )
    passed = sum(r["ok"] for r in rows)
    logger.info("correctness: %d/%d cases pass", passed, len(rows))
    return {"passed": passed, "total": len(rows), "all_ok": passed == len(rows)}


def random_paged(run: Run, batch: int, context: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(cache [N, 2, bs, Hkv, D] token-major, tables [batch, nb] int32) for the timed shapes:
    every request holds `context` tokens in shuffled blocks."""
    plan, dev = run.plan, run.device
    _, hkv, d = plan.bench_heads
    bs = plan.bench_block_size
    nb = math.ceil(context / bs)
    cache = torch.randn(1 + batch * nb, 2, bs, hkv, d, device=dev, dtype=plan.bench_dtype)
    tables = (torch.randperm(batch * nb, device=dev) + 1).view(batch, nb).to(torch.int32)
    return cache, tables


def gather_dense(cache: torch.Tensor, tables: torch.Tensor, context: int):
    """k, v [B, Hkv, context, D] gathered from the paged cache in one indexing copy (last two
    dims contiguous, what SDPA's kernels need)."""
    per_head = cache.permute(1, 3, 0, 2, 4)  # [2, Hkv, N, bs, D] view
    kv = per_head[:, :, tables.long()]  # [2, Hkv, B, nb, bs, D]: the gather
    kv = kv.transpose(1, 2).flatten(3, 4)[..., :context, :]  # [2, B, Hkv, nb * bs, D] view
    return kv[0], kv[1]


def sdpa_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q [B, Hq, D] over k, v [B, Hkv, L, D]: the G query heads of each KV head become G query
    rows of that head (all at the last position, so no mask): GQA without repeating K/V."""
    b, hq, d = q.shape
    qg = q.view(b, k.shape[1], hq // k.shape[1], d)  # [B, Hkv, G, D]
    return F.scaled_dot_product_attention(qg, k, v, scale=scale).reshape(b, hq, d)


def _add_bandwidth(run: Run, row: dict, key: str, num_bytes: int) -> None:
    if f"{key}_us" in row:
        tbps = num_bytes / row[f"{key}_us"] / 1e6
        row[f"{key}_tbps"] = round(tbps, 4)
        row[f"{key}_peak_frac"] = round(tbps / run.args.peak_tbps, 4)


def _time_decode_shape(run: Run, row: dict, batch: int, context: int) -> None:
    from pdserve.kernels import paged_decode_attention, paged_decode_attention_ref
    from pdserve.kernels.paged_decode import auto_num_splits

    hq, hkv, d = run.plan.bench_heads
    cache, tables = random_paged(run, batch, context)
    seq = torch.full((batch,), context, dtype=torch.int32, device=run.device)
    q = torch.randn(batch, hq, d, device=run.device, dtype=run.plan.bench_dtype)  # [B, Hq, D]
    out = torch.empty_like(q)
    scale = d**-0.5
    kv_bytes = 2 * batch * context * hkv * d * cache.element_size()  # K and V, read once
    splits = auto_num_splits(batch, hkv, tables.shape[1], run.plan.bench_block_size, run.device)
    # the automatic split count, and the kernel's grid (B, Hkv, splits)
    row.update(kv_bytes=kv_bytes, num_splits=splits, programs=batch * hkv * splits)
    keys = [f"triton_{layout}" for layout in LAYOUTS]
    for key, layout in zip(keys, LAYOUTS, strict=True):
        paged = with_layout(cache, layout)  # head_major: a copy, freed at the next loop

        def triton_call(paged: torch.Tensor = paged) -> torch.Tensor:
            return paged_decode_attention(q, paged, tables, seq, scale, out=out)

        measure(run, row, key, triton_call)
    del paged, triton_call  # both hold the head-major copy
    keys += _time_decode_fixed_splits(run, row, q, cache, tables, seq, out)
    keys.append("reference")
    measure(run, row, keys[-1], lambda: paged_decode_attention_ref(q, cache, tables, seq, scale))
    keys += _time_decode_sdpa(run, row, q, cache, tables, context)
    for key in keys:  # with_gather: effective bandwidth (the gather's own traffic not counted)
        _add_bandwidth(run, row, key, kv_bytes)
    cache8 = to_fp8(cache)  # the fp8 cache reads half the bytes

    def fp8_call() -> torch.Tensor:
        return paged_decode_attention(q, cache8, tables, seq, scale, out=out, **FP8_SCALES)

    measure(run, row, "triton_fp8", fp8_call)
    _add_bandwidth(run, row, "triton_fp8", kv_bytes // 2)
    # Triton's time over flash SDPA's on the dense-equivalent problem (target: <= 1.5 on H200)
    for key in ("triton_token_major", "triton_fp8"):
        if f"{key}_us" in row and "sdpa_flash_us" in row:
            row[f"{key}_x_flash"] = round(row[f"{key}_us"] / row["sdpa_flash_us"], 3)


def _time_decode_fixed_splits(
    run: Run,
    row: dict,
    q: torch.Tensor,
    cache: torch.Tensor,
    tables: torch.Tensor,
    seq: torch.Tensor,
    out: torch.Tensor,
) -> list[str]:
    """The kernel (token-major) at each of plan.decode_fixed_splits; records the fastest as
    best_fixed_splits. Returns the keys it measured."""
    from pdserve.kernels import paged_decode_attention

    scale = q.shape[-1] ** -0.5
    keys = []
    for n in run.plan.decode_fixed_splits:

        def call(n: int = n) -> torch.Tensor:
            return paged_decode_attention(q, cache, tables, seq, scale, out=out, num_splits=n)

        if measure(run, row, f"triton_s{n}", call) is not None:
            keys.append(f"triton_s{n}")
    if keys:
        best = min(keys, key=lambda k: row[f"{k}_us"])
        row.update(best_fixed_splits=int(best.removeprefix("triton_s")))
    return keys


def _time_decode_sdpa(
    run: Run, row: dict, q: torch.Tensor, cache: torch.Tensor, tables: torch.Tensor, context: int
) -> list[str]:
    """SDPA on K/V gathered once beforehand (any backend; flash forced), and with the gather
    inside the timing; also the Triton kernel's error against it. Returns the keys it
    measured."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from pdserve.kernels import paged_decode_attention

    scale = q.shape[-1] ** -0.5
    seq = torch.full((q.shape[0],), context, dtype=torch.int32, device=q.device)
    k, v = (x.contiguous() for x in gather_dense(cache, tables, context))  # [B, Hkv, L, D]
    dense = sdpa_decode(q, k, v, scale)
    out = paged_decode_attention(q, cache, tables, seq, scale)
    row["triton_vs_sdpa"] = compare(out, dense, run.plan.bench_dtype)["max_rel_err"]
    measure(run, row, "sdpa_pregathered", lambda: sdpa_decode(q, k, v, scale))

    def flash() -> torch.Tensor:
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return sdpa_decode(q, k, v, scale)

    measure(run, row, "sdpa_flash", flash)
    measure(
        run,
        row,
        "sdpa_with_gather",
        lambda: sdpa_decode(q, *gather_dense(cache, tables, context), scale),
    )
    return ["sdpa_pregathered", "sdpa_flash", "sdpa_with_gather"]


def _release(run: Run) -> None:
    if run.device.type == "cuda":
        torch.cuda.empty_cache()


def section_decode(run: Run, rows: list[dict]) -> dict:
    for batch in run.plan.decode_batches:
        for context in run.plan.decode_contexts:
            run.check_budget()
            row: dict[str, Any] = {"batch": batch, "context": context}
            try:
                _time_decode_shape(run, row, batch, context)
            except Exception as e:  # noqa: BLE001 - e.g. out of memory: next shape
                row.update(error=repr(e), traceback=traceback.format_exc())
            _release(run)
            rows.append(row)
            run.save()
            logger.info(
                "  decode B=%-3d ctx=%-5d triton %s us (%s splits, %s of peak, %sx flash sdpa), "
                "fp8 %s us (%sx), flash sdpa %s us, ref %s us",
                batch,
                context,
                row.get("triton_token_major_us"),
                row.get("num_splits"),
                row.get("triton_token_major_peak_frac"),
                row.get("triton_token_major_x_flash"),
                row.get("triton_fp8_us"),
                row.get("triton_fp8_x_flash"),
                row.get("sdpa_flash_us"),
                row.get("reference_us"),
            )
    return {}


def _add_tflops(row: dict, key: str, flops: float) -> None:
    if f"{key}_us" in row:
        row[f"{key}_tflops"] = round(flops / row[f"{key}_us"] / 1e6, 3)


def _time_prefill_shape(run: Run, row: dict, seq_len: int, query_len: int) -> None:
    from torch.nn.attention.bias import causal_lower_right

    from pdserve.kernels import paged_prefill_attention

    hq, hkv, d = run.plan.bench_heads
    dev, scale = run.device, d**-0.5
    cache, tables = random_paged(run, 1, seq_len)
    q = torch.randn(query_len, hq, d, device=dev, dtype=run.plan.bench_dtype)  # [T, Hq, D]
    qsl = torch.tensor([0, query_len], dtype=torch.int32, device=dev)
    seq = torch.tensor([seq_len], dtype=torch.int32, device=dev)
    # query i sits at position seq_len - query_len + i and sees keys 0..that position
    pairs = query_len * (seq_len - query_len) + query_len * (query_len + 1) // 2
    flops = 4 * hq * d * pairs  # QK^T and PV, 2 flops per multiply-add
    row.update(flops=flops)
    # SDPA on contiguous [1, Hq, *, D] (K/V repeated to Hq heads outside the timing)
    k, v = (x.repeat_interleave(hq // hkv, dim=1) for x in gather_dense(cache, tables, seq_len))
    q4 = q.transpose(0, 1).unsqueeze(0).contiguous()  # [1, Hq, T, D]
    mask = None if query_len == seq_len else causal_lower_right(query_len, seq_len)

    def sdpa() -> torch.Tensor:
        if mask is None:
            return F.scaled_dot_product_attention(q4, k, v, is_causal=True, scale=scale)
        return F.scaled_dot_product_attention(q4, k, v, attn_mask=mask, scale=scale)

    dense = None
    if measure(run, row, "sdpa_causal", sdpa) is not None:
        _add_tflops(row, "sdpa_causal", flops)
        dense = sdpa()[0].transpose(0, 1)  # [T, Hq, D]
    # the two layouts of the bench cache, and an fp8 copy (its error vs SDPA: fp8 rounding)
    variants = [
        (layout, lambda layout=layout: with_layout(cache, layout), {}) for layout in LAYOUTS
    ]
    variants.append(("fp8", lambda: to_fp8(cache), FP8_SCALES))
    for name, make_cache, scales in variants:
        paged = make_cache()
        for block_m in run.plan.prefill_block_ms:
            key = f"triton_{name}_m{block_m}"

            def call(paged=paged, block_m=block_m, scales=scales) -> torch.Tensor:
                args = (q, paged, tables, qsl, seq, scale)
                kw = dict(max_query_len=query_len, block_m=block_m, **scales)
                return paged_prefill_attention(*args, **kw)

            if measure(run, row, key, call) is not None:
                _add_tflops(row, key, flops)
                if dense is not None:
                    err = compare(call(), dense, run.plan.bench_dtype)["max_rel_err"]
                    row[f"{key}_vs_sdpa"] = err


def section_prefill(run: Run, rows: list[dict]) -> dict:
    for name, seq_len, query_len in run.plan.prefill_cases:
        run.check_budget()
        row: dict[str, Any] = {"case": name, "seq_len": seq_len, "query_len": query_len}
        try:
            _time_prefill_shape(run, row, seq_len, query_len)
        except Exception as e:  # noqa: BLE001 - next shape
            row.update(error=repr(e), traceback=traceback.format_exc())
        _release(run)
        rows.append(row)
        run.save()
        best = max(
            (v for k, v in row.items() if k.startswith("triton") and k.endswith("tflops")),
            default=None,
        )
        logger.info(
            "  prefill %s: best triton %s TFLOP/s, sdpa %s TFLOP/s",
            name,
            best,
            row.get("sdpa_causal_tflops"),
        )
    return {}


def section_store(run: Run, rows: list[dict]) -> dict:
    from pdserve.kernels import reshape_and_cache, reshape_and_cache_ref

    plan, dev = run.plan, run.device
    t, (_, hkv, d), bs = plan.store_bench_tokens, plan.bench_heads, plan.bench_block_size
    num_blocks = 1 + math.ceil(t / bs) + 8
    kv = torch.randn(t, 2 * hkv, d, device=dev, dtype=plan.bench_dtype)  # fused projection
    k, v = kv[:, :hkv], kv[:, hkv:]  # [T, Hkv, D] views
    slots = (torch.randperm((num_blocks - 1) * bs, device=dev)[:t] + bs).to(torch.int32)
    # each layout of a bench-dtype cache; the token-major fp8 cache (quantizing on the way)
    for layout, dtype in [*((layout, plan.bench_dtype) for layout in LAYOUTS), (LAYOUTS[0], FP8)]:
        run.check_budget()
        cache = torch.zeros(num_blocks, 2, bs, hkv, d, device=dev, dtype=dtype)
        scales = FP8_SCALES if dtype == FP8 else {}
        # K and V, read (bench dtype) + written (cache dtype)
        moved_bytes = 2 * t * hkv * d * (kv.element_size() + cache.element_size())
        row: dict[str, Any] = {"layout": layout, "cache_dtype": dtype_name(dtype), "tokens": t}
        row["moved_bytes"] = moved_bytes
        paged = with_layout(cache, layout)

        def triton_call(paged: torch.Tensor = paged, scales: dict = scales) -> None:
            reshape_and_cache(k, v, paged, slots, **scales)

        def ref_call(paged: torch.Tensor = paged, scales: dict = scales) -> None:
            reshape_and_cache_ref(k, v, paged, slots, **scales)

        measure(run, row, "triton", triton_call)
        measure(run, row, "reference", ref_call)
        for key in ("triton", "reference"):
            if f"{key}_us" in row:
                row[f"{key}_tokens_per_s"] = round(t / row[f"{key}_us"] * 1e6)
                row[f"{key}_gbps"] = round(moved_bytes / row[f"{key}_us"] / 1e3, 2)
        rows.append(row)
        run.save()
        logger.info(
            "  store %s %s: triton %s tok/s, reference %s tok/s",
            layout,
            row["cache_dtype"],
            row.get("triton_tokens_per_s"),
            row.get("reference_tokens_per_s"),
        )
    return {}


# --------------------------------------------------------------------------------------
# Summary
# --------------------------------------------------------------------------------------


def _fmt(x: Any) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        if x == 0 or 0.01 <= abs(x) < 1e7:
            return f"{x:.4g}" if abs(x) < 100 else f"{x:.0f}"
        return f"{x:.2e}"
    return str(x)


def _table(columns: list[tuple[str, Callable[[dict], Any]]], rows: list[dict]) -> list[str]:
    """Markdown table: one line per row, one column per (header, getter)."""
    lines = ["| " + " | ".join(h for h, _ in columns) + " |", "|" + "---|" * len(columns)]
    return lines + ["| " + " | ".join(_fmt(get(r)) for _, get in columns) + " |" for r in rows]


def _col(key: str) -> Callable[[dict], Any]:
    return lambda r: r.get(key)


def _correctness_md(rows: list[dict]) -> list[str]:
    """Pass counts and the worst error per kernel and dtype, then each failing case."""
    groups: dict[tuple[str, str], list[dict]] = {}
    for r in rows:
        groups.setdefault((r["kernel"], r["dtype"]), []).append(r)
    summary = [
        {
            "kernel": kernel,
            "dtype": dtype,
            "pass": f"{sum(r['ok'] for r in rs)}/{len(rs)}",
            "worst": max(r.get("max_rel_err", r.get("max_abs_err")) or 0.0 for r in rs),
            "tol": rs[0].get("tol"),
        }
        for (kernel, dtype), rs in groups.items()
    ]
    columns = [("kernel", _col("kernel")), ("dtype", _col("dtype")), ("pass", _col("pass"))]
    columns += [("worst rel err", _col("worst")), ("tol", _col("tol"))]
    fails = [r for r in rows if not r["ok"]]
    return _table(columns, summary) + [
        f"FAIL: {r['kernel']} {r['dtype']} bs{r['block_size']} {r['hq']}/{r['hkv']} "
        f"D{r['head_dim']} {r['layout']}: {r.get('error') or r.get('max_rel_err')}"
        for r in fails
    ]


DECODE_COLUMNS = [
    ("B", _col("batch")),
    ("ctx", _col("context")),
    ("splits", _col("num_splits")),
    ("triton us", _col("triton_token_major_us")),
    ("x flash sdpa", _col("triton_token_major_x_flash")),
    ("TB/s", _col("triton_token_major_tbps")),
    ("of peak", _col("triton_token_major_peak_frac")),
    ("best fixed splits", _col("best_fixed_splits")),
    ("1 split us", _col("triton_s1_us")),
    ("fp8 us", _col("triton_fp8_us")),
    ("fp8 x flash", _col("triton_fp8_x_flash")),
    ("head-major us", _col("triton_head_major_us")),
    ("ref us", _col("reference_us")),
    ("flash sdpa us", _col("sdpa_flash_us")),
    ("sdpa us", _col("sdpa_pregathered_us")),
    ("sdpa of peak", _col("sdpa_pregathered_peak_frac")),
    ("sdpa+gather us", _col("sdpa_with_gather_us")),
    ("err vs sdpa", _col("triton_vs_sdpa")),
    ("error", _col("error")),
]

STORE_COLUMNS = [
    ("layout", _col("layout")),
    ("cache", _col("cache_dtype")),
    ("tokens", _col("tokens")),
    ("triton us", _col("triton_us")),
    ("tokens/s", _col("triton_tokens_per_s")),
    ("GB/s", _col("triton_gbps")),
    ("ref us", _col("reference_us")),
    ("ref tokens/s", _col("reference_tokens_per_s")),
]


def _prefill_md(rows: list[dict]) -> list[str]:
    """One line per (case, Triton variant), next to the case's SDPA."""
    lines = []
    for r in rows:
        variants = [k[: -len("_us")] for k in r if k.startswith("triton_") and k.endswith("_us")]
        lines += [
            {
                "case": r["case"],
                "variant": key.removeprefix("triton_"),
                "us": r[f"{key}_us"],
                "tflops": r.get(f"{key}_tflops"),
                "err": r.get(f"{key}_vs_sdpa"),
                "sdpa_us": r.get("sdpa_causal_us"),
                "sdpa_tflops": r.get("sdpa_causal_tflops"),
                "error": r.get("error"),
            }
            for key in sorted(variants)
        ] or [{"case": r["case"], "error": r.get("error")}]
    columns = [("case", _col("case")), ("layout, BLOCK_M", _col("variant"))]
    columns += [("triton us", _col("us")), ("TFLOP/s", _col("tflops"))]
    columns += [("err vs sdpa", _col("err")), ("sdpa us", _col("sdpa_us"))]
    columns += [("sdpa TFLOP/s", _col("sdpa_tflops")), ("error", _col("error"))]
    return _table(columns, lines)


def section_summary(run: Run, rows: list[dict]) -> dict:
    sections = run.results["sections"]
    md = [
        "# pdserve Triton kernels: "
        + str(sections.get("environment", {}).get("env", {}).get("device_name", run.device))
    ]
    md += [
        "sections: "
        + ", ".join(f"{k} {v['status']}" for k, v in sections.items() if k != "summary")
    ]
    render: dict[str, Callable[[list[dict]], list[str]]] = {
        "correctness": _correctness_md,
        "decode": functools.partial(_table, DECODE_COLUMNS),
        "prefill": _prefill_md,
        "store": functools.partial(_table, STORE_COLUMNS),
    }
    md += [f"{k}: {v['error']}" for k, v in sections.items() if v["status"] == "error"]
    for name, fn in render.items():
        if sections.get(name, {}).get("rows"):
            md += ["", f"## {name}", *fn(sections[name]["rows"])]
    text = "\n".join(md)
    logger.info("summary:\n%s", text)
    run.results["summary_markdown"] = text
    return {}


# --------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------

SECTIONS: dict[str, Callable[[Run, list[dict]], dict]] = {
    "environment": section_environment,
    "correctness": section_correctness,
    "decode": section_decode,
    "prefill": section_prefill,
    "store": section_store,
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--device",
        choices=("cuda", "cpu"),
        default="cuda",
        help="where the kernels run; cpu needs Triton's interpreter "
        "(TRITON_INTERPRET=1, set by the script if missing)",
    )
    p.add_argument(
        "--smoke",
        action="store_true",
        help="tiny shapes, fp32 only, one tiny timing per kernel (for the CPU)",
    )
    p.add_argument(
        "--out",
        default="benchmarks/results/gpu_kernels.json",
        help="results JSON, rewritten after every section",
    )
    p.add_argument(
        "--budget-s",
        type=float,
        default=300.0,
        help="wall-clock budget; sections past it are skipped (summary still runs)",
    )
    p.add_argument(
        "--max-measure-s",
        type=float,
        default=0.5,
        help="seconds one timed measurement may use (reps shrink to fit)",
    )
    p.add_argument(
        "--peak-tbps",
        type=float,
        default=H200_PEAK_TBPS,
        help="HBM peak (TB/s) the decode bandwidth is a fraction of",
    )
    p.add_argument(
        "--sections",
        default=",".join(SECTIONS),
        help="comma-separated subset of: " + ", ".join(SECTIONS),
    )
    p.add_argument("--log-level", default="INFO", help="logging level")
    args = p.parse_args(argv)
    unknown = set(args.sections.split(",")) - set(SECTIONS)
    if unknown:
        p.error(f"unknown sections: {sorted(unknown)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(message)s")
    if args.device == "cpu":  # must precede the first import of the kernels (triton.jit)
        os.environ.setdefault("TRITON_INTERPRET", "1")
    elif os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        logger.warning("TRITON_INTERPRET is set: the kernels run on the interpreter")
    run = Run(args, SMOKE_PLAN if args.smoke else GPU_PLAN)
    if run.device.type == "cuda" and not torch.cuda.is_available():
        run.results["error"] = "--device cuda but torch.cuda.is_available() is False"
        logger.error(run.results["error"])
        run.save()
        return 1
    torch.manual_seed(0)
    for name in args.sections.split(","):
        run.section(name, SECTIONS[name])
    run.section("summary", section_summary, always=True)
    sections = run.results["sections"]
    failed = [k for k, v in sections.items() if v["status"] == "error"]
    # correctness cut short by the budget counts as not passed
    all_ok = "correctness" not in sections or sections["correctness"].get("all_ok", False)
    logger.info("done in %.0f s; results in %s", run.elapsed_s(), args.out)
    if failed or not all_ok:
        logger.error("failed sections: %s; all correctness cases pass: %s", failed, all_ok)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
