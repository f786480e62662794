"""The prefill chunk size (`--max-num-batched-tokens`, the step's token budget) vs prefill speed
and the latency a chunk adds to the decode steps that share it.

For each budget: TTFT of one long prompt alone (its prefill in budget-sized chunks,
max_tokens 1), and the step time of 4 decoding requests while that prompt is prefilled beside
them (an aggregated or queue-aware node: every step carries a chunk, so the running requests'
inter-token latency is the step time) vs the plain decode step. The engines (one per budget)
are built once and run in alternating rounds; medians are reported.

    .venv/bin/python benchmarks/prefill_chunk_size.py --model build/gguf/SmolLM2-135M-Instruct.Q4_1-<key>
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pdserve.engine import LLM, SamplingParams  # noqa: E402


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", required=True, help="model directory or GGUF file")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--budgets", type=int, nargs="+", default=[256, 512, 1024, 2048, 4096])
    p.add_argument("--prompt-len", type=int, default=4096)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/prefill_chunk_size.json"))
    return p.parse_args()


def prefill_s(llm: LLM, prompt: list[int]) -> float:
    llm.reset_prefix_cache()
    start = time.perf_counter()
    llm.generate([prompt], SamplingParams(max_tokens=1, ignore_eos=True), use_tqdm=False)
    return time.perf_counter() - start


def step_times(llm: LLM, prompt: list[int], decoders: list[list[int]]) -> tuple[float, float]:
    """(median step with a chunk of prompt beside 4 decodes, median plain decode step)."""
    engine = llm.engine
    llm.reset_prefix_cache()
    params = SamplingParams(max_tokens=4096, ignore_eos=True)
    ids = [f"d{i}-{time.monotonic_ns()}" for i in range(len(decoders))]
    for rid, tokens in zip(ids, decoders, strict=True):
        engine.add_request(rid, tokens, params)
    for _ in range(8):  # the decoders' own prefills, then plain decode steps
        engine.step()
    plain = []
    for _ in range(8):
        start = time.perf_counter()
        engine.step()
        plain.append(time.perf_counter() - start)
    long_id = f"p-{time.monotonic_ns()}"
    engine.add_request(long_id, prompt, SamplingParams(max_tokens=1, ignore_eos=True))
    mixed = []
    budget = engine.scheduler.config.max_num_batched_tokens
    for _ in range(max(1, len(prompt) // budget - 1)):  # steps that carry a whole chunk
        start = time.perf_counter()
        engine.step()
        mixed.append(time.perf_counter() - start)
    for rid in [*ids, long_id]:
        engine.abort_request(rid)
    for _ in range(2):
        engine.step()
    return statistics.median(mixed), statistics.median(plain)


def main() -> None:
    args = parse_args()
    rng = random.Random(0)
    prompt = [rng.randrange(100, 40000) for _ in range(args.prompt_len)]
    decoders = [[rng.randrange(100, 40000) for _ in range(256)] for _ in range(4)]
    engines = {
        b: LLM(model=args.model, dtype=args.dtype, max_num_batched_tokens=b,
               max_model_len=max(8192, args.prompt_len + 16))
        for b in args.budgets
    }  # fmt: skip
    for llm in engines.values():
        prefill_s(llm, prompt[:64])  # warm-up
    ttft: dict[int, list[float]] = {b: [] for b in args.budgets}
    mixed: dict[int, list[float]] = {b: [] for b in args.budgets}
    plain: dict[int, list[float]] = {b: [] for b in args.budgets}
    for r in range(args.rounds):
        order = args.budgets if r % 2 == 0 else args.budgets[::-1]
        for b in order:
            ttft[b].append(prefill_s(engines[b], prompt))
            m, p = step_times(engines[b], prompt, decoders)
            mixed[b].append(m)
            plain[b].append(p)
            print(f"round {r + 1} budget {b}: prefill {ttft[b][-1]:.2f} s, step with a chunk "
                  f"{1e3 * m:.0f} ms (plain decode {1e3 * p:.0f} ms)", flush=True)  # fmt: skip
    rows = []
    for b in args.budgets:
        t = statistics.median(ttft[b])
        rows.append({
            "max_num_batched_tokens": b,
            "prefill_s": round(t, 3),
            "prefill_tokens_per_s": round(args.prompt_len / t),
            "decode_step_with_chunk_ms": round(1e3 * statistics.median(mixed[b]), 1),
            "decode_step_plain_ms": round(1e3 * statistics.median(plain[b]), 1),
        })  # fmt: skip
    for row in rows:
        print(row)
    result = {"model": args.model, "dtype": args.dtype, "prompt_len": args.prompt_len,
              "rounds": args.rounds, "rows": rows,
              "command": "benchmarks/prefill_chunk_size.py " + " ".join(sys.argv[1:])}  # fmt: skip
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
