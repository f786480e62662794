"""Prefill attention on the CPU, per call: the compiled kernel (pdserve_kernels/cpu/
prefill_attention.cpp) vs the engine's torch path (engine/attention.py `_prefill_attention`:
torch SDPA per request, the cached prefix gathered first), on SmolLM2-135M's attention shapes
(9 query heads, 3 KV heads, head_dim 64, 16-token blocks in shuffled order).

Cases: a whole prompt of T tokens (T = 256, 1k, 4k, 8k), and the last C-token chunk of a
T-token prompt computed in chunks (over a cached prefix of T - C; C = 512, or --chunks). The
two paths alternate call by call (kernel, torch, torch, kernel, ...), so a drift in the shared
machine's speed hits both alike; each reports its median, the ratio is torch / kernel.

    .venv/bin/python benchmarks/prefill_attention_cpu.py          # both dtypes, ~3 min here
    .venv/bin/python benchmarks/prefill_attention_cpu.py --dtypes bfloat16 --lengths 256 1024
    .venv/bin/python benchmarks/prefill_attention_cpu.py --lengths 224 512 --chunks 56 --repeats 50
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

from pdserve.engine.attention import PrefillSeq, _prefill_attention  # noqa: E402
from pdserve.kernels.cpu import cpu_ops  # noqa: E402

HQ, HKV, D, BLOCK = 9, 3, 64, 16
CHUNK = 512


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--lengths", type=int, nargs="+", default=[256, 1024, 4096, 8192])
    p.add_argument(
        "--chunks",
        type=int,
        nargs="+",
        default=[CHUNK],
        help="chunk lengths: the last chunk of each length over a cached prefix, for every "
        "T longer than it (default: 512; a step beside decodes takes small ones, e.g. 56)",
    )
    p.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    p.add_argument("--repeats", type=int, default=6, help="timed calls per path and case")
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/prefill_attention_cpu.json"))
    return p.parse_args()


def make_case(ctx: int, qlen: int, dtype: torch.dtype) -> dict:
    """A sequence of ctx tokens whose last qlen are this step's, its K/V already in a cache of
    shuffled blocks (as the engine stores them before attending)."""
    g = torch.Generator().manual_seed(ctx + qlen)
    nb = -(-ctx // BLOCK)
    cache = torch.randn(nb + 1, 2, HKV, BLOCK, D, generator=g).to(dtype)
    table = torch.randperm(nb, generator=g) + 1
    q = torch.randn(qlen, HQ, D, generator=g).to(dtype)
    pos = torch.arange(ctx - qlen, ctx)
    blocks, offsets = table[pos // BLOCK], pos % BLOCK
    k = cache[blocks, 0, :, offsets]  # this step's K/V, as the model passes them in
    v = cache[blocks, 1, :, offsets]
    seq = PrefillSeq(0, qlen, ctx, table)
    return {"q": q, "k": k, "v": v, "cache": cache, "seq": seq}


def run_torch(c: dict) -> torch.Tensor:
    return _prefill_attention(c["q"], c["k"], c["v"], c["cache"], c["seq"], D**-0.5)


def run_kernel(ops, c: dict, out: torch.Tensor) -> torch.Tensor:
    seq = c["seq"]
    ops.paged_prefill_attention_out(
        c["q"], c["cache"], torch.tensor([0]), torch.tensor([seq.query_len]),
        torch.tensor([seq.context_len]), seq.block_table[None], D**-0.5, out, 0,
    )  # fmt: skip
    return out


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def measure(ops, c: dict, repeats: int) -> dict:
    out = torch.empty_like(c["q"])
    want = run_torch(c)  # warm-up of both, and the outputs agree
    got = run_kernel(ops, c, out)
    err = (got.float() - want.float()).abs().max().item()
    times: dict[str, list[float]] = {"kernel": [], "torch": []}
    for i in range(repeats):
        order = ("kernel", "torch") if i % 2 == 0 else ("torch", "kernel")
        for path in order:
            fn = (lambda: run_kernel(ops, c, out)) if path == "kernel" else (lambda: run_torch(c))
            times[path].append(timed(fn))
    kernel_s, torch_s = statistics.median(times["kernel"]), statistics.median(times["torch"])
    return {
        "kernel_ms": round(kernel_s * 1e3, 3),
        "torch_ms": round(torch_s * 1e3, 3),
        "speedup": round(torch_s / kernel_s, 2),
        "max_abs_diff": err,
    }


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    ops = cpu_ops()
    assert ops is not None, "the CPU kernels did not build"
    rows = []
    for dtype_name in args.dtypes:
        dtype = getattr(torch, dtype_name)
        for t in args.lengths:
            cases = [("prompt", t, t)] + [("chunk", t, c) for c in args.chunks if t > c]
            for kind, ctx, qlen in cases:
                row = {"dtype": dtype_name, "case": kind, "context_len": ctx, "query_len": qlen}
                row |= measure(ops, make_case(ctx, qlen, dtype), args.repeats)
                print(json.dumps(row), flush=True)
                rows.append(row)
    result = {
        "machine": {"cpu": platform.processor() or platform.machine(), "threads": args.threads},
        "shapes": {"num_q_heads": HQ, "num_kv_heads": HKV, "head_dim": D, "block_size": BLOCK},
        "repeats": args.repeats,
        "rows": rows,
    }
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
