"""Where a long prefill's time goes, per op (torch.profiler), with prefill attention on the
compiled CPU kernel and on the torch SDPA path (the engine before issue 22): one prompt of L
random tokens through `engine.LLM`, max_tokens 1, prefix cache reset between runs. The kernel
call is not an aten op, so it is wrapped in a record_function named pdserve::prefill_attention.
The paths alternate for --rounds runs each; the profile of each path's last run is kept.

    .venv/bin/python benchmarks/prefill_profile.py --model build/gguf/SmolLM2-135M-Instruct.Q4_1-<key>
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import statistics
import sys
import time
from pathlib import Path

from torch.profiler import ProfilerActivity, profile, record_function

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pdserve.engine import LLM, SamplingParams  # noqa: E402


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", required=True, help="HF-format model directory")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--prompt-len", type=int, default=4096)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--top", type=int, default=12, help="ops listed per path")
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/prefill_profile.json"))
    return p.parse_args()


def main() -> None:
    args = parse_args()
    llm = LLM(
        model=args.model, dtype=args.dtype, max_num_batched_tokens=args.max_num_batched_tokens
    )
    backend = llm.engine.runner.attention  # the runner's CpuAttention
    kernels = backend.kernels
    kernel = kernels.prefill
    assert kernel is not None, "the CPU kernels did not build"

    def traced_kernel(*a) -> None:
        with record_function("pdserve::prefill_attention"):
            kernel(*a)

    rng = random.Random(0)
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    llm.generate([[5] * 8], params, use_tqdm=False)  # warm-up
    paths = {"kernel": traced_kernel, "torch": None}
    seconds: dict[str, list[float]] = {name: [] for name in paths}
    tables: dict[str, list[dict]] = {}
    for _ in range(args.rounds):
        for name, fn in paths.items():
            backend.kernels = dataclasses.replace(kernels, prefill=fn)  # None: torch SDPA
            llm.reset_prefix_cache()
            prompt = [rng.randrange(17, 49152) for _ in range(args.prompt_len)]
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                t0 = time.perf_counter()
                llm.generate([prompt], params, use_tqdm=False)
                seconds[name].append(time.perf_counter() - t0)
            events = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
            total = sum(e.self_cpu_time_total for e in events)
            tables[name] = [
                {
                    "op": e.key,
                    "self_ms": round(e.self_cpu_time_total / 1e3, 1),
                    "share": round(e.self_cpu_time_total / total, 3),
                    "calls": e.count,
                }
                for e in events[: args.top]
            ]
    backend.kernels = kernels
    result = {
        "model": args.model,
        "dtype": args.dtype,
        "prompt_len": args.prompt_len,
        "seconds": seconds,
        "median_s": {name: statistics.median(s) for name, s in seconds.items()},
        "top_ops": tables,
    }
    for name, rows in tables.items():
        print(f"\n{name}: median {result['median_s'][name]:.2f} s (profiled)")
        for row in rows:
            print(
                f"  {row['self_ms']:>9.1f} ms {row['share']:>6.1%} {row['calls']:>6}  {row['op']}"
            )
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
