"""The attention backend is chosen once per runner and carried by each step's metadata (no
process-wide switch): torch, the compiled CPU kernels and the Triton kernels (on this CPU under
TRITON_INTERPRET=1, in a `pdserve generate` process of its own: the variable must be set before
triton is imported) give the same greedy fp32 tokens, a sliding-window model (Gemma 3) included;
a backend that cannot run here is a ValueError saying why."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.attention import attention_backend
from tests.engine.models.test_gemma3_vs_hf import WINDOW, gemma3_dir  # noqa: F401 (fixture)

PROMPTS = ["def fibonacci(n):", "import os\nimport sys\n"]
MAX_TOKENS = 6


def offline(model: str, backend: str) -> list[list[int]]:
    llm = LLM(model=model, dtype="float32", num_blocks=64, attention_backend=backend)
    assert llm.engine.runner.attention.name == backend
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]


def test_cpu_kernels_and_torch_backends_agree(tiny_llama) -> None:
    assert offline(tiny_llama, "cpu") == offline(tiny_llama, "torch")


def test_triton_backend_in_the_engine_under_the_interpreter(tiny_llama) -> None:
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    argv = [sys.executable, "-m", "pdserve.cli", "generate", "--model", tiny_llama,
            "--dtype", "float32", "--attention-backend", "triton", "--num-blocks", "64",
            "--max-tokens", str(MAX_TOKENS), "--ignore-eos", "--json", *PROMPTS]  # fmt: skip
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert [r["token_ids"] for r in records] == offline(tiny_llama, "torch")


def test_a_backend_that_cannot_run_here_is_a_value_error(monkeypatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        attention_backend("triton")
    with pytest.raises(ValueError, match="attention_backend must be one of"):
        attention_backend("flash")


TRITON_GRAPHS_AND_FP8 = """
import json, sys
from pdserve.engine import LLM, SamplingParams
model, prompts, n = sys.argv[1], sys.argv[2:], {n}
params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
out = {{}}
for name, kwargs in (("graphs", {{}}), ("fp8", {{"kv_cache_dtype": "fp8"}})):
    llm = LLM(model=model, dtype="float32", num_blocks=64, max_num_seqs=4,
              attention_backend="triton", **kwargs)
    if name == "graphs":
        llm.engine.runner.capture_decode_graphs(4, llm.engine.max_model_len)
    got = llm.generate(prompts, params, use_tqdm=False)
    out[name] = [o.outputs[0].token_ids for o in got]
print(json.dumps(out))
"""


def test_triton_decode_graph_buffers_and_fp8_cache_under_the_interpreter(tiny_llama) -> None:
    """The Triton backend through the decode graphs' static buffers (every size of a 4-row
    ladder, run eagerly on this CPU) gives the eager torch backend's tokens; with a float8 cache
    it gives the torch backend's float8 tokens (both round K/V to e4m3 the same way)."""
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    code = TRITON_GRAPHS_AND_FP8.format(n=MAX_TOKENS)
    argv = [sys.executable, "-c", code, tiny_llama, *PROMPTS, "x y z", "1 2"]
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.splitlines()[-1])
    prompts = [*PROMPTS, "x y z", "1 2"]
    params = [SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)]
    llm = LLM(model=tiny_llama, dtype="float32", num_blocks=64, attention_backend="torch")
    assert got["graphs"] == [
        o.outputs[0].token_ids for o in llm.generate(prompts, params[0], use_tqdm=False)
    ]
    fp8 = LLM(model=tiny_llama, dtype="float32", num_blocks=64, attention_backend="torch",
              kv_cache_dtype="fp8")  # fmt: skip
    assert got["fp8"] == [
        o.outputs[0].token_ids for o in fp8.generate(prompts, params[0], use_tqdm=False)
    ]


TRITON_GEMMA3 = """
import json, sys
from pdserve.engine import LLM, SamplingParams
model, prompts, kwargs = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
llm = LLM(model=model, dtype="float32", attention_backend="triton", **kwargs)
params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
print(json.dumps([o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]))
"""


def test_triton_sliding_window_gemma3_under_the_interpreter(gemma3_dir: str) -> None:  # noqa: F811
    """Gemma 3 (three of four layers sliding, window 16) on the Triton kernels gives the torch
    backend's greedy tokens: prompts up to 2.5 windows long prefilled in chunks of 16 (each
    chunk after the first attends from a window that starts inside the cached prefix), decodes
    past the window, one prompt shorter than it. Block size 16: windows start mid-block."""
    prompts = [[(7 * i + 11 * j) % 290 + 5 for j in range(n)] for i, n in enumerate((40, 17, 5))]
    kwargs = dict(num_blocks=32, block_size=16, max_num_batched_tokens=16, max_num_seqs=4)
    assert max(map(len, prompts)) > 2 * WINDOW
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    argv = [
        sys.executable,
        "-c",
        TRITON_GEMMA3,
        gemma3_dir,
        json.dumps(prompts),
        json.dumps(kwargs),
    ]
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.splitlines()[-1])
    llm = LLM(model=gemma3_dir, dtype="float32", attention_backend="torch", **kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    assert got == [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
