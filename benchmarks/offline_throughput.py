"""Offline batch throughput of pdserve vs. transformers vs. vLLM (CPU), plus engine overhead and
a roofline estimate.

    .venv/bin/python benchmarks/offline_throughput.py                # the full default run
    .venv/bin/python benchmarks/offline_throughput.py --model models/tiny --num-requests 6 \
        --input-len 16 32 --output-len 4 8 --hf-batch-sizes 2 4 --systems pdserve transformers

What it measures, for each dtype:
  * throughput: the same seeded random token-id prompts and per-request output lengths
    (greedy, ignore_eos) through every system; output tokens/s = requested output tokens / wall
    time of the generate call (start-up and a small warm-up are timed and reported separately).
    pdserve and vLLM run --rounds times each, alternating (both resident, vLLM's processes
    stopped with SIGSTOP while pdserve runs, the prefix cache reset before every run), because
    this shared machine's speed drifts by tens of percent from one minute to the next: each
    reports its median run, and the pdserve / vLLM ratio is the median of the per-round ratios; transformers runs once, with a
    pdserve run right before and right after it, and its ratio is to their mean;
  * "same outputs": the fraction of requests whose greedy token ids equal pdserve's (reported,
    not asserted; expect exact agreement in float32 only);
  * engine per-step overhead with exactly B running decode requests: whole engine.step() vs. the
    model forward alone (timed from outside by wrapping the runner's model / sampler);
  * roofline: torch matmul GFLOP/s of the dtype vs. the engine's achieved FLOP/s in decode.

transformers runs in this process with static batches (left padding + attention mask); vLLM runs
in its own venv as a resident subprocess (benchmarks/_vllm_offline.py: commands on stdin, results
as JSON files).
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import logging
import os
import platform
import random
import select
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

logger = logging.getLogger("offline_throughput")

WORKER = Path(__file__).resolve().parent / "_vllm_offline.py"
SYSTEMS = ("pdserve", "transformers", "vllm")
DTYPES = ("float32", "bfloat16")


# -- arguments ------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--model",
        default="models/bench",
        help="HF-format model directory; if missing it is built with "
        "`pdserve make-model --arch llama --preset PRESET` (default: %(default)s)",
    )
    p.add_argument(
        "--make-preset",
        default="bench",
        choices=["tiny", "small", "bench"],
        help="preset used to build --model when it does not exist (default: %(default)s)",
    )
    p.add_argument(
        "--num-requests",
        type=int,
        default=256,
        help="number of requests in the workload (default: %(default)s)",
    )
    p.add_argument(
        "--input-len",
        type=int,
        nargs=2,
        default=[64, 512],
        metavar=("MIN", "MAX"),
        help="prompt lengths, uniform integers in [MIN, MAX] (default: 64 512)",
    )
    p.add_argument(
        "--output-len",
        type=int,
        nargs=2,
        default=[16, 256],
        metavar=("MIN", "MAX"),
        help="output lengths (max_tokens, ignore_eos), uniform in [MIN, MAX] (default: 16 256)",
    )
    p.add_argument(
        "--dtypes",
        nargs="+",
        default=list(DTYPES),
        choices=DTYPES,
        help="dtypes to benchmark, each system runs once per dtype (default: both)",
    )
    p.add_argument(
        "--systems",
        nargs="+",
        default=list(SYSTEMS),
        choices=SYSTEMS,
        help="systems to run (default: all); ratios need pdserve",
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="timed runs of the workload by pdserve and vLLM, alternating (the machine's speed "
        "drifts between minutes); each reports its median run and vLLM the median of the "
        "per-round ratios; transformers runs once (default: %(default)s)",
    )
    p.add_argument(
        "--hf-batch-sizes",
        type=int,
        nargs="+",
        default=[8, 16, 32],
        help="transformers static batch sizes to probe; the full workload runs at "
        "the one with the best probe tokens/s (default: 8 16 32)",
    )
    p.add_argument(
        "--hf-probe-requests",
        type=int,
        default=None,
        help="requests in the transformers probe subset (the first N of the "
        "workload; default: the largest --hf-batch-sizes)",
    )
    p.add_argument(
        "--vllm-dir",
        default="/work/peers/vllm",
        help="vLLM CPU install holding env.sh; vLLM is skipped (logged) if missing "
        "(default: %(default)s)",
    )
    p.add_argument(
        "--vllm-enforce-eager",
        action="store_true",
        help="pass enforce_eager=True to vLLM (default: vLLM's torch.compile mode)",
    )
    p.add_argument(
        "--vllm-timeout",
        type=float,
        default=3600,
        help="seconds before the vLLM subprocess is killed (default: %(default)s)",
    )
    p.add_argument(
        "--max-num-seqs",
        type=int,
        default=128,
        help="max running requests, for pdserve and vLLM (default: %(default)s)",
    )
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=2048,
        help="token budget per step, for pdserve and vLLM (default: %(default)s)",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=2,
        help="torch.set_num_threads for pdserve and transformers; vLLM uses its "
        "env.sh binding (default: %(default)s)",
    )
    p.add_argument(
        "--overhead-batches",
        type=int,
        nargs="+",
        default=[1, 16, 64],
        help="decode batch sizes for the per-step overhead measurement (default: 1 16 64)",
    )
    p.add_argument(
        "--roofline-batches",
        type=int,
        nargs="+",
        default=[32, 64],
        help="decode batch sizes whose achieved FLOP/s is compared to the matmul "
        "rate (default: 32 64)",
    )
    p.add_argument(
        "--overhead-steps",
        type=int,
        default=32,
        help="decode steps measured per batch size (default: %(default)s)",
    )
    p.add_argument(
        "--overhead-warmup",
        type=int,
        default=4,
        help="decode steps run before measuring (default: %(default)s)",
    )
    p.add_argument(
        "--overhead-prompt-len",
        type=int,
        default=16,
        help="prompt length of the overhead requests (default: %(default)s)",
    )
    p.add_argument(
        "--matmul-shape",
        type=int,
        nargs=3,
        default=[1024, 4096, 4096],
        metavar=("M", "K", "N"),
        help="roofline matmul [M,K]x[K,N] (default: 1024 4096 4096)",
    )
    p.add_argument(
        "--matmul-reps",
        type=int,
        default=5,
        help="timed matmul repetitions, best one counts (default: %(default)s)",
    )
    p.add_argument(
        "--skip-overhead",
        action="store_true",
        help="skip the per-step overhead / roofline decode measurement",
    )
    p.add_argument(
        "--save-outputs",
        action="store_true",
        help="keep every system's output token ids in the JSON (large)",
    )
    p.add_argument(
        "--result-file",
        default="benchmarks/results/offline_throughput.json",
        help="where the JSON with everything is written (default: %(default)s)",
    )
    p.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seed of prompts, lengths and torch (default: %(default)s)",
    )
    args = p.parse_args(argv)
    for name in ("input_len", "output_len"):
        lo, hi = getattr(args, name)
        if not 1 <= lo <= hi:
            p.error(f"--{name.replace('_', '-')} needs 1 <= MIN <= MAX")
    if args.hf_probe_requests is None:
        args.hf_probe_requests = max(args.hf_batch_sizes)
    return args


# -- setup ----------------------------------------------------------------------------------------


def ensure_model(path: Path, preset: str) -> None:
    if (path / "config.json").exists():
        return
    from pdserve.make_model import make_model

    logger.info("model %s missing: building llama/%s", path, preset)
    make_model("llama", preset, str(path))


def machine_info(threads: int) -> dict[str, Any]:
    cpu_model, flags = "", []
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and not cpu_model:
                cpu_model = line.split(":", 1)[1].strip()
            if line.startswith("flags") and not flags:
                flags = line.split(":", 1)[1].split()
    except OSError:
        pass
    mem_gib = None
    try:
        mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError):
        pass
    import transformers

    return {
        "hostname": platform.node(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu_model": cpu_model,
        "cpu_count": os.cpu_count(),
        "cpu_affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "simd_flags": sorted(f for f in flags if f.startswith(("avx", "amx", "fma"))),
        "memory_gib": mem_gib,
        "torch_version": torch.__version__,
        "transformers_version": transformers.__version__,
        "torch_threads": threads,
        "torch_interop_threads": torch.get_num_interop_threads(),
        "mkldnn": torch.backends.mkldnn.is_available(),
    }


def model_facts(model_dir: Path) -> dict[str, Any]:
    """Shapes from config.json, matmul params per token and the prompt token-id range."""
    cfg = json.loads((model_dir / "config.json").read_text())
    hidden, inter, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    heads, kv_heads = cfg["num_attention_heads"], cfg.get("num_key_value_heads")
    kv_heads = kv_heads or heads
    head_dim = cfg.get("head_dim") or hidden // heads
    vocab = cfg["vocab_size"]
    per_layer = hidden * (heads + 2 * kv_heads) * head_dim + heads * head_dim * hidden
    per_layer += 3 * hidden * inter
    matmul_params = layers * per_layer + vocab * hidden  # + lm_head (tied or not)
    from pdserve.engine.tokenizer import Tokenizer

    tok_vocab = Tokenizer.from_pretrained(str(model_dir)).vocab_size
    special = json.loads((model_dir / "tokenizer.json").read_text()).get("added_tokens", [])
    # Prompts draw ids between the special tokens at the low end of the vocabulary and those
    # at its high end (Gemma 3's image tokens sit above 255999 of 262144).
    top = min(vocab, tok_vocab)
    low = max((t["id"] for t in special if t["id"] < top // 2), default=-1) + 1
    high = min((t["id"] for t in special if t["id"] >= top // 2), default=top)
    return {
        "architecture": cfg["architectures"][0],
        "hidden_size": hidden,
        "num_layers": layers,
        "num_heads": heads,
        "num_kv_heads": kv_heads,
        "head_dim": head_dim,
        "vocab_size": vocab,
        "tokenizer_vocab_size": tok_vocab,
        "max_position_embeddings": cfg["max_position_embeddings"],
        "matmul_params_per_token": matmul_params,
        "total_params": matmul_params
        + vocab * hidden * (0 if cfg.get("tie_word_embeddings") else 1)
        + layers * 2 * hidden
        + hidden,
        "prompt_token_range": [low, high],
        "pad_token_id": cfg.get("pad_token_id"),
    }


def make_workload(args: argparse.Namespace, token_range: list[int]) -> dict[str, Any]:
    rng = random.Random(args.seed)
    lo, hi = token_range
    prompts, max_tokens = [], []
    for _ in range(args.num_requests):
        n = rng.randint(*args.input_len)
        prompts.append([rng.randrange(lo, hi) for _ in range(n)])
        max_tokens.append(rng.randint(*args.output_len))
    return {"prompts": prompts, "max_tokens": max_tokens}


# -- roofline -------------------------------------------------------------------------------------


def matmul_gflops(dtype: torch.dtype, shape: list[int], reps: int) -> dict[str, Any]:
    """The machine's matmul rate for the dtype: the better of torch.mm and oneDNN's packed
    GEMM (what pdserve's projections use), best of reps. Both are reported."""
    m, k, n = shape
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(m, k, generator=gen).to(dtype)
    b = torch.randn(k, n, generator=gen).to(dtype)
    rates = {"torch_mm": _best_rate(lambda: torch.mm(a, b), m * k * n, reps)}
    try:
        from pdserve.engine.models.llama import pack_weight, packed_linear

        w = b.t().contiguous()  # [n, k], a linear layer's weight
        packed = pack_weight(w, m)
        if packed is not None:
            rates["onednn_packed"] = _best_rate(
                lambda: packed_linear(a, w, packed, None), m * k * n, reps
            )
    except (ImportError, RuntimeError) as exc:
        logger.warning("oneDNN packed GEMM not measured: %s", exc)
    best = max(rates, key=lambda key: rates[key]["gflops"])
    return {"shape": shape, "reps": reps, "source": best, **rates[best], "all": rates}


def _best_rate(fn, mkn: int, reps: int) -> dict[str, Any]:
    fn()  # warm-up (oneDNN primitive creation)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    best = min(times)
    return {
        "best_s": best,
        "gflops": 2 * mkn / best / 1e9,
        "median_gflops": 2 * mkn / sorted(times)[len(times) // 2] / 1e9,
    }


# -- pdserve --------------------------------------------------------------------------------------


def start_pdserve(args, model_dir, dtype) -> tuple[Any, dict[str, float]]:
    """The engine, built and warmed up once for all rounds."""
    from pdserve.engine import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(
        model=str(model_dir),
        dtype=dtype,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        seed=args.seed,
    )
    startup_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    warm = [[5 + i] * 8 for i in range(2)]
    llm.generate(
        warm, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False
    )
    return llm, {"startup_s": startup_s, "warmup_s": time.perf_counter() - t0}


def pdserve_round(llm, workload) -> dict[str, Any]:
    """One timed run of the workload, every prompt computed (the prefix cache reset first)."""
    from pdserve.engine import SamplingParams

    params = [
        SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        for n in workload["max_tokens"]
    ]
    if not llm.reset_prefix_cache():
        raise RuntimeError("pdserve: requests still hold KV blocks between rounds")
    stats0 = dict(vars(llm.engine.stats))
    t0 = time.perf_counter()
    outs = llm.generate(workload["prompts"], params, use_tqdm=True)
    generate_s = time.perf_counter() - t0
    stats = {k: v - stats0[k] for k, v in vars(llm.engine.stats).items()}
    return {
        "generate_s": generate_s,
        "engine_stats": stats,
        "num_cached_tokens": sum(o.num_cached_tokens or 0 for o in outs),
        "output_token_ids": [list(o.outputs[0].token_ids) for o in outs],
    }


class _Timer:
    """Accumulates the wall time of calls to a wrapped callable."""

    def __init__(self, fn):
        self.fn, self.total, self.calls = fn, 0.0, 0

    def __call__(self, *a, **kw):
        t0 = time.perf_counter()
        try:
            return self.fn(*a, **kw)
        finally:
            self.total += time.perf_counter() - t0
            self.calls += 1


def measure_decode(llm, batch: int, args, token_range, facts) -> dict[str, Any]:
    """Exactly `batch` running decode requests; times `steps` engine steps from outside."""
    from pdserve.engine import SamplingParams

    eng = llm.engine
    runner = eng.runner
    model = runner.model
    rng = random.Random(args.seed + batch)
    lo, hi = token_range
    steps, warmup = args.overhead_steps, args.overhead_warmup
    params = SamplingParams(temperature=0.0, max_tokens=warmup + steps + 8, ignore_eos=True)
    ids = [f"overhead-{batch}-{i}" for i in range(batch)]
    for rid in ids:
        prompt = [rng.randrange(lo, hi) for _ in range(args.overhead_prompt_len)]
        eng.add_request(rid, prompt, params)

    shapes: list[tuple[int, int]] = []  # (num chunks, num tokens) of every execute
    orig_execute = runner.execute

    def execute(output, rows, *args):
        shapes.append((len(output.chunks), sum(len(c.token_ids) for c in output.chunks)))
        return orig_execute(output, rows, *args)

    fwd = _Timer(model.forward)
    logits = _Timer(model.compute_logits)
    prep = _Timer(runner._prepare_inputs)
    sampler = _Timer(runner.sampler)
    orig_sampler = runner.sampler
    runner.execute = execute
    model.forward, model.compute_logits, runner._prepare_inputs = fwd, logits, prep
    runner.sampler = sampler
    try:
        # prefill (until every request has its first token), then warm-up decode steps
        guard = 0
        while any(len(eng.scheduler.requests[r].output_token_ids) == 0 for r in ids):
            eng.step()
            guard += 1
            if guard > 10 * batch + 10:
                raise RuntimeError("overhead requests never finished prefill")
        for _ in range(warmup):
            eng.step()
        ctx0 = eng.scheduler.requests[ids[0]].num_tokens
        shapes.clear()
        for t in (fwd, logits, prep, sampler):
            t.total, t.calls = 0.0, 0
        step_times = []
        for _ in tqdm(range(steps), desc=f"decode B={batch}", leave=False):
            t0 = time.perf_counter()
            eng.step()
            step_times.append(time.perf_counter() - t0)
        pure = all(s == (batch, batch) for s in shapes) and len(shapes) == steps
    finally:
        for name in ("forward", "compute_logits"):
            model.__dict__.pop(name, None)
        runner.__dict__.pop("_prepare_inputs", None)
        runner.__dict__.pop("execute", None)
        runner.sampler = orig_sampler
        for rid in ids:
            eng.abort_request(rid)
    if eng.has_unfinished_requests():
        logger.warning("engine still has unfinished requests after the overhead run")

    step_s = sum(step_times)
    mean_ctx = ctx0 + (steps - 1) / 2  # tokens attended per decode token, on average
    attn_flops_per_token = (
        4 * facts["num_layers"] * facts["num_heads"] * facts["head_dim"] * mean_ctx
    )
    flops_per_token = 2 * facts["matmul_params_per_token"] + attn_flops_per_token
    tok_s = batch * steps / step_s
    return {
        "batch": batch,
        "steps": steps,
        "pure_decode_steps": pure,
        "mean_context_len": mean_ctx,
        "step_ms": 1e3 * step_s / steps,
        "step_ms_median": 1e3 * sorted(step_times)[steps // 2],
        "forward_ms": 1e3 * fwd.total / steps,
        "compute_logits_ms": 1e3 * logits.total / steps,
        "sampler_ms": 1e3 * sampler.total / steps,
        "prepare_inputs_ms": 1e3 * prep.total / steps,
        "overhead_ms": 1e3 * (step_s - fwd.total) / steps,
        "overhead_frac": (step_s - fwd.total) / step_s,
        "overhead_excl_logits_sampler_ms": 1e3
        * (step_s - fwd.total - logits.total - sampler.total)
        / steps,
        "overhead_excl_logits_sampler_frac": (step_s - fwd.total - logits.total - sampler.total)
        / step_s,
        "decode_tokens_per_s": tok_s,
        "flops_per_token": flops_per_token,
        "achieved_gflops": flops_per_token * tok_s / 1e9,
        "forward_only_gflops": (flops_per_token - 2 * facts["vocab_size"] * facts["hidden_size"])
        * batch
        * steps
        / fwd.total
        / 1e9,
    }


# -- transformers ---------------------------------------------------------------------------------


def _hf_batches(n: int, bs: int) -> list[range]:
    return [range(i, min(i + bs, n)) for i in range(0, n, bs)]


def _hf_generate(model, prompts, max_tokens, bs, pad_id, desc) -> tuple[list[list[int]], float]:
    from transformers import GenerationConfig

    outputs: list[list[int]] = [[] for _ in prompts]
    batches = _hf_batches(len(prompts), bs)
    t0 = time.perf_counter()
    for idx in tqdm(batches, desc=desc, leave=False):
        rows = [prompts[i] for i in idx]
        width = max(map(len, rows))
        ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for r, p in enumerate(rows):  # left padding
            ids[r, width - len(p) :] = torch.tensor(p)
            mask[r, width - len(p) :] = 1
        new = max(max_tokens[i] for i in idx)
        cfg = GenerationConfig(
            max_new_tokens=new,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=pad_id,
            use_cache=True,
        )
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, generation_config=cfg)
        for r, i in enumerate(idx):
            outputs[i] = out[r, width : width + max_tokens[i]].tolist()
    return outputs, time.perf_counter() - t0


def run_transformers(args, model_dir, dtype, workload, pad_id, bracket=None) -> dict[str, Any]:
    """transformers generate() at the best probed static batch size. bracket(), when given, is a
    pdserve run (pdserve_round's result) right before and right after the full run: its mean, from the same
    minutes, is what the transformers ratio compares against."""
    from transformers import AutoModelForCausalLM

    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=getattr(torch, dtype)).eval()
    model.generation_config.eos_token_id = None  # ignore_eos: never stop early
    startup_s = time.perf_counter() - t0
    prompts, max_tokens = workload["prompts"], workload["max_tokens"]

    t0 = time.perf_counter()
    _hf_generate(model, [[5] * 8, [6] * 8], [4, 4], 2, pad_id, "hf warm-up")
    warmup_s = time.perf_counter() - t0

    n_probe = min(args.hf_probe_requests, len(prompts))
    probe = {}
    for bs in args.hf_batch_sizes:
        _, s = _hf_generate(
            model, prompts[:n_probe], max_tokens[:n_probe], bs, pad_id, f"hf probe bs={bs}"
        )
        probe[bs] = {"generate_s": s, "tokens_per_s": sum(max_tokens[:n_probe]) / s}
        logger.info("transformers %s probe bs=%d: %.1f tok/s", dtype, bs, probe[bs]["tokens_per_s"])
    best = max(probe, key=lambda b: probe[b]["tokens_per_s"])
    logger.info("transformers %s: full run at batch size %d", dtype, best)
    around = [bracket()["generate_s"]] if bracket is not None else []
    outputs, generate_s = _hf_generate(model, prompts, max_tokens, best, pad_id, f"hf bs={best}")
    if bracket is not None:
        around.append(bracket()["generate_s"])
    del model
    gc.collect()
    return {
        "startup_s": startup_s,
        "warmup_s": warmup_s,
        "probe_requests": n_probe,
        "probe": {str(b): v for b, v in probe.items()},
        "batch_size": best,
        "generate_s": generate_s,
        "output_token_ids": outputs,
        **({"pdserve_bracket_s": around} if around else {}),
    }


# -- vLLM -----------------------------------------------------------------------------------------


class VllmSession:
    """vLLM's CPU build resident in its own venv (benchmarks/_vllm_offline.py): started once per
    dtype, then run() times the workload whenever asked, so its rounds alternate with
    pdserve's. Every wait has a deadline (--vllm-timeout); close() always ends the process."""

    def __init__(self, args, model_dir, dtype, workload, facts) -> None:
        self.timeout = args.vllm_timeout
        self.proc: subprocess.Popen | None = None
        self.tmp = Path(tempfile.mkdtemp(prefix="vllm_offline_"))
        self.log_path = self.tmp / "vllm.log"
        max_len = max(map(len, workload["prompts"])) + max(workload["max_tokens"])
        max_len = min(facts["max_position_embeddings"], -(-max_len // 16) * 16)
        self.settings = {
            "model": str(model_dir),
            "dtype": dtype,
            "max_model_len": max_len,
            "max_num_seqs": args.max_num_seqs,
            "max_num_batched_tokens": args.max_num_batched_tokens,
            "seed": args.seed,
            "enforce_eager": args.vllm_enforce_eager,
            "warmup_requests": 2,
        }
        req = {
            **self.settings,
            "prompts": workload["prompts"],
            "max_tokens": workload["max_tokens"],
        }
        (self.tmp / "request.json").write_text(json.dumps(req))
        env_sh = Path(args.vllm_dir) / "env.sh"
        cmd = f'source "{env_sh}" && exec python "{WORKER}" "{self.tmp / "request.json"}"'
        env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "PYTHONPATH")}
        logger.info(
            "vLLM %s: starting (log: %s); start-up takes a minute or two", dtype, self.log_path
        )
        t0 = time.perf_counter()
        self.log = open(self.log_path, "w")  # noqa: SIM115 - closed in close()
        self.proc = subprocess.Popen(
            ["bash", "-c", cmd],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            env=env,
            cwd=self.tmp,
            text=True,
            process_group=0,  # vLLM's engine and worker processes join it: one signal reaches all
        )
        try:
            self._expect("READY")
        except RuntimeError:
            self.close()
            raise
        self.ready_s = time.perf_counter() - t0
        self._signal(signal.SIGSTOP)

    def _signal(self, sig: int) -> None:
        """sig to every process of the session (its process group)."""
        if self.proc is not None:
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                pass

    def _expect(self, word: str) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], self.timeout)
        line = self.proc.stdout.readline().strip() if ready else "(timed out)"
        if line != word:
            tail = self.log_path.read_text(errors="replace")[-3000:]
            raise RuntimeError(f"vLLM: expected {word}, got {line!r}; log tail:\n{tail}")

    def run(self, index: int, cached: bool = False) -> dict[str, Any]:
        """One run of the workload; cached: over the prefix cache as the runs before left it
        (else it is reset first)."""
        assert self.proc is not None and self.proc.stdin is not None
        path = self.tmp / f"result_{index}.json"
        # stopped between runs: idle, vLLM still polls (~10% of a core), and on 2 cores a
        # stolen slice stalls every parallel region of the run it would share the cores with
        self._signal(signal.SIGCONT)
        self.proc.stdin.write(f"{'CACHED' if cached else 'RUN'} {path}\n")
        self.proc.stdin.flush()
        self._expect("DONE")
        self._signal(signal.SIGSTOP)
        res = json.loads(path.read_text())
        res["num_cached_tokens"] = sum(res["num_cached_tokens"])
        return res

    def close(self) -> None:
        """EXIT, then SIGKILL to the whole process group (vLLM's engine and worker processes
        outlive their parent otherwise)."""
        if self.proc is not None:
            self._signal(signal.SIGCONT)
            try:
                if self.proc.poll() is None and self.proc.stdin is not None:
                    self.proc.stdin.write("EXIT\n")
                    self.proc.stdin.close()
                self.proc.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                pass
            self._signal(signal.SIGKILL)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                logger.error("vLLM process %d did not exit", self.proc.pid)
            self.proc = None
        self.log.close()


