"""The compiled layer loops (pdserve_kernels/cpu/decoder_layers.cpp, CausalLM's
_compiled_layers: LlamaLayers, GemmaLayers) against the Python layers they replace: the same
kernels and torch ops in the same order, so every logit must be bit-identical, over prefill,
chunked prefill over a cached prefix, decodes beside prompt chunks and padding rows, in float32
and bfloat16, with q/k/v biases, Qwen3's q/k norms, and Gemma 3's four norms a layer, GeGLU,
local RoPE and sliding windows; and the models they must not run (a projection without the
few-row layout, LoRA, tensor parallelism, another attention backend) keep the Python layers."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest
import torch

from pdserve.engine.attention import CpuAttention, TorchAttention
from pdserve.engine.models.llama import LlamaForCausalLM
from pdserve.engine.models.loader import parse_model_arch
from pdserve.engine.models.registry import get_model_class
from pdserve.kernels.cpu import cpu_ops
from tests.engine.models.test_gemma3_vs_hf import WINDOW, gemma3_dir  # noqa: F401 (fixture)
from tests.engine.models.test_llama_vs_hf import PagedSeqs, random_ids

OPS = cpu_ops()
pytestmark = pytest.mark.skipif(OPS is None, reason="the CPU kernels do not build here")


def random_model(model_dir: str, dtype: torch.dtype, seed: int = 0) -> LlamaForCausalLM:
    """The tiny preset's shape with an MLP width the few-row kernel takes (a multiple of 32;
    the preset's 688 is not, which keeps its models on the Python layers), random weights."""
    arch = dataclasses.replace(parse_model_arch(model_dir), intermediate_size=704)
    torch.manual_seed(seed)
    model = get_model_class(arch.architecture)(arch, dtype)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1 + 0.1 * torch.randn(param.shape))
            else:
                param.copy_(0.08 * torch.randn(param.shape))
    model.eval()
    model.pack_weights()
    return model


STEPS = (
    [("a", 40), ("b", 23)],  # two prompts
    [("a", 1), ("b", 1), ("c", 24)],  # decodes beside a prompt's first chunk
    [("a", 1), ("b", 1), ("c", 29)],  # its second chunk over the cached prefix
    [("a", 1), ("b", 1), ("c", 1)],  # decodes only
    [("d", 17)],  # one prompt alone
    [("a", 1), ("d", 1)],
)


def run_steps(model: LlamaForCausalLM, compiled: bool, vocab: int) -> list[torch.Tensor]:
    model.use_compiled_layers = compiled
    seqs = PagedSeqs(model)
    out, seed = [], 0
    for step in STEPS:
        batch = []
        for name, n in step:
            seed += 1
            batch.append((name, random_ids(n, vocab, seed)))
        out += seqs.step(batch)
    return out


def count_compiled_calls(model: LlamaForCausalLM) -> list[int]:
    """The row count of every forward that takes the compiled loop from now on."""
    calls: list[int] = []
    build = model._build_compiled_layers

    def built():
        real = build()
        if real is None:
            return None

        class Counting:
            num_layers = real.num_layers

            def forward(self, *args):
                calls.append(args[0].shape[0])
                return real.forward(*args)

        return Counting()

    model._build_compiled_layers = built
    return calls


@pytest.fixture
def cpu_kernels() -> Callable[[], None]:
    saved = PagedSeqs.fused_ops, PagedSeqs.attention
    PagedSeqs.fused_ops, PagedSeqs.attention = OPS, CpuAttention(OPS)
    yield
    PagedSeqs.fused_ops, PagedSeqs.attention = saved


