"""TTFT of one long prompt through `pdserve serve` (1 prefill + 1 decode node, KV over UCX):
the prefill node computes the prompt in chunks and pushes its KV blocks, the decode node
samples on. One request at a time, each a fresh random prompt (no prefix-cache hit), streamed;
TTFT is the time from sending the request to the first streamed token, measured by the client.

    .venv/bin/python benchmarks/serve_long_prompt_ttft.py                 # 1k, 4k, 8k; ~3 min
    .venv/bin/python benchmarks/serve_long_prompt_ttft.py --lengths 1024 --runs 2
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import statistics
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks._serve import serve_stack, smollm2_gguf  # noqa: E402

logger = logging.getLogger("serve_long_prompt_ttft")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default=None, help="model dir or GGUF (default: SmolLM2-135M GGUF)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 8000])
    p.add_argument("--runs", type=int, default=3, help="prompts per length")
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/serve_long_prompt_ttft.json"))
    return p.parse_args()


def ttft_s(url: str, prompt: list[int]) -> float:
    body = {"model": "m", "prompt": prompt, "max_tokens": 2, "temperature": 0,
            "ignore_eos": True, "stream": True}  # fmt: skip
    start = time.perf_counter()
    with httpx.stream("POST", url, json=body, timeout=600) as reply:
        reply.raise_for_status()
        for line in reply.iter_lines():
            if line.startswith("data: ") and '"text"' in line:
                return time.perf_counter() - start
    raise RuntimeError("the stream ended without a token")


def main() -> int:
    args = parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    model = args.model or smollm2_gguf()
    rng = random.Random(0)
    results: dict[int, list[float]] = {n: [] for n in args.lengths}
    with serve_stack(model, args.dtype) as base:
        url = f"{base}/v1/completions"
        ttft_s(url, [rng.randrange(100, 40000) for _ in range(300)])  # warm-up
        for _ in range(args.runs):
            for n in args.lengths:
                prompt = [rng.randrange(100, 40000) for _ in range(n)]
                results[n].append(ttft_s(url, prompt))
                logger.info("%d tokens: TTFT %.2f s", n, results[n][-1])
    rows = [{"prompt_tokens": n, "ttft_s": [round(t, 3) for t in ts],
             "median_ttft_s": round(statistics.median(ts), 3),
             "prompt_tokens_per_s": round(n / statistics.median(ts))}
            for n, ts in results.items()]  # fmt: skip
    out = {"model": model, "dtype": args.dtype, "rows": rows,
           "command": "benchmarks/serve_long_prompt_ttft.py " + " ".join(sys.argv[1:])}  # fmt: skip
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    for row in rows:
        logger.info("%(prompt_tokens)6d tokens: TTFT median %(median_ttft_s).2f s "
                    "(%(prompt_tokens_per_s)d tokens/s)", row)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
