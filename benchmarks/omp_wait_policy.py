"""`pdserve serve` (1 prefill + 1 decode node on this machine's cores) with OpenMP threads
spinning while idle (OMP_WAIT_POLICY=ACTIVE, libgomp's default behaviour) vs sleeping
(PASSIVE, what serve now sets for its children): the same burst of requests, alternating
rounds. Writes benchmarks/results/omp_wait_policy.json.

    .venv/bin/python benchmarks/omp_wait_policy.py --rounds 2
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks._serve import serve_stack, smollm2_gguf  # noqa: E402

logger = logging.getLogger("omp_wait_policy")


def one_round(model: str, policy: str, prompts: list[list[int]], max_tokens: int) -> float:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    if policy.startswith("SPIN"):  # libgomp's default policy with this spin count
        env["GOMP_SPINCOUNT"] = policy.removeprefix("SPIN")
    else:
        env["OMP_WAIT_POLICY"] = policy
    with serve_stack(model, "bfloat16", env=env) as base:
        url = f"{base}/v1/completions"

        def one(prompt: list[int]) -> None:
            body = {"model": "m", "prompt": prompt, "max_tokens": max_tokens,
                    "temperature": 0, "ignore_eos": True}  # fmt: skip
            reply = httpx.post(url, json=body, timeout=600)
            reply.raise_for_status()

        one(prompts[0][:8])  # warm-up
        start = time.monotonic()
        with ThreadPoolExecutor(len(prompts)) as pool:
            list(pool.map(one, prompts))
        return time.monotonic() - start


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default=None, help="model dir or GGUF (default: SmolLM2-135M GGUF)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--policies", nargs="+", default=["ACTIVE", "PASSIVE"],
                   help="ACTIVE, PASSIVE, or SPIN<n>: libgomp's default with GOMP_SPINCOUNT=n")  # fmt: skip
    p.add_argument("--num-requests", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=300)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/omp_wait_policy.json"))
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    model = args.model or smollm2_gguf()
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 40000) for _ in range(args.prompt_len)]
               for _ in range(args.num_requests)]  # fmt: skip
    times: dict[str, list[float]] = {policy: [] for policy in args.policies}
    for r in range(args.rounds):
        for policy in args.policies if r % 2 == 0 else args.policies[::-1]:
            times[policy].append(one_round(model, policy, prompts, args.max_tokens))
            logger.info("round %d %s: %.1f s", r + 1, policy, times[policy][-1])
    medians = {k: statistics.median(v) for k, v in times.items()}
    result = {"model": model, "seconds": times, "median_s": medians,
              "passive_speedup": medians.get("ACTIVE", 0) / medians.get("PASSIVE", 1),
              "workload": vars(args), "command": " ".join(["benchmarks/omp_wait_policy.py", *sys.argv[1:]])}  # fmt: skip
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    logger.info("medians: %s", ", ".join(f"{k} {v:.1f} s" for k, v in medians.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