# qwen2: q/k/v biases, tied embeddings; qwen3: per-head q/k norms
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_layers_bit_identical(tiny_model_dir, cpu_kernels, arch, dtype) -> None:
    model = random_model(tiny_model_dir(arch), dtype)
    vocab = model.arch.vocab_size
    calls = count_compiled_calls(model)
    python = run_steps(model, compiled=False, vocab=vocab)
    assert calls == []
    assert model._compiled.num_layers == model.arch.num_layers  # built, not taken
    compiled = run_steps(model, compiled=True, vocab=vocab)
    assert len(calls) == len(STEPS), "every step must take the compiled loop"
    assert len(python) == len(compiled)
    for i, (p, c) in enumerate(zip(python, compiled, strict=True)):
        assert torch.isfinite(p).all()
        assert torch.equal(p, c), f"entry {i}: max diff {(p - c).abs().max().item():.3g}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemma3_compiled_layers_bit_identical(gemma3_dir, cpu_kernels, dtype) -> None:  # noqa: F811
    """Gemma 3 (3 of 4 layers sliding, window 16, local RoPE base on those): STEPS' prompts
    run past the window, so the windows, both RoPE tables and every norm are exercised."""
    model = random_model(gemma3_dir, dtype)
    assert any(layer.sliding for layer in model.model.layers)
    assert not all(layer.sliding for layer in model.model.layers)
    assert max(n for step in STEPS for _, n in step) > WINDOW
    vocab = model.arch.vocab_size
    calls = count_compiled_calls(model)
    python = run_steps(model, compiled=False, vocab=vocab)
    assert calls == [] and model._compiled.num_layers == model.arch.num_layers
    compiled = run_steps(model, compiled=True, vocab=vocab)
    assert len(calls) == len(STEPS), "every step must take the compiled loop"
    for i, (p, c) in enumerate(zip(python, compiled, strict=True)):
        assert torch.isfinite(p).all()
        assert torch.equal(p, c), f"entry {i}: max diff {(p - c).abs().max().item():.3g}"


def test_compiled_layers_pass_each_layers_window(tiny_model_dir, cpu_kernels) -> None:
    """A window set on a layer (as a sliding-window model would) reaches the attention kernels
    from the loop as from the Python layers: both differ from the windowless run alike."""
    model = random_model(tiny_model_dir("llama"), torch.float32)
    vocab = model.arch.vocab_size
    plain = run_steps(model, compiled=True, vocab=vocab)
    model.model.layers[1].self_attn.window = 16  # PagedSeqs drops the built loop
    python = run_steps(model, compiled=False, vocab=vocab)
    compiled = run_steps(model, compiled=True, vocab=vocab)
    assert all(torch.equal(p, c) for p, c in zip(python, compiled, strict=True))
    assert not all(torch.equal(p, c) for p, c in zip(plain, compiled, strict=True))


def test_models_the_loop_must_not_run(tiny_model_dir, cpu_kernels) -> None:
    # the tiny preset itself: its MLP width (688) has no few-row layout
    from pdserve.engine.models.loader import load_model

    tiny = load_model(tiny_model_dir("llama"), "float32")[0]
    run_steps(tiny, compiled=True, vocab=tiny.arch.vocab_size)
    assert tiny._compiled is False
    # a LoRA slot or a tensor-parallel sum on any projection
    model = random_model(tiny_model_dir("llama"), torch.float32)
    assert model._build_compiled_layers() is None  # no compiled kernels chosen
    model.use_cpu_fused_ops(OPS)
    assert model._build_compiled_layers() is not None
    model.model.layers[2].mlp.down_proj.lora = object()
    assert model._build_compiled_layers() is None
    model.model.layers[2].mlp.down_proj.lora = None
    model.model.layers[3].self_attn.o_proj.reduce = lambda y: None
    assert model._build_compiled_layers() is None


def test_other_backends_keep_the_python_layers(tiny_model_dir) -> None:
    model = random_model(tiny_model_dir("llama"), torch.float32)
    saved = PagedSeqs.fused_ops, PagedSeqs.attention
    PagedSeqs.fused_ops, PagedSeqs.attention = OPS, TorchAttention()
    try:
        calls = count_compiled_calls(model)
        run_steps(model, compiled=True, vocab=model.arch.vocab_size)
        assert calls == []
        assert model._compiled is not False  # eligible, but this backend is not the kernels'
    finally:
        PagedSeqs.fused_ops, PagedSeqs.attention = saved
