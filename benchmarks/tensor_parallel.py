"""Tensor parallelism's cost on this 2-core CPU: offline throughput at TP 1 (one process, one
thread) vs TP 2 (two processes, one thread each, gloo), on the small random Llama
(`make-model --preset small`, fp32), 16 requests of 64-token prompts and 32 greedy output
tokens, rounds alternating. TP here is for correctness (it is the same cores either way); the
ratio shows the per-step price of the broadcasts and all-reduces. Writes
benchmarks/results/tensor_parallel.json.

    .venv/bin/python benchmarks/tensor_parallel.py [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

from pdserve.engine import LLM, SamplingParams
from pdserve.make_model import make_model


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    model = str(Path(tempfile.mkdtemp(prefix="tp_bench_")) / "small")
    make_model("llama", "small", model, seed=0)
    torch.set_num_threads(1)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 8000) for _ in range(64)] for _ in range(16)]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    engines = {tp: LLM(model, dtype="float32", tensor_parallel_size=tp) for tp in (1, 2)}
    outputs = {}
    for llm in engines.values():
        llm.generate(prompts[:2], params, use_tqdm=False)  # warm-up
    rates: dict[int, list[float]] = {1: [], 2: []}
    for _ in range(args.rounds):
        for tp, llm in engines.items():
            llm.reset_prefix_cache()
            start = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            rates[tp].append(16 * 32 / (time.perf_counter() - start))
            outputs[tp] = [o.outputs[0].token_ids for o in outs]
    for llm in engines.values():
        llm.engine.close()
    medians = {tp: statistics.median(r) for tp, r in rates.items()}
    result = {
        "model": "make-model llama small (fp32)",
        "requests": 16,
        "prompt_tokens": 64,
        "output_tokens": 32,
        "threads_per_rank": 1,
        "tokens_per_s": rates,
        "median_tokens_per_s": medians,
        "tp2_over_tp1": medians[2] / medians[1],
        "outputs_equal": outputs[1] == outputs[2],
    }
    out = Path(__file__).parent / "results" / "tensor_parallel.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
