"""The device options on a machine without a GPU: device resolution and its errors, the
decode graphs' static buffers (on a CPU run eagerly, same padding and null-block slots as the
CUDA graphs), a float8 KV cache on the torch backend, and GPU memory sizing's arithmetic."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.cuda_graphs import capture_sizes
from pdserve.engine.device import resolve_device
from pdserve.engine.gpu_memory import dummy_step, kv_blocks_that_fit

PROMPTS = ["def fibonacci(n):", "import os\nimport sys\n", "The capital of", "1, 2, 3,", "x"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def token_ids(llm: LLM, prompts: list[str], params: SamplingParams = GREEDY) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def test_device_names_resolve_or_say_why() -> None:
    assert resolve_device("cpu") == torch.device("cpu")
    if not torch.cuda.is_available():
        assert resolve_device("auto") == torch.device("cpu")
        with pytest.raises(ValueError, match="no CUDA GPU"):
            resolve_device("cuda:0")
    with pytest.raises(ValueError, match="device must be"):
        resolve_device("tpu")


def test_bad_device_settings_are_value_errors(tiny_llama) -> None:
    with pytest.raises(ValueError, match="device must be auto, cpu, cuda or cuda:N"):
        LLM(model=tiny_llama, device="gpu0")
    with pytest.raises(ValueError, match="float16 runs on CUDA only"):
        LLM(model=tiny_llama, device="cpu", dtype="float16")
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        LLM(model=tiny_llama, gpu_memory_utilization=1.5)
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        LLM(model=tiny_llama, kv_cache_dtype="int4")
    with pytest.raises(ValueError, match="do not read a float8 KV cache"):
        LLM(model=tiny_llama, num_blocks=64, kv_cache_dtype="fp8", attention_backend="cpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA GPU"):
            LLM(model=tiny_llama, device="cuda")


def test_capture_sizes_cover_every_batch_up_to_max_num_seqs() -> None:
    assert capture_sizes(1) == [1]
    assert capture_sizes(6) == [1, 2, 4, 6]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert capture_sizes(1000)[-3:] == [240, 248, 256]


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_decode_graph_buffers_give_the_eager_tokens(tiny_llama, backend) -> None:
    """Every batch size of the ladder (5 prompts finishing at different steps: 5, 4, ... 1
    rows, padded to 8, 4, 2, 1) decodes the same tokens through the static buffers, and the
    padding rows' K/V lands in the null block only."""
    kwargs = dict(model=tiny_llama, dtype="float32", num_blocks=64, attention_backend=backend)
    eager = LLM(**kwargs)
    graphed = LLM(**kwargs, max_num_seqs=8)
    graphed.engine.runner.capture_decode_graphs(8, graphed.engine.max_model_len)
    assert graphed.engine.runner.graphs.sizes == [1, 2, 4, 8]
    lengths = [12, 9, 7, 3, 1]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths]
    want = [o.outputs[0].token_ids for o in eager.generate(PROMPTS, params, use_tqdm=False)]
    got = [o.outputs[0].token_ids for o in graphed.generate(PROMPTS, params, use_tqdm=False)]
    assert got == want
    assert [len(t) for t in got] == lengths
    cache = graphed.engine.runner.kv_cache
    assert cache[:, 0, :, :, 1:].abs().sum() == 0  # padding wrote slot 0 of the null block only
    seeded = SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=10)
    assert token_ids(graphed, PROMPTS, seeded) == token_ids(eager, PROMPTS, seeded)


def test_fp8_kv_cache_on_the_torch_backend(tiny_llama) -> None:
    """A float8 cache: half the bytes of bf16 per block, and greedy tokens that mostly agree
    with the bf16 cache's (K/V rounded to 3 mantissa bits)."""
    bf16 = LLM(model=tiny_llama, dtype="bfloat16", num_blocks=64, attention_backend="torch")
    fp8 = LLM(model=tiny_llama, dtype="bfloat16", num_blocks=64, kv_cache_dtype="fp8")
    assert fp8.engine.runner.kv_cache.dtype == torch.float8_e4m3fn
    assert fp8.engine.runner.attention.name == "torch"  # auto: the cpu kernels cannot read it
    assert fp8.engine.runner.kv_cache.nbytes * 2 == bf16.engine.runner.kv_cache.nbytes
    want, got = token_ids(bf16, PROMPTS), token_ids(fp8, PROMPTS)
    same = sum(a == b for w, g in zip(want, got, strict=True) for a, b in zip(w, g, strict=True))
    assert same >= 0.6 * sum(len(w) for w in want), (want, got)
    assert sum(g[0] == w[0] for w, g in zip(want, got, strict=True)) >= 4
    stored = fp8.engine.runner.kv_cache.float()
    assert torch.isfinite(stored).all() and stored.abs().sum() > 0


def test_kv_blocks_that_fit_leave_the_peak_and_other_processes_out() -> None:
    gib = 1 << 30
    # 80 GiB GPU, 70 free, torch reserved 2: others hold 8; budget 72 - 10 (peak) - 8 = 54 GiB
    blocks = kv_blocks_that_fit(80 * gib, 70 * gib, 2 * gib, 10 * gib, 0.9, gib // 4)
    assert blocks == 54 * 4
    assert kv_blocks_that_fit(80 * gib, 10 * gib, 0, 70 * gib, 0.9, gib) == 0


def test_dummy_step_is_the_largest_step_the_scheduler_can_make() -> None:
    step = dummy_step(2048, 128, 4096, 16)
    assert len(step) == 128 and sum(len(c.token_ids) for c in step) == 2048
    blocks = [b for c in step for b in c.block_ids]
    assert blocks == list(range(1, len(blocks) + 1))  # distinct, none the null block
    long = dummy_step(8192, 4, 1024, 16)  # longer than max_model_len: more, shorter requests
    assert len(long) == 8 and all(len(c.token_ids) == 1024 for c in long)
