"""Issue 17's serving workload run on the engine alone, no server: --num-prompts prompts of
--input-len random tokens, --output-len new tokens each (greedy, ignore_eos), at most
--max-concurrency in flight, a finished request replaced by the next at once (a closed loop,
as `vllm bench serve --max-concurrency` drives a server). What it separates: the engine's own
step times, split into steps with more than SMALL_ROWS_MAX rows (prefill chunks: oneDNN's
products on AVX-512 CPUs) and decode-sized ones, from what the gateway, the client and the
node's I/O add when served.

Each variant is a fresh process with its environment, alternating, --rounds times:

    .venv/bin/python benchmarks/engine_closed_loop.py --model build/gguf/SmolLM2-135M-Instruct.Q4_1-<key> \\
        --variant default= --variant passive_pool=OMP_WAIT_POLICY=PASSIVE,PDSERVE_KERNEL_POOL=1 \\
        --variant passive=OMP_WAIT_POLICY=PASSIVE,PDSERVE_KERNEL_POOL=0

(passive_pool is what `pdserve serve` gives one aggregated node whose threads fit the cores.)
The compiled layer loop against the Python layers, as an aggregated served node runs:

    .venv/bin/python benchmarks/engine_closed_loop.py --model M --max-prefill-tokens-while-decoding 96 \\
        --idle 20 --rounds 3 --variant loop= --variant python_layers=PDSERVE_COMPILED_LAYERS=0
Writes --out (JSON: every round's wall time, output tokens/s and step split per variant).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

logger = logging.getLogger("engine_closed_loop")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", required=True, help="HF model directory (or GGUF file)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=512,
        help="token budget per step (default: 512, serve's for an aggregated node)",
    )
    p.add_argument("--num-prompts", type=int, default=40)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--max-concurrency", type=int, default=8)
    p.add_argument(
        "--max-prefill-tokens-while-decoding",
        type=int,
        default=None,
        help="the engine flag (serve gives an aggregated node 96; default: none)",
    )
    p.add_argument(
        "--idle",
        type=float,
        default=0.0,
        help="seconds each round waits after the engine starts, as a served node idles before "
        "its load: the KV cache's pages are faulted in meanwhile (default 0)",
    )
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    p.add_argument("--rounds", type=int, default=2, help="alternating rounds of every variant")
    p.add_argument(
        "--variant",
        action="append",
        default=[],
        help="NAME=VAR=VALUE,VAR=VALUE...: a process environment to run (repeatable; "
        "default: one variant, this environment)",
    )
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/engine_closed_loop.json"))
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def child(args: argparse.Namespace) -> dict:
    """One round in this process: a warm-up of other prompts, then the timed loop."""
    import torch

    from pdserve.engine import LLM, SamplingParams
    from pdserve.engine.models.llama import SMALL_ROWS_MAX

    torch.set_num_threads(args.threads)
    llm = LLM(
        model=args.model,
        dtype=args.dtype,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_prefill_tokens_while_decoding=args.max_prefill_tokens_while_decoding,
        seed=0,
    )
    time.sleep(args.idle)
    engine = llm.engine
    rng = random.Random(1)
    n_warm = args.max_concurrency
    prompts = [
        [rng.randrange(100, 20000) for _ in range(args.input_len)]
        for _ in range(args.num_prompts + n_warm)
    ]
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    rows_of_step: list[int] = []
    schedule = engine.scheduler.schedule

    def counted():
        out = schedule()
        rows_of_step.append(sum(len(c.token_ids) for c in out.chunks))
        return out

    engine.scheduler.schedule = counted

    def loop(batch: list[list[int]], tag: str) -> tuple[float, list[float], list[int]]:
        rows_of_step.clear()
        waiting, in_flight, done, times = list(range(len(batch))), 0, 0, []
        deadline = time.monotonic() + 1800
        start = time.perf_counter()
        while done < len(batch):
            if time.monotonic() > deadline:
                raise TimeoutError("the closed loop did not finish in 30 min")
            while in_flight < args.max_concurrency and waiting:
                i = waiting.pop(0)
                engine.add_request(f"{tag}-{i}", batch[i], params)
                in_flight += 1
            t0 = time.perf_counter()
            out = engine.step()
            times.append(time.perf_counter() - t0)
            for update in out.updates:
                if update.finished:
                    in_flight -= 1
                    done += 1
        return time.perf_counter() - start, times, list(rows_of_step)

    loop(prompts[args.num_prompts :], "warm")
    if not llm.reset_prefix_cache():
        raise RuntimeError("requests still hold KV blocks after the warm-up")
    wall, times, rows = loop(prompts[: args.num_prompts], "run")
    big = [t for t, r in zip(times, rows, strict=True) if r > SMALL_ROWS_MAX]
    small = [t for t, r in zip(times, rows, strict=True) if r <= SMALL_ROWS_MAX]
    return {
        "wall_s": wall,
        "output_tokens_per_s": args.num_prompts * args.output_len / wall,
        "steps": len(times),
        "prefill_steps": len(big),
        "prefill_steps_s": sum(big),
        "decode_steps": len(small),
        "decode_steps_s": sum(small),
        "decode_step_median_ms": statistics.median(small) * 1e3 if small else None,
    }


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.child:
        print(json.dumps(child(args)))
        return
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    variants: dict[str, dict[str, str]] = {}
    for spec in args.variant or ["this="]:
        name, _, env = spec.partition("=")
        variants[name] = dict(kv.split("=", 1) for kv in env.split(",") if kv)
    argv_child = list(argv if argv is not None else sys.argv[1:])
    results: dict[str, list[dict]] = {name: [] for name in variants}
    for rnd in range(args.rounds):
        for name, env in variants.items():
            proc = subprocess.run(
                [sys.executable, __file__, *argv_child, "--child"],
                env={**os.environ, **env},
                capture_output=True,
                text=True,
                timeout=1900,
                check=False,
            )
            if proc.returncode != 0:
                raise SystemExit(f"variant {name} failed:\n{proc.stderr[-3000:]}")
            row = json.loads(proc.stdout.strip().splitlines()[-1])
            results[name].append(row)
            logger.info(
                "round %d %s: %.2f s, %.1f output tok/s; prefill steps %d in %.2f s, "
                "decode steps %d in %.2f s (median %.1f ms)",
                rnd,
                name,
                row["wall_s"],
                row["output_tokens_per_s"],
                row["prefill_steps"],
                row["prefill_steps_s"],
                row["decode_steps"],
                row["decode_steps_s"],
                row["decode_step_median_ms"],
            )
    summary = {
        name: statistics.median(r["output_tokens_per_s"] for r in rows)
        for name, rows in results.items()
    }
    for name, tps in summary.items():
        logger.info("%s: median %.1f output tok/s", name, tps)
    out = {
        "args": {k: v for k, v in vars(args).items() if k != "child"},
        "variants": variants,
        "rounds": results,
        "median_output_tokens_per_s": summary,
    }
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    logger.info("wrote %s", args.out)


if __name__ == "__main__":
    main()
