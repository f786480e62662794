"""Would an early-exit self-draft pay on SmolLM2? (issue 17: "a self-draft if you find one that
pays, e.g. the first layers of the same model").

The draft is the target's own first L layers, its final norm and its lm_head (no training, no
second checkpoint). For greedy decoding a drafted token is accepted exactly when the draft's
argmax equals the target's next token given the same (correct) prefix, so one forward of the
target over prompt + its own greedy output, with every layer's hidden state, gives the whole
acceptance record: position t matches at exit L iff argmax(lm_head(norm(h_L[t]))) == y[t+1].
A draft run started at t is accepted up to the first mismatch (capped at k), and the step
adds one token of its own. The cost model is batch 1's: a step reads every weight once, so a
draft token costs (L layers + lm_head) / (all layers + lm_head) of a target step, and a
verification of 1 + k rows about one step (this CPU, bf16: 14-16 ms plain, +2-4 ms to verify
3 drafts: README). Prints, per exit layer, the acceptance rate and the modelled speed-up at
k = 1..4; writes --out.

    .venv/bin/python benchmarks/self_draft_acceptance.py --out benchmarks/results/self_draft_acceptance.json
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from spec_decode_real import EXTRACTIVE, FREE, smollm2  # noqa: E402

logger = logging.getLogger("self_draft_acceptance")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--max-tokens", type=int, default=128, help="greedy tokens per prompt")
    p.add_argument("--prompts", type=int, default=4, help="distinct prompts per workload")
    p.add_argument("--exits", type=int, nargs="+", default=[4, 8, 12, 16, 20, 24, 27],
                   help="exit layers L (the draft runs layers 0..L-1)")  # fmt: skip
    p.add_argument("--out", default="benchmarks/results/self_draft_acceptance.json")
    return p.parse_args()


def simulate(matches: list[bool], k: int, draft_cost: float) -> tuple[float, float]:
    """(tokens per step, modelled speed-up) of drafting k tokens at every step over one
    output whose per-position draft matches are given."""
    t, steps, tokens = 0, 0, 0
    while t < len(matches):
        run = 0
        while run < k and t + run < len(matches) and matches[t + run]:
            run += 1
        steps += 1
        tokens += run + 1
        t += run + 1
    per_step = tokens / steps
    return per_step, per_step / (1.0 + k * draft_cost)


def main() -> None:
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    args = parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pdserve.engine.models.gguf import converted_dir

    model_dir = converted_dir(Path(smollm2()))
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    torch.set_grad_enabled(False)
    cfg = model.config
    layer_params = sum(p.numel() for p in model.model.layers[0].parameters())
    head_params = model.lm_head.weight.numel()
    full = cfg.num_hidden_layers * layer_params + head_params
    results: dict = {"model": str(model_dir), "layer_params": layer_params,
                     "lm_head_params": head_params, "workloads": {}}  # fmt: skip
    for name, texts in (("extractive", EXTRACTIVE), ("free", FREE)):
        matches: dict[int, list[list[bool]]] = {L: [] for L in args.exits}
        for text in list(dict.fromkeys(texts))[: args.prompts]:
            rendered = tok.apply_chat_template(
                [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
            )
            ids = tok(rendered, add_special_tokens=False, return_tensors="pt").input_ids
            t0 = time.perf_counter()
            with torch.inference_mode():
                out = model.generate(ids, max_new_tokens=args.max_tokens, do_sample=False)
                n = ids.shape[1]
                hidden = model(out, output_hidden_states=True).hidden_states
            target = out[0, n:]  # y[t+1] for positions t = n-1 .. end-1
            # self-check: the last hidden state (normed) gives the greedy tokens back
            check = model.lm_head(hidden[-1][0, n - 1 : out.shape[1] - 1]).argmax(-1)
            results.setdefault("self_check", []).append((check == target).float().mean().item())
            for L in args.exits:
                h = model.model.norm(hidden[L][0, n - 1 : out.shape[1] - 1])
                guess = model.lm_head(h).argmax(-1)
                matches[L].append((guess == target).tolist())
            logger.info("%s: %d tokens in %.1f s", name, len(target), time.perf_counter() - t0)
        rows = {}
        for L in args.exits:
            flat = [m for seq in matches[L] for m in seq]
            cost = (L * layer_params + head_params) / full
            by_k = {}
            for k in (1, 2, 3, 4):
                sims = [simulate(seq, k, cost) for seq in matches[L]]
                by_k[k] = {"tokens_per_step": sum(s[0] for s in sims) / len(sims),
                           "modelled_speedup": sum(s[1] for s in sims) / len(sims)}  # fmt: skip
            rows[L] = {"acceptance": sum(flat) / len(flat), "draft_cost": cost, "by_k": by_k}
        results["workloads"][name] = rows
    logger.info(
        "| workload | exit layer L | draft cost / step | acceptance | best k | tokens / step | modelled speed-up |"
    )
    logger.info("|---|---:|---:|---:|---:|---:|---:|")
    for name, rows in results["workloads"].items():
        for L, row in rows.items():
            k, best = max(row["by_k"].items(), key=lambda kv: kv[1]["modelled_speedup"])
            logger.info("| %s | %d / %d | %.2f | %.2f | %d | %.2f | %.2fx |", name, L,
                        cfg.num_hidden_layers, row["draft_cost"], row["acceptance"], k,
                        best["tokens_per_step"], best["modelled_speedup"])  # fmt: skip
    Path(args.out).write_text(json.dumps(results, indent=1))
    logger.info("wrote %s", args.out)


if __name__ == "__main__":
    main()
