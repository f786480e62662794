"""Decode at long context: where a decode step's time goes once every request holds thousands
of tokens, and the decode attention kernel's bytes/s against this machine's read bandwidth.

Four prompts of L random tokens are prefilled once (max_tokens 1); the same prompts then decode
64 tokens each twice over prefix-cache hits (their prefill is one token), the second time under
torch.profiler with the compiled kernels wrapped in record_function (that run through the
Python layers: the compiled layer loop calls the kernels from C++, out of the profiler's
sight). Also measured here: a plain 2-thread read of a 1 GiB fp32 tensor (torch.sum), the
ceiling a bandwidth-bound kernel is compared with.

With --vllm-dir, vLLM's CPU build decodes the same prompts the same way in the same minutes
(benchmarks/_vllm_offline.py, resident in its own venv, stopped while pdserve runs): its prefix
cache primed by one full run, then --rounds runs of the 64-token decodes over cache hits,
alternating with pdserve's unprofiled runs; each side reports its median run and tokens/s,
and how many requests' greedy outputs agree.

    .venv/bin/python benchmarks/decode_long_context.py --model build/gguf/SmolLM2-135M-Instruct.Q4_1-<key>
    .venv/bin/python benchmarks/decode_long_context.py --model ... --dtype float32 --vllm-dir /work/vllm-cpu
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import random
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch
from torch.profiler import ProfilerActivity, profile, record_function

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pdserve.engine import LLM, SamplingParams  # noqa: E402


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", required=True, help="HF-format model directory or GGUF file")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--prompt-len", type=int, default=7680, help="tokens per prompt (L)")
    p.add_argument("--num-requests", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=64, help="tokens decoded per request")
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/decode_long_context.json"))
    p.add_argument(
        "--vllm-dir",
        default=None,
        help="vLLM CPU install holding env.sh (../shared/peers/vllm-cpu-setup.sh): also time "
        "vLLM's decode of the same prompts (default: pdserve only)",
    )
    p.add_argument("--rounds", type=int, default=2, help="timed runs per system (with --vllm-dir)")
    p.add_argument(
        "--vllm-timeout", type=float, default=3600, help="seconds any vLLM step may take"
    )
    return p.parse_args()


def vllm_session(args: argparse.Namespace, prompts: list[list[int]], max_position: int):
    """The resident vLLM of benchmarks/offline_throughput.py for these prompts, its prefix cache
    primed by one full run (prefill included, ~2 minutes at 4 x 7680 in float32 here)."""
    from offline_throughput import VllmSession

    settings = SimpleNamespace(
        vllm_timeout=args.vllm_timeout,
        max_num_seqs=args.num_requests,
        max_num_batched_tokens=2048,
        seed=0,
        vllm_enforce_eager=False,
        vllm_dir=args.vllm_dir,
    )
    workload = {"prompts": prompts, "max_tokens": [args.max_tokens] * len(prompts)}
    session = VllmSession(
        settings,
        str(Path(args.model).resolve()),  # vLLM runs in a temporary folder
        args.dtype,
        workload,
        {"max_position_embeddings": max_position},
    )
    try:
        session.run(0)
    except BaseException:
        session.close()
        raise
    return session


def read_bandwidth() -> float:
    """GB/s of torch.sum over 1 GiB of fp32 (best of 5), with the current thread count."""
    x = torch.ones(256 * 1024 * 1024, dtype=torch.float32)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t0)
    return x.numel() * 4 / best / 1e9


def main() -> None:
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    args = parse_args()
    llm = LLM(model=args.model, dtype=args.dtype)
    backend = llm.engine.runner.attention
    kernels = backend.kernels
    assert kernels is not None and kernels.decode is not None, "the CPU kernels did not build"

    def traced(name, fn):
        def call(*a):
            with record_function(name):
                return fn(*a)

        return call

    backend.kernels = dataclasses.replace(
        kernels,
        decode=traced("pdserve::decode_attention", kernels.decode),
        prefill=traced("pdserve::prefill_attention", kernels.prefill),
        store=traced("pdserve::kv_store", kernels.store),
    )
    rng = random.Random(0)
    prompts = [
        [rng.randrange(17, 49152) for _ in range(args.prompt_len)] for _ in range(args.num_requests)
    ]
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True),
                 use_tqdm=False)  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    vllm = None
    if args.vllm_dir:
        vllm = vllm_session(args, prompts, llm.engine.runner.arch.max_position_embeddings)
    pdserve_runs: list[float] = []
    vllm_runs: list[float] = []
    agree = None
    try:
        for r in range(args.rounds if vllm is not None else 1):
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            pdserve_runs.append(time.perf_counter() - t0)
            if vllm is not None:
                res = vllm.run(r + 1, cached=True)
                vllm_runs.append(res["generate_s"])
                ours = [list(o.outputs[0].token_ids) for o in outs]
                agree = sum(a == b for a, b in zip(ours, res["output_token_ids"], strict=True))
    finally:
        if vllm is not None:
            vllm.close()
    plain_s = statistics.median(pdserve_runs)
    # The profiled run takes the Python layers: the compiled layer loop calls the same kernels
    # from C++, where no record_function sees them (the timed runs above keep the loop).
    model = llm.engine.runner.model
    model.use_compiled_layers = False
    try:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            t0 = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            profiled_s = time.perf_counter() - t0
    finally:
        del model.use_compiled_layers  # back to the class's setting
    events = {e.key: e for e in prof.key_averages()}
    decode = events["pdserve::decode_attention"]
    arch = llm.engine.runner.arch
    layers = decode.count // max(1, args.max_tokens - 1)
    kv_heads, head_dim = arch.num_kv_heads, arch.head_dim
    itemsize = torch.empty(0, dtype=getattr(torch, args.dtype)).element_size()
    context = args.prompt_len + args.max_tokens / 2  # mean context over the decode steps
    bytes_per_call = args.num_requests * context * kv_heads * head_dim * 2 * itemsize
    call_s = decode.self_cpu_time_total / 1e6 / decode.count
    steps = args.max_tokens - 1
    result = {
        "model": args.model,
        "dtype": args.dtype,
        "prompt_len": args.prompt_len,
        "num_requests": args.num_requests,
        "decode_run_s": round(plain_s, 3),
        "ms_per_step": round(plain_s / steps * 1e3, 1),
        "profiled_run_s": round(profiled_s, 3),
        "decode_attention_ms_per_step": round(decode.self_cpu_time_total / 1e3 / steps, 1),
        "decode_attention_ms_per_call": round(call_s * 1e3, 3),
        "layers": layers,
        "kv_bytes_per_call": int(bytes_per_call),
        "decode_attention_gb_s": round(bytes_per_call / call_s / 1e9, 1),
        "read_bandwidth_gb_s": round(read_bandwidth(), 1),
        "threads": torch.get_num_threads(),
    }
    if vllm_runs:
        tokens = args.num_requests * args.max_tokens
        vllm_s = statistics.median(vllm_runs)
        result["vs_vllm"] = {
            "method": "both: the same prompts already in the prefix cache, max_tokens "
            f"{args.max_tokens} (one recomputed prompt token, then decode steps), median of "
            f"{len(vllm_runs)} alternating runs",
            "pdserve_runs_s": [round(t, 3) for t in pdserve_runs],
            "vllm_runs_s": [round(t, 3) for t in vllm_runs],
            "pdserve_tokens_per_s": round(tokens / plain_s, 1),
            "vllm_tokens_per_s": round(tokens / vllm_s, 1),
            "pdserve_vs_vllm": round(vllm_s / plain_s, 2),
            "same_greedy_outputs": f"{agree} / {args.num_requests}",
        }
    top = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:8]
    result["top_ops"] = [
        {"op": e.key, "self_ms": round(e.self_cpu_time_total / 1e3, 1), "calls": e.count}
        for e in top
    ]
    print(json.dumps(result, indent=2))
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
