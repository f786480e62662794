"""Decode-sized products: the few-row kernel (pdserve_kernels/cpu/linear.cpp: AMX on a CPU that
has it, AVX2 + FMA otherwise) vs oneDNN's packed GEMM (what every product used before), over the
projections of a whole model, each called as the engine calls it (llama.packed_linear).

One "step" multiplies R rows by every projection of SmolLM2-135M's 30 layers (q/k/v fused
960x576, o 576x576, gate/up fused 3072x576, down 576x1536: 213 MB of bf16 weights, random), in
layer order, so the weights stream from memory as in a decode step rather than sitting in
cache. The two paths alternate step by step; each reports its median step and the weight bytes
read per second; the ratio is oneDNN / kernel time. The kernel path gives the kernel every row
count, as the engine does where it takes them all (small_rows_take_all: AVX2-only CPUs, and
nodes running the kernels' pool); elsewhere oneDNN takes more than SMALL_ROWS_MAX rows.

    .venv/bin/python benchmarks/small_rows_linear.py            # ~1 min here
    .venv/bin/python benchmarks/small_rows_linear.py --rows 1 4 16 --repeats 20
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pdserve.engine.host_memory import huge_page_copies  # noqa: E402
from pdserve.engine.models.llama import pack_small_rows, pack_weight, packed_linear  # noqa: E402

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # [N, K] of one layer's projections
LAYERS = 30


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 32, 64, 128, 256])
    p.add_argument("--repeats", type=int, default=10, help="timed steps per path and row count")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/small_rows_linear.json"))
    return p.parse_args()


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    weights = [[torch.randn(n, k).to(dtype) for n, k in SHAPES] for _ in range(LAYERS)]
    onednn = [[pack_weight(w) for w in layer] for layer in weights]
    small = [[pack_small_rows(w) for w in layer] for layer in weights]
    if any(s is None for layer in small for s in layer):
        sys.exit(f"the few-row kernel takes no {args.dtype} weights here (or did not build)")
    # on huge pages, one after another, as the engine lays them out (CausalLM.pack_weights)
    flat = iter(huge_page_copies([s for layer in small for s in layer]))
    small = [[next(flat) for _ in layer] for layer in small]
    from pdserve.kernels.cpu import cpu_ops

    ops = cpu_ops()
    nbytes = sum(n * k * dtype.itemsize for n, k in SHAPES) * LAYERS

    def step(path: str, xs: dict[int, torch.Tensor]) -> float:
        start = time.perf_counter()
        for layer in range(LAYERS):
            for w, packed, few in zip(weights[layer], onednn[layer], small[layer], strict=True):
                if path == "onednn":
                    packed_linear(xs[w.shape[1]], w, packed, None)
                else:  # no oneDNN copy: the kernel takes every row count (small_rows_take_all)
                    packed_linear(xs[w.shape[1]], w, None, None, few, ops)
        return time.perf_counter() - start

    results = []
    for rows in args.rows:
        xs = {k: torch.randn(rows, k).to(dtype) for k in {k for _, k in SHAPES}}
        times: dict[str, list[float]] = {"onednn": [], "kernel": []}
        for path in times:
            step(path, xs)  # warm-up (oneDNN builds its primitive for this row count)
        for _ in range(args.repeats):
            for path in times:
                times[path].append(step(path, xs))
        med = {path: statistics.median(t) for path, t in times.items()}
        row = {
            "rows": rows,
            "median_ms": {p: round(1e3 * t, 2) for p, t in med.items()},
            "weight_gb_per_s": {p: round(nbytes / t / 1e9, 1) for p, t in med.items()},
            "gflop_per_s": {
                p: round(rows * nbytes / dtype.itemsize * 2 / t / 1e9) for p, t in med.items()
            },
            "kernel_speedup": round(med["onednn"] / med["kernel"], 2),
        }
        results.append(row)
        print(
            f"rows {rows:>4}: oneDNN {row['median_ms']['onednn']:7.2f} ms "
            f"({row['weight_gb_per_s']['onednn']:5.1f} GB/s)  kernel "
            f"{row['median_ms']['kernel']:7.2f} ms ({row['weight_gb_per_s']['kernel']:5.1f} GB/s)"
            f"  {row['kernel_speedup']:.2f}x"
        )
    out = {
        "machine": {"cpu": platform.processor() or platform.machine(), "threads": args.threads},
        "dtype": args.dtype,
        "weights_mb": round(nbytes / 1e6, 1),
        "repeats": args.repeats,
        "results": results,
        "command": "benchmarks/small_rows_linear.py " + " ".join(sys.argv[1:]),
    }
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