def median(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def run_rounds(args, model_dir, dtype, workload, facts) -> tuple[dict[str, Any], Any]:
    """pdserve and vLLM alternately, --rounds times each, in the same minutes; each system's
    generate_s is its median round, and vllm's pdserve_ratio_paired the median of the
    per-round ratios. Returns (results per system, the pdserve LLM for the decode
    measurement, or None)."""
    per: dict[str, Any] = {}
    vllm = None
    if "vllm" in args.systems:
        env_sh = Path(args.vllm_dir) / "env.sh"
        if env_sh.exists():
            try:
                vllm = VllmSession(args, model_dir, dtype, workload, facts)
                per["vllm"] = {
                    "process_ready_s": vllm.ready_s,
                    "log": str(vllm.log_path),
                    "settings": vllm.settings,
                }
            except (OSError, RuntimeError) as exc:
                logger.error("vLLM %s failed to start: %s", dtype, exc)
                per["vllm"] = {"error": str(exc)[:3000]}
        else:
            msg = f"vLLM not installed ({env_sh} missing): skipping vLLM"
            logger.warning(msg)
            per["vllm"] = {"skipped": msg}
    llm = None
    runs: dict[str, list[dict[str, Any]]] = {}
    try:
        if "pdserve" in args.systems:
            llm, info = start_pdserve(args, model_dir, dtype)
            per["pdserve"] = info
        for i in range(args.rounds):
            if llm is not None:
                runs.setdefault("pdserve", []).append(pdserve_round(llm, workload))
                logger.info(
                    "pdserve %s round %d: %.1f s", dtype, i, runs["pdserve"][-1]["generate_s"]
                )
            if vllm is not None:
                try:
                    runs.setdefault("vllm", []).append(vllm.run(i))
                except (OSError, RuntimeError) as exc:
                    logger.error("vLLM %s round %d failed: %s", dtype, i, exc)
                    per["vllm"] = {"error": str(exc)[:3000]}
                    vllm.close()
                    vllm = None
                    runs.pop("vllm", None)
                    continue
                logger.info("vllm %s round %d: %.1f s", dtype, i, runs["vllm"][-1]["generate_s"])
    finally:
        if vllm is not None:
            vllm.close()
    for name, rounds in runs.items():
        first = rounds[0]
        per[name] = {
            **per.get(name, {}),
            **{k: v for k, v in first.items() if k != "generate_s"},
            "generate_s": median([r["generate_s"] for r in rounds]),
            "generate_s_rounds": [r["generate_s"] for r in rounds],
        }
    if "pdserve" in runs and "vllm" in runs:
        per["vllm"]["pdserve_ratio_paired"] = median(
            [
                v["generate_s"] / p["generate_s"]
                for p, v in zip(runs["pdserve"], runs["vllm"], strict=True)
            ]
        )
        per["vllm"]["same_rounds_outputs"] = all(
            r["output_token_ids"] == runs["vllm"][0]["output_token_ids"] for r in runs["vllm"]
        )
    if "pdserve" in runs:
        per["pdserve"]["same_rounds_outputs"] = all(
            r["output_token_ids"] == runs["pdserve"][0]["output_token_ids"] for r in runs["pdserve"]
        )
    order = ("pdserve", "vllm")
    return {k: per[k] for k in sorted(per, key=lambda k: order.index(k))}, llm


# -- comparison and report ------------------------------------------------------------------------


def compare(a: list[list[int]], b: list[list[int]]) -> dict[str, Any]:
    exact, prefix = 0, []
    first_diff = None
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        n = 0
        while n < min(len(x), len(y)) and x[n] == y[n]:
            n += 1
        exact += x == y
        prefix.append(n / max(len(x), 1))
        if x != y and first_diff is None:
            first_diff = {"request": i, "position": n}
    return {
        "exact_match_frac": exact / len(a),
        "mean_matching_prefix_frac": sum(prefix) / len(a),
        "first_mismatch": first_diff,
    }


def summarize(results: dict, workload: dict, args) -> None:
    total_out = sum(workload["max_tokens"])
    for dtype, per in results["throughput"].items():
        for name, r in per.items():
            if "generate_s" not in r:
                continue
            r["output_tokens"] = total_out
            r["output_tokens_per_s"] = total_out / r["generate_s"]
            got = sum(len(t) for t in r["output_token_ids"])
            if got != total_out:
                logger.warning(
                    "%s %s produced %d output tokens, %d requested", name, dtype, got, total_out
                )
            r["produced_output_tokens"] = got
        pd = per.get("pdserve", {})
        for name, r in per.items():
            if (
                name == "pdserve"
                or "output_tokens_per_s" not in r
                or "output_tokens_per_s" not in pd
            ):
                continue
            r["pdserve_ratio_of_medians"] = pd["output_tokens_per_s"] / r["output_tokens_per_s"]
            if "pdserve_bracket_s" in r:  # pdserve's runs right before and after this one
                r["pdserve_ratio_bracketed"] = r["generate_s"] / (
                    sum(r["pdserve_bracket_s"]) / len(r["pdserve_bracket_s"])
                )
            # runs from the same minutes pair up: their ratio is the less noisy one
            r["pdserve_ratio"] = r.get(
                "pdserve_ratio_paired",
                r.get("pdserve_ratio_bracketed", r["pdserve_ratio_of_medians"]),
            )
            r["same_outputs_as_pdserve"] = compare(pd["output_token_ids"], r["output_token_ids"])


def print_tables(results: dict) -> None:
    lines = [
        "",
        "## Offline throughput",
        "",
        "| dtype | system | startup s | generate s, median (rounds) | output tok/s "
        "| pdserve / system "
        "| same outputs as pdserve |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for dtype, per in results["throughput"].items():
        for name, r in per.items():
            if "output_tokens_per_s" not in r:
                why = r.get("skipped") or r.get("error") or "n/a"
                lines.append(f"| {dtype} | {name} | | | {why} | | |")
                continue
            extra = f" (bs {r['batch_size']})" if "batch_size" in r else ""
            ratio = f"{r['pdserve_ratio']:.2f}x" if "pdserve_ratio" in r else ""
            same = r.get("same_outputs_as_pdserve")
            same_s = (
                f"{same['exact_match_frac']:.0%} (prefix {same['mean_matching_prefix_frac']:.0%})"
                if same
                else ""
            )
            rounds = r.get("generate_s_rounds", [])
            gen = f"{r['generate_s']:.1f}" + (
                f" ({' / '.join(f'{t:.1f}' for t in rounds)})" if len(rounds) > 1 else ""
            )
            lines.append(
                f"| {dtype} | {name}{extra} | {r['startup_s']:.1f} | "
                f"{gen} | {r['output_tokens_per_s']:.1f} | {ratio} | "
                f"{same_s} |"
            )
    if results.get("decode"):
        mm = results["matmul"]
        lines += [
            "",
            "## pdserve decode step: overhead and roofline",
            "",
            "| dtype | B | step ms | forward ms | overhead ms | overhead | excl. logits+sampler "
            "| tok/s | GFLOP/s | of matmul |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for dtype, rows in results["decode"].items():
            peak = mm[dtype]["gflops"]
            for r in rows:
                lines.append(
                    f"| {dtype} | {r['batch']} | {r['step_ms']:.2f} | {r['forward_ms']:.2f} | "
                    f"{r['overhead_ms']:.2f} | {r['overhead_frac']:.0%} | "
                    f"{r['overhead_excl_logits_sampler_frac']:.0%} | "
                    f"{r['decode_tokens_per_s']:.0f} | {r['achieved_gflops']:.1f} | "
                    f"{r['achieved_gflops'] / peak:.1%} |"
                )
        lines.append("")
        lines.append(
            "matmul "
            + ", ".join(f"{d}: {v['gflops']:.0f} GFLOP/s" for d, v in mm.items())
            + f" ({mm[next(iter(mm))]['shape']})"
        )
    print("\n".join(lines))


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    model_dir = Path(args.model).resolve()
    ensure_model(model_dir, args.make_preset)
    facts = model_facts(model_dir)
    workload = make_workload(args, facts["prompt_token_range"])
    results: dict[str, Any] = {
        "machine": machine_info(args.threads),
        "config": {k: v for k, v in vars(args).items()},
        "model": facts,
        "workload": {
            "num_requests": args.num_requests,
            "prompt_tokens": sum(map(len, workload["prompts"])),
            "output_tokens": sum(workload["max_tokens"]),
            "prompt_lens": [len(p) for p in workload["prompts"]],
            "max_tokens": workload["max_tokens"],
        },
        "matmul": {},
        "throughput": {},
        "decode": {},
    }
    logger.info(
        "workload: %d requests, %d prompt tokens, %d output tokens; model %s (%.1fM matmul params)",
        args.num_requests,
        results["workload"]["prompt_tokens"],
        results["workload"]["output_tokens"],
        model_dir,
        facts["matmul_params_per_token"] / 1e6,
    )

    for dtype in args.dtypes:
        per, llm = run_rounds(args, model_dir, dtype, workload, facts)
        results["throughput"][dtype] = per
        if "transformers" in args.systems:
            logger.info("transformers %s", dtype)

            bracket = functools.partial(pdserve_round, llm, workload) if llm is not None else None
            per["transformers"] = run_transformers(
                args, model_dir, dtype, workload, facts["pad_token_id"] or 0, bracket
            )
            logger.info("transformers %s: %.1f s", dtype, per["transformers"]["generate_s"])
        # the matmul rate in the same minutes as the decode steps it is compared with
        results["matmul"][dtype] = matmul_gflops(
            getattr(torch, dtype), args.matmul_shape, args.matmul_reps
        )
        logger.info(
            "matmul %s: %.1f GFLOP/s (%s)",
            dtype,
            results["matmul"][dtype]["gflops"],
            results["matmul"][dtype]["source"],
        )
        if llm is not None:
            if not args.skip_overhead:
                batches = sorted(set(args.overhead_batches) | set(args.roofline_batches))
                rows = []
                for b in batches:
                    rows.append(measure_decode(llm, b, args, facts["prompt_token_range"], facts))
                    r = rows[-1]
                    logger.info(
                        "decode %s B=%d: step %.2f ms, forward %.2f ms, overhead %.0f%%",
                        dtype,
                        b,
                        r["step_ms"],
                        r["forward_ms"],
                        100 * r["overhead_frac"],
                    )
                    if not r["pure_decode_steps"]:
                        logger.warning("decode B=%d: measured steps were not all pure decode", b)
                for r in rows:
                    r["matmul_frac"] = r["achieved_gflops"] / results["matmul"][dtype]["gflops"]
                results["decode"][dtype] = rows
            del llm
            gc.collect()

    summarize(results, workload, args)
    if not args.save_outputs:
        for per in results["throughput"].values():
            for r in per.values():
                r.pop("output_token_ids", None)
    out = Path(args.result_file)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(out.suffix + ".tmp")
    tmp.write_text(json.dumps(results, indent=1))
    tmp.replace(out)
    logger.info("wrote %s", out)
    print_tables(results)


if __name__ == "__main__":
    main()
