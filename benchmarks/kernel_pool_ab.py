"""`pdserve serve` with the CPU kernels' own worker pool (pdserve_kernels/cpu/thread_pool.h: idle
workers spin inside a step, sleep between steps) against the same stack with the kernels' loops
on OpenMP (PDSERVE_KERNEL_POOL=0: every loop wakes a sleeping libgomp thread, since serve sets
OMP_WAIT_POLICY=PASSIVE). Alternating server starts, issue 17's serving workload through
`pdserve bench serve` (random token ids, --input-len in / --output-len out, greedy, ignore_eos,
--num-prompts requests, --max-concurrency in flight); each server idles --idle-s first (the KV
cache's prefault) and serves one untimed warm-up run of other prompts. Writes benchmarks/results/kernel_pool_ab.json.

    .venv/bin/python benchmarks/kernel_pool_ab.py --dtype float32 --rounds 2
    .venv/bin/python benchmarks/kernel_pool_ab.py --stack disaggregated
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks._serve import serve_stack, smollm2_gguf  # noqa: E402

logger = logging.getLogger("kernel_pool_ab")

STACKS = {
    # one node computing everything on both cores
    "aggregated": ("--num-prefill", "0", "--num-decode", "1", "--num-threads", "2"),
    # serve's default: 1 prefill + 1 decode node, each with the machine's threads
    "disaggregated": ("--num-prefill", "1", "--num-decode", "1"),
}


def one_round(args: argparse.Namespace, model: str, pool: bool) -> dict[str, float]:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    env["PDSERVE_KERNEL_POOL"] = "1" if pool else "0"
    with serve_stack(model, args.dtype, env=env, nodes=STACKS[args.stack]) as base:
        time.sleep(args.idle_s)
        with tempfile.TemporaryDirectory() as tmp:
            results = []
            for seed, run in ((1, "warmup"), (0, "timed")):  # other prompts: no prefix hits
                out = Path(tmp) / f"{run}.json"
                cmd = [sys.executable, "-m", "pdserve.bench", "serve", "--base-url", base,
                       "--model", "m", "--tokenizer", args.tokenizer or model,
                       "--random-input-len", str(args.input_len),
                       "--random-output-len", str(args.output_len),
                       "--num-prompts", str(args.num_prompts),
                       "--max-concurrency", str(args.max_concurrency), "--ignore-eos",
                       "--temperature", "0", "--seed", str(seed), "--disable-tqdm",
                       "--result-file", str(out)]  # fmt: skip
                subprocess.run(cmd, check=True, timeout=1200, stdout=subprocess.DEVNULL)
                results.append(json.loads(out.read_text()))
    timed = results[-1]
    return {k: timed[k] for k in ("output_throughput", "median_ttft_ms", "median_tpot_ms",
                                  "completed", "duration")}  # fmt: skip


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default=None, help="model dir or GGUF (default: SmolLM2-135M GGUF)")
    p.add_argument(
        "--tokenizer", default=None, help="tokenizer dir for the prompts (default: --model)"
    )
    p.add_argument("--dtype", default="float32")
    p.add_argument("--stack", choices=sorted(STACKS), default="aggregated")
    p.add_argument("--rounds", type=int, default=2, help="server starts per setting")
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--num-prompts", type=int, default=40)
    p.add_argument("--max-concurrency", type=int, default=8)
    p.add_argument("--idle-s", type=float, default=20.0, help="idle seconds after start-up")
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/kernel_pool_ab.json"))
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    model = args.model or smollm2_gguf()
    runs: dict[str, list[dict[str, float]]] = {"pool": [], "openmp": []}
    for r in range(args.rounds):
        for name in ("pool", "openmp") if r % 2 == 0 else ("openmp", "pool"):
            runs[name].append(one_round(args, model, name == "pool"))
            logger.info("round %d %s: %s", r + 1, name, runs[name][-1])
    medians = {
        name: {k: statistics.median(run[k] for run in rs) for k in rs[0]}
        for name, rs in runs.items()
    }
    result = {
        "model": model, "workload": vars(args), "runs": runs, "medians": medians,
        "pool_vs_openmp_throughput": medians["pool"]["output_throughput"]
        / medians["openmp"]["output_throughput"],
        "command": " ".join(["benchmarks/kernel_pool_ab.py", *sys.argv[1:]]),
    }  # fmt: skip
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    for name, m in medians.items():
        logger.info("%s: %.1f tok/s, TTFT p50 %.0f ms, TPOT p50 %.1f ms", name,
                    m["output_throughput"], m["median_ttft_ms"], m["median_tpot_ms"])  # fmt: skip
    logger.info("pool / openmp throughput: %.3fx", result["pool_vs_openmp_throughput"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
