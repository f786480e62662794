"""Offline throughput with LoRA adapters vs the base model alone, on a bench-size random Llama
(`pdserve make-model --preset bench`, ~110M parameters, bf16).

One engine with --enable-lora (max_loras 4, rank 16); the same prompts at once (batch 32,
greedy, ignore_eos, max_tokens 64) three ways, rounds alternating so noise falls on all:
the base model for every request, one adapter (all projections) for every request, and four
adapters plus the base interleaved. Also the base model on an engine without LoRA, to show
what enabling it costs base requests (nothing: no token uses a slot, the masks are skipped).
Reports generated tokens per second and ratios to the LoRA-less base; writes
benchmarks/results/lora_overhead.json.

    .venv/bin/python benchmarks/lora_overhead.py [--rounds 3] [--batch 32]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

from pdserve.engine import LLM, LoRARequest, SamplingParams
from pdserve.make_model import make_model


def make_adapters(base: str, out: Path, count: int, rank: int) -> list[LoRARequest]:
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.lora_adapters import make_adapter  # the tests' maker: random PEFT adapters

    return [
        LoRARequest(f"a{i}", i, make_adapter(base, out / f"a{i}", seed=i, rank=rank))
        for i in range(1, count + 1)
    ]


def timed(llm: LLM, prompts, params, loras) -> float:
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
    elapsed = time.perf_counter() - start
    return sum(len(o.outputs[0].token_ids) for o in outs) / elapsed


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rank", type=int, default=16)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="lora_bench_"))
    base = str(work / "base")
    make_model("llama", "bench", base, seed=0)
    adapters = make_adapters(base, work, 4, args.rank)
    plain = LLM(base, dtype="bfloat16", max_model_len=512)
    lora = LLM(base, dtype="bfloat16", max_model_len=512, enable_lora=True, max_loras=4,
               max_lora_rank=args.rank)  # fmt: skip
    prompts = [[(7 * i + j) % 2000 + 3 for j in range(32 + i)] for i in range(args.batch)]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    mixes = {
        "base, LoRA off": (plain, None),
        "base, LoRA on": (lora, None),
        "one adapter": (lora, adapters[0]),
        "4 adapters + base": (lora, [([None, *adapters])[i % 5] for i in range(args.batch)]),
    }
    for engine, loras in mixes.values():  # warm-up: kernels, oneDNN primitives, adapter loads
        timed(engine, prompts[:4], params, loras[:4] if isinstance(loras, list) else loras)
    rates: dict[str, list[float]] = {name: [] for name in mixes}
    for _ in range(args.rounds):
        for name, (engine, loras) in mixes.items():
            rates[name].append(timed(engine, prompts, params, loras))
    medians = {name: statistics.median(r) for name, r in rates.items()}
    baseline = medians["base, LoRA off"]
    result = {
        "model": "make-model llama bench (bf16)",
        "batch": args.batch,
        "max_tokens": args.max_tokens,
        "rank": args.rank,
        "max_loras": 4,
        "threads": os.cpu_count(),
        "tokens_per_s": rates,
        "median_tokens_per_s": medians,
        "ratio_to_base_lora_off": {name: m / baseline for name, m in medians.items()},
    }
    out = Path(__file__).parent / "results" / "lora_overhead.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    for name, m in medians.items():
        print(f"{name:>20}: {m:8.1f} tok/s  ({m / baseline:.2f}x)")


if __name__ == "__main__":
    main()
