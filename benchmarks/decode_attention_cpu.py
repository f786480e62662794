"""The CPU decode attention kernel alone (pdserve_kernels/cpu/paged_attention.cpp): one layer's
call over shuffled blocks, SmolLM2's heads (9 query / 3 kv, head_dim 64, blocks of 16), for a
few long contexts and many short ones, in bf16 and float32. Reports ms a call and the K/V
bytes read per second (compare with the machine's read bandwidth). Median of --reps rounds.

As in the engine, each layer's cache is a lazily mapped one on transparent huge pages
(host_memory.zeroed_lazily) holding twice the blocks the requests use, and a round calls
--layers layers' caches in turn, so the K/V comes from memory, not from the last call's cache.

    .venv/bin/python benchmarks/decode_attention_cpu.py
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pdserve.engine.host_memory import zeroed_lazily  # noqa: E402
from pdserve.kernels.cpu import cpu_ops  # noqa: E402


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--reps", type=int, default=15, help="timed rounds per case")
    p.add_argument("--layers", type=int, default=8, help="layer caches called in turn a round")
    p.add_argument(
        "--cases",
        nargs="+",
        default=["4x7680", "48x450"],
        help="REQUESTSxCONTEXT cases (default: %(default)s)",
    )
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/decode_attention_cpu.json"))
    return p.parse_args()


def main() -> None:
    args = parse_args()
    ops = cpu_ops()
    if ops is None:
        raise SystemExit("the CPU kernels do not build here")
    torch.manual_seed(0)
    block, hkv, hq, d = 16, 3, 9, 64
    rows = []
    for dtype in (torch.bfloat16, torch.float32):
        for case in args.cases:
            reqs, ctx = (int(v) for v in case.split("x"))
            per_req = -(-ctx // block)
            num_blocks = 2 * reqs * per_req + 1
            caches, tables = [], []
            for _ in range(args.layers):
                cache = zeroed_lazily((num_blocks, 2, hkv, block, d), dtype)
                cache.copy_(torch.randn(cache.shape))
                caches.append(cache)
                used = torch.randperm(num_blocks - 1)[: reqs * per_req] + 1
                tables.append(used.view(reqs, per_req).contiguous())
            lens = torch.full((reqs,), ctx, dtype=torch.int64)
            q = torch.randn(reqs, hq, d).to(dtype)
            for cache, table in zip(caches, tables, strict=True):  # warm-up
                ops.paged_decode_attention(q, cache, table, lens, d**-0.5, 0)
            times = []
            for _ in range(args.reps):
                t0 = time.perf_counter()
                for cache, table in zip(caches, tables, strict=True):
                    ops.paged_decode_attention(q, cache, table, lens, d**-0.5, 0)
                times.append((time.perf_counter() - t0) / args.layers)
            s = statistics.median(times)
            kv_bytes = reqs * ctx * 2 * hkv * d * caches[0].element_size()
            rows.append(
                {
                    "dtype": str(dtype).removeprefix("torch."),
                    "requests": reqs,
                    "context": ctx,
                    "ms": round(s * 1e3, 3),
                    "kv_gb_per_s": round(kv_bytes / s / 1e9, 2),
                }
            )
            r = rows[-1]
            print(
                f"{r['dtype']:>9} {reqs:>3} x {ctx:<5} {r['ms']:7.2f} ms  {r['kv_gb_per_s']:5.1f} GB/s"
            )
    result = {"reps": args.reps, "layers": args.layers, "rows": rows}
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
