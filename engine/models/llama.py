"""The Llama family (Llama, Mistral, Qwen2, Qwen3) in plain torch, over the paged KV cache.

Differences between the family members are all config: GQA/MQA, a head_dim apart from
hidden_size / num_heads, q/k/v (and o, MLP) biases, per-head q/k RMSNorm (Qwen3), tied
embeddings, RoPE scaling (linear, llama3). q/k/v and gate/up are fused into one matmul each;
``load_weight`` takes the checkpoint's separate tensors and writes them into their rows.

The batch is flattened: every tensor is ``[num_tokens, ...]`` with no padding, and attention
goes through the step's ``AttentionMetadata``'s backend (``engine.attention``).

``CausalLM`` is what the loader and the model runner see of a model; other families
(models/gemma3.py) build on it and on the layers here.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from types import ModuleType
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.engine.attention import AttentionMetadata, CpuAttention
from pdserve.engine.host_memory import huge_page_copies
from pdserve.engine.utils import cdiv

if TYPE_CHECKING:
    from pdserve.engine.lora.layers import LoRASlots
    from pdserve.engine.models.loader import ModelArch
    from pdserve.engine.parallel import PipelineStage

# Checkpoint projection name -> (our fused projection, index of its rows block).
_FUSED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}
_UNFUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def _param(*shape: int, dtype: torch.dtype, fill: float | None = None) -> nn.Parameter:
    # Uninitialised (the loader fills every parameter): no init cost at start-up.
    data = (
        torch.empty(*shape, dtype=dtype) if fill is None else torch.full(shape, fill, dtype=dtype)
    )
    return nn.Parameter(data, requires_grad=False)


def _onednn_linear_available() -> bool:
    mkldnn = getattr(torch.ops, "mkldnn", None)
    return torch.backends.mkldnn.is_available() and hasattr(mkldnn, "_linear_pointwise")


_ONEDNN = _onednn_linear_available()


class UsesFusedOps:
    """A module that can run on the compiled CPU layers (pdserve_kernels/cpu: fused_add_rms_norm,
    rotary_embedding, silu_and_mul, linear_small_m): fused_ops is that module, or None for the
    torch ops (same rounding as the torch code below). Set per model by
    CausalLM.use_cpu_fused_ops, so two models in one process (a draft and its target, tests)
    each run as their runner chose."""

    fused_ops: ModuleType | None = None

    def _fusable(self, x: torch.Tensor) -> bool:
        return self.fused_ops is not None and not x.is_cuda


def padded_rows(n: int) -> int:
    """The row count a CPU forward over n tokens runs at. oneDNN builds (and JITs) a GEMM
    primitive for every new row count, 2-20 ms each in bf16, so unpadded the varying batch and
    chunk sizes of a serving run kept paying it. Rounding up to 8 sizes per power of two bounds
    the shapes (~70 up to 2048 rows) and the extra rows to under 12.5%."""
    step = 1 << max(0, n.bit_length() - 4)
    return cdiv(n, step) * step


PADDED_DTYPES = {torch.bfloat16}
"""Dtypes whose CPU forwards pad their rows: where it measured faster (bf16, whose oneDNN GEMM
primitives cost 2-20 ms to build per new row count). In float32 padding bought nothing, offline
(68.1 / 74.9 s padded vs 68.8 / 71.1 s not) or through `pdserve serve` (aggregated, 2 threads,
Poisson load, client in the server's session: TPOT medians 71 / 32 / 32 ms padded vs 61 / 37 / 51
not; an earlier "padding doubles TPOT" came from a starved load generator)."""


def _pad_rows(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """t ([n, ...]) with zero rows appended up to padded_rows(n) (CPU forwards in
    PADDED_DTYPES only)."""
    n = t.shape[0]
    rows = padded_rows(n) if dtype in PADDED_DTYPES and not t.is_cuda else n
    if rows == n:
        return t
    return F.pad(t, (0, 0) * (t.dim() - 1) + (0, rows - n))


# Below this many rows a float32 product is memory-bound and torch's own GEMV is the faster path.
_ONEDNN_MIN_ROWS_FP32 = 8


def pack_weight(weight: torch.Tensor, batch_hint: int = 64) -> torch.Tensor | None:
    """The weight reordered into oneDNN's blocked layout (None where oneDNN is unavailable).
    On this class of CPU (AVX-512, no MKL fast path) oneDNN's packed GEMM runs 2-4x faster
    than F.linear for multi-row inputs.

    A bf16 weight on a CPU without bf16 arithmetic (AVX2 only, e.g. AMD Zen 3: oneDNN refuses
    to pack bf16 there, and torch's bf16 F.linear ran at 9 GFLOP/s against oneDNN's 68 in
    float32 at 2048 rows) is packed as float32: packed_linear then multiplies in float32 and
    rounds the result to bf16 once, the same arithmetic as a bf16 GEMM with float32 sums (the
    bf16 inputs are exact in float32), in another summation order."""
    if not _ONEDNN or weight.is_cuda:
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), batch_hint)
    except RuntimeError:
        if weight.dtype != torch.bfloat16:
            return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach().float(), batch_hint)
    except RuntimeError:
        return None


SMALL_ROWS_MAX = 128
"""Products of up to this many rows (decode steps) go to the AMX kernel when a weight has its
layout (pack_small_rows): 1.7-1.8x oneDNN's speed at 1-16 rows on an AMX CPU (21-22 vs 12 GB/s
of weights read), 1.5x at 48, 1.35x at 128, 1.1x at 256; float32 weights, to the AVX-512 loop
there: 1.4-1.9x at 1-48 rows, 1.07-1.2x at 64-128; bf16 weights without AMX but with
AVX512-BF16 (AMD Zen 4), to a vdpbf16ps loop: 1.4-1.75x at 1-16 rows, 1.08-1.34x at 32-128.
On AVX2 without AVX-512 (AMD Zen 3)
the kernel takes every row count (small_rows_take_all): 2.1-2.7x at 1-4 rows, 1.1-1.35x
from 16 to 2048 (benchmarks/small_rows_linear.py --dtype); so it does wherever the kernels'
own pool runs (served nodes)."""


def pack_small_rows(weight: torch.Tensor) -> torch.Tensor | None:
    """weight ([N, K]) in the layout of the compiled kernel for few-row products
    (pdserve_kernels/cpu/linear.cpp: bf16 on AMX, float32 on AVX-512 or AVX2, bf16 on
    AVX512-BF16 or AVX2 without AMX), or None where it cannot run: no kernels, no AVX2 + FMA, bf16 on an AMX build
    the OS grants no AMX, another dtype, K not a multiple of 32. A second copy of the weight (the oneDNN copy, where there is one,
    serves the many-row products of prefill)."""
    if weight.is_cuda or weight.dtype not in (torch.bfloat16, torch.float32):
        return None
    if weight.shape[1] % 32:
        return None
    from pdserve.kernels.cpu import cpu_ops

    ops = cpu_ops()
    if ops is None or not ops.linear_small_m_available():
        return None
    try:
        return ops.pack_linear_weight(weight.detach())
    except RuntimeError:  # bf16 on an AMX build where the OS grants no AMX
        return None


def small_rows_take_all() -> bool:
    """Whether the few-row kernel takes products of every row count here, so weights it has a
    layout for get no oneDNN copy: on an AVX2 CPU without AVX-512, where it outruns oneDNN
    (pdserve_kernels/cpu/linear.cpp), and wherever the kernels' own pool runs their loops
    (PDSERVE_KERNEL_POOL=1: a served node whose threads have the cores, with OpenMP's threads
    PASSIVE). There oneDNN's products of a prefill chunk ran on sleeping OpenMP threads, a
    wake-up per product, beside a pool that cannot spin while they compute: on an AMD Zen 4 a
    512-token step of SmolLM2 took 450 ms in bf16 vs 360 ms with every product on the kernel,
    whose many-row rate there is oneDNN's within 4% (~400 GFLOP/s bf16, ~200 float32, 128 to
    2048 rows); issue 17's served workload on the engine alone, 150 -> 173 output tok/s in bf16,
    92 -> 113 in float32 (benchmarks/engine_closed_loop.py). Unmeasured on AMX CPUs."""
    from pdserve.kernels.cpu import cpu_ops

    ops = cpu_ops()
    return ops is not None and (ops.linear_small_m_all_rows() or ops.kernel_pool_enabled())


def packed_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    packed: torch.Tensor | None,
    bias: torch.Tensor | None,
    small: torch.Tensor | None = None,
    ops: ModuleType | None = None,
) -> torch.Tensor:
    """x W^T (+ b): few rows through the compiled kernel (small: pack_small_rows' layout; ops:
    the compiled layers, None while they are off), every row count where the weight has no
    oneDNN copy (small_rows_take_all), more through the oneDNN-packed weight when it pays off,
    else F.linear."""
    if (
        small is not None
        and ops is not None
        and (x.shape[0] <= SMALL_ROWS_MAX or packed is None)
        and x.dim() == 2
        and x.stride(1) == 1
        and x.dtype == small.dtype
    ):
        return ops.linear_small_m(x, small, weight.shape[0], bias)
    if packed is not None and packed.dtype != x.dtype:  # bf16 packed as float32 (pack_weight)
        x32, b32 = x.float(), None if bias is None else bias.float()
        return torch.ops.mkldnn._linear_pointwise(x32, packed, b32, "none", [], "").to(x.dtype)
    if packed is not None and (x.dtype == torch.bfloat16 or x.shape[0] >= _ONEDNN_MIN_ROWS_FP32):
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    return F.linear(x, weight, bias)


class Linear(UsesFusedOps, nn.Module):
    """y = x W^T (+ b). shard_sizes: output rows of each checkpoint tensor fused into W."""

    def __init__(
        self, in_features: int, shard_sizes: tuple[int, ...], bias: bool, dtype: torch.dtype
    ) -> None:
        super().__init__()
        self.shard_sizes = shard_sizes
        self.weight = _param(sum(shard_sizes), in_features, dtype=dtype)
        self.bias = _param(sum(shard_sizes), dtype=dtype) if bias else None
        self.packed: torch.Tensor | None = None
        """oneDNN-packed copy of weight, made by pack() once the weights are loaded."""
        self.small: torch.Tensor | None = None
        """The weight in the few-row kernel's layout (pack_small_rows), made by pack()."""
        self.lora: LoRASlots | None = None
        """The LoRA adapters' stacked weights (engine/lora/), when LoRA is enabled."""
        self.reduce: Callable[[torch.Tensor], None] | None = None
        """Tensor parallelism (engine/parallel.py): sums a row-parallel output over the ranks,
        in place."""

    def pack(self) -> None:
        self.small = pack_small_rows(self.weight)
        take_all = self.small is not None and small_rows_take_all()
        self.packed = None if take_all else pack_weight(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = packed_linear(x, self.weight, self.packed, self.bias, self.small, self.fused_ops)
        if self.reduce is not None:
            self.reduce(y)
        return y if self.lora is None else self.lora.add_to(x, y)


class RMSNorm(UsesFusedOps, nn.Module):
    """RMSNorm computed in float32, scaled in the input dtype (as transformers does)."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = _param(dim, dtype=dtype, fill=1.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Always the torch ops: this plain norm runs once per forward (the embedding's; q/k norms
        # are strided views), and the same ops as transformers keep float32 logits within 1e-4
        # of its (the random test models amplify even an ulp of difference here).
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)

    def add_and_norm(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(residual + x), residual + x). May reuse x's and residual's memory: both must
        be fresh activations no one else holds."""
        if self._fusable(x) and x.is_contiguous() and residual.is_contiguous():
            self.fused_ops.fused_add_rms_norm(x, residual, self.weight, self.eps)
            return x, residual
        residual = residual + x
        return self(residual), residual


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """[head_dim / 2] float32 inverse frequencies of RoPE base theta, scaled like transformers'
    rope types (scaling: ModelArch.rope_scaling's form)."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (theta**exponents)
    if scaling is None:
        return inv_freq
    if scaling["rope_type"] == "linear":
        return inv_freq / scaling["factor"]
    return _llama3_inv_freq(inv_freq, scaling)


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    # Llama 3.1: long wavelengths divided by factor, short ones kept, smooth in between.
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen, high_freq_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rope_cos_sin(
    inv_freq: torch.Tensor, max_positions: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables [max_positions, head_dim / 2], computed in float32."""
    positions = torch.arange(max_positions, dtype=torch.float32)
    freqs = torch.outer(positions, inv_freq)
    return freqs.cos().to(dtype), freqs.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, H, D] (rotate-half convention) by cos/sin [T, D / 2]."""
    x1, x2 = x.chunk(2, dim=-1)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class Attention(UsesFusedOps, nn.Module):
    """Self-attention over the paged KV cache: fused q/k/v, optional per-head q/k norm, RoPE."""

    norm_class: ClassVar[Callable[[int, float, torch.dtype], nn.Module]] = RMSNorm
    """The q/k norm (Gemma's differs)."""

    def __init__(self, arch: ModelArch, dtype: torch.dtype) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            arch.num_heads,
            arch.num_kv_heads,
            arch.head_dim,
        )
        q_size, kv_size = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
        self.split_sizes = [q_size, kv_size, kv_size]
        self.qkv_proj = Linear(
            arch.hidden_size, (q_size, kv_size, kv_size), arch.attention_bias, dtype
        )
        self.o_proj = Linear(q_size, (arch.hidden_size,), arch.o_proj_bias, dtype)
        norm = self.norm_class
        self.q_norm = norm(arch.head_dim, arch.rms_norm_eps, dtype) if arch.qk_norm else None
        self.k_norm = norm(arch.head_dim, arch.rms_norm_eps, dtype) if arch.qk_norm else None
        self.scale = arch.head_dim**-0.5
        self.window: int | None = None
        """Sliding window of this layer (engine/attention.py); None: the whole context."""

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        q, k, v = self.qkv_proj(x).split(self.split_sizes, dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self._fusable(q):
            self.fused_ops.rotary_embedding(q, k, cos, sin)  # in place, inside the fresh qkv output
        else:
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = meta.backend(q, k, v, kv_cache, meta, self.scale, self.window)
        return self.o_proj(out.reshape(num_tokens, -1))


class MLP(UsesFusedOps, nn.Module):
    def __init__(self, arch: ModelArch, dtype: torch.dtype) -> None:
        super().__init__()
        size = arch.intermediate_size
        self.gate_up_proj = Linear(arch.hidden_size, (size, size), arch.mlp_bias, dtype)
        self.down_proj = Linear(size, (arch.hidden_size,), arch.mlp_bias, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self._fusable(gate_up):
            return self.down_proj(self.fused_ops.silu_and_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, arch: ModelArch, dtype: torch.dtype) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype)
        self.self_attn = Attention(arch, dtype)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype)
        self.mlp = MLP(arch, dtype)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual stream is carried apart from the sublayer output x (as vLLM does), so
        each residual add is fused into the norm after it. Returns (mlp output, residual):
        their sum is the layer's output hidden state. residual None: x is the embedding."""
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm.add_and_norm(x, residual)
        x = self.self_attn(x, cos, sin, kv_cache, meta)
        x, residual = self.post_attention_layernorm.add_and_norm(x, residual)
        return self.mlp(x), residual


class LlamaModel(nn.Module):
    def __init__(self, arch: ModelArch, dtype: torch.dtype) -> None:
        super().__init__()
        self.embed_tokens = nn.Module()
        self.embed_tokens.weight = _param(arch.vocab_size, arch.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(DecoderLayer(arch, dtype) for _ in range(arch.num_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype)


def make_lm_head(arch: ModelArch, dtype: torch.dtype) -> Linear | None:
    """The output projection; None with tied embeddings (the embedding matrix serves)."""
    if arch.tie_word_embeddings:
        return None
    return Linear(arch.hidden_size, (arch.vocab_size,), False, dtype)


class CausalLM(UsesFusedOps, nn.Module):
    """A decoder over the paged KV cache, as the loader and the model runner use it. Subclasses
    build ``model.embed_tokens``, ``model.layers`` and ``lm_head`` (None when tied) and
    implement forward. Parameter names are the checkpoint's, except the fused ``qkv_proj`` and
    ``gate_up_proj``."""

    applies_sliding_window: ClassVar[bool] = False
    """Whether forward limits attention to arch.sliding_window where the config asks for it;
    the loader refuses a window shorter than the max length for classes that do not."""

    arch: ModelArch
    dtype: torch.dtype
    model: nn.Module
    lm_head: Linear | None
    _packed_tied_head: torch.Tensor | None = None
    _small_tied_head: torch.Tensor | None = None
    _compiled: Any = None
    """The compiled layer loop (pdserve_kernels/cpu LlamaLayers / GemmaLayers) once built,
    False where this model cannot use it, None until the first forward decides."""
    stage: PipelineStage | None = None
    """Pipeline parallelism (engine/parallel.py): this process runs only its stage's layers,
    taking the residual stream from the previous stage and handing it on."""

    use_compiled_layers = os.environ.get("PDSERVE_COMPILED_LAYERS", "1") != "0"
    """Whether forward may run its layers through the compiled layer loop (_compiled_layers);
    False (or PDSERVE_COMPILED_LAYERS=0 at import, for A/B benchmarks): always the Python
    layers (tests compare the two)."""

    _compiled_max_rows: int | None = None
    """Most rows a forward may have to take the loop (None: any): where a projection has a
    oneDNN copy, forwards past SMALL_ROWS_MAX rows take the Python layers (packed_linear)."""

    def _compiled_layers(
        self, rows: int, kv_caches: list[torch.Tensor], meta: AttentionMetadata
    ) -> Any | None:
        """The compiled loop over every layer (pdserve_kernels/cpu/decoder_layers.cpp: the same
        kernels in the same order as the layers' forward, bit-identical, without ~25 Python
        calls a layer: SmolLM2 bf16 decode steps 1.8-2.1 ms shorter on 2 Zen 4 cores, 12.3 ->
        10.5 ms at 1 row, 20.1 -> 18.0 at 8), or None where the Python layers must run: a
        model whose layers the loop does not know (_build_compiled_layers), or not on the
        compiled CPU kernels (LoRA, tensor parallelism, a projection without the few-row
        kernel's layout), a step past the kernel's rows, another attention backend, or a cache
        in another dtype (float8). Built at the first forward, after LoRA and tensor
        parallelism attach to the projections (engine construction); pack_weights and
        use_cpu_fused_ops drop it."""
        if self._compiled is None:
            self._compiled = self._build_compiled_layers() or False
        if self._compiled is False or not self.use_compiled_layers:
            return None
        if self._compiled_max_rows is not None and rows > self._compiled_max_rows:
            return None
        if not isinstance(meta.backend, CpuAttention) or kv_caches[0].dtype != self.dtype:
            return None
        return self._compiled

    def _build_compiled_layers(self) -> Any | None:
        """The loop over this model's layers, or None (here: no loop for this model)."""
        return None

    def _loop_takes_projections(self, layers: list[nn.Module]) -> bool:
        """Whether every projection of these layers has the few-row kernel's layout and
        nothing on top (a LoRA slot, a tensor-parallel sum); sets _compiled_max_rows."""
        linears = [m for layer in layers for m in layer.modules() if isinstance(m, Linear)]
        if any(m.small is None or m.lora is not None or m.reduce is not None for m in linears):
            return False
        self._compiled_max_rows = None if all(m.packed is None for m in linears) else SMALL_ROWS_MAX
        return True

    @staticmethod
    def _loop_projections(layers: list[nn.Module]) -> list[list[Any]]:
        """The loop constructors' projection arguments, a list over the layers each: the qkv,
        o, gate_up and down weights in the few-row kernel's layout, then their biases."""
        attn = [layer.self_attn for layer in layers]
        mlp = [layer.mlp for layer in layers]
        linears = [
            *(a.qkv_proj for a in attn), *(a.o_proj for a in attn),
            *(m.gate_up_proj for m in mlp), *(m.down_proj for m in mlp),
        ]  # fmt: skip
        n = len(layers)
        groups = [linears[i : i + n] for i in range(0, 4 * n, n)]
        return [[m.small for m in g] for g in groups] + [[m.bias for m in g] for g in groups]

    @staticmethod
    def _loop_step_args(meta: AttentionMetadata) -> tuple[Any, ...]:
        """The loop's forward arguments after the caches: the step's slots, decode rows and
        prompt chunks, as CpuAttention reads them from meta."""
        nd = meta.num_decode_tokens
        prefills = meta.prefill_batch if meta.prefills else (None, None, None, None)
        decode = (meta.decode_block_tables, meta.decode_seq_lens) if nd else (None, None)
        return (meta.slot_mapping, nd, *decode, *prefills)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Final-norm hidden states [T, hidden] of the flattened batch input_ids [T] at
        positions [T]; writes each layer's new K/V into kv_caches at meta.slot_mapping."""
        raise NotImplementedError

    def _padded(
        self, input_ids: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """input_ids and positions padded to a GEMM-friendly row count; padding rows are token
        0 at position 0 and write no K/V (paged_attention)."""
        dtype = self.model.embed_tokens.weight.dtype
        return _pad_rows(input_ids, dtype), _pad_rows(positions, dtype)

    def _final_norm(
        self, x: torch.Tensor, residual: torch.Tensor | None, num_tokens: int
    ) -> torch.Tensor:
        """The last residual add and norm, the padding rows dropped."""
        if residual is None:  # no layers
            return self.model.norm(x)[:num_tokens]
        return self.model.norm.add_and_norm(x, residual)[0][:num_tokens]

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        """Shape of one layer's KV cache (layout: engine/attention.py)."""
        return (num_blocks, 2, self.arch.num_kv_heads, block_size, self.arch.head_dim)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N, vocab] float32 logits."""
        n = hidden.shape[0]
        hidden = _pad_rows(hidden, hidden.dtype)
        if self.lm_head is not None:
            return self.lm_head(hidden)[:n].float()
        weight = self.model.embed_tokens.weight
        head = packed_linear(
            hidden, weight, self._packed_tied_head, None, self._small_tied_head, self.fused_ops
        )
        return head[:n].float()

    def products_on_kernel(self) -> bool:
        """Whether every product of every forward runs on the few-row kernel: each projection
        (and a tied head) has its layout and no oneDNN copy (small_rows_take_all)."""
        if self.lm_head is None and (
            self._small_tied_head is None or self._packed_tied_head is not None
        ):
            return False
        linears = [module for module in self.modules() if isinstance(module, Linear)]
        return all(module.small is not None and module.packed is None for module in linears)

    def use_cpu_fused_ops(self, ops: ModuleType | None) -> None:
        """Run this model's RMSNorm (+ residual add), RoPE, SiLU*up and few-row products on
        CPU through the compiled kernels (one pass over memory each instead of one per torch
        op), or through torch with None."""
        for module in self.modules():
            if isinstance(module, UsesFusedOps):
                module.fused_ops = ops
        self._compiled = None  # the layer loop: decided again at the next forward

    def pack_weights(self) -> None:
        """Reorder every projection's weight for oneDNN and the few-row kernel (after loading;
        CPU only)."""
        linears = [module for module in self.modules() if isinstance(module, Linear)]
        for module in linears:
            module.pack()
        self._compiled = None  # the layer loop holds the old layouts
        if self.lm_head is None:
            embed = self.model.embed_tokens.weight
            self._small_tied_head = pack_small_rows(embed)
            take_all = self._small_tied_head is not None and small_rows_take_all()
            self._packed_tied_head = None if take_all else pack_weight(embed)
        # The few-row kernel's weights, which every decode step streams once, on huge pages
        # (engine/host_memory.py), one after another in the order a step reads them.
        with_small = [m for m in linears if m.small is not None]
        tensors = [m.small for m in with_small]
        if self._small_tied_head is not None:
            tensors.append(self._small_tied_head)
        copies = huge_page_copies(tensors)
        for module, copy in zip(with_small, copies, strict=False):  # the tied head's is last
            module.small = copy
        if self._small_tied_head is not None:
            self._small_tied_head = copies[-1]

    def checkpoint_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor the checkpoint must provide (HF names) and its shape."""
        shapes: dict[str, tuple[int, ...]] = {}
        for name, param in self.named_parameters():
            module_name, _, leaf = name.rpartition(".")
            prefix, _, proj = module_name.rpartition(".")
            if proj not in _UNFUSED:
                shapes[name] = tuple(param.shape)
                continue
            sizes = self.get_submodule(module_name).shard_sizes
            for part, size in zip(_UNFUSED[proj], sizes, strict=True):
                shapes[f"{prefix}.{part}.{leaf}"] = (size, *param.shape[1:])
        return shapes

    def load_weight(self, name: str, tensor: torch.Tensor) -> None:
        """Copy one checkpoint tensor (HF name) into its parameter (or rows of a fused one),
        converting to the model dtype."""
        module_name, _, leaf = name.rpartition(".")
        prefix, _, proj = module_name.rpartition(".")
        if proj not in _FUSED:
            self.get_parameter(name).copy_(tensor)
            return
        fused_name, index = _FUSED[proj]
        module = self.get_submodule(f"{prefix}.{fused_name}")
        offset = sum(module.shard_sizes[:index])
        param = getattr(module, leaf)
        param.narrow(0, offset, module.shard_sizes[index]).copy_(tensor)


class LlamaForCausalLM(CausalLM):
    """A Llama-family decoder (Llama, Mistral, Qwen2, Qwen3)."""

    def __init__(self, arch: ModelArch, dtype: torch.dtype) -> None:
        super().__init__()
        self.arch = arch
        self.dtype = dtype
        self.model = LlamaModel(arch, dtype)
        self.lm_head = make_lm_head(arch, dtype)
        inv_freq = rope_inv_freq(arch.head_dim, arch.rope_theta, arch.rope_scaling)
        cos, sin = rope_cos_sin(inv_freq, arch.max_position_embeddings, dtype)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def _build_compiled_layers(self) -> Any | None:
        ops = self.fused_ops
        if ops is None or not hasattr(ops, "LlamaLayers") or self.stage is not None:
            return None
        layers = list(self.model.layers)
        plain = all(
            type(layer) is DecoderLayer
            and type(layer.self_attn) is Attention
            and type(layer.mlp) is MLP
            and type(layer.input_layernorm) is RMSNorm
            and type(layer.post_attention_layernorm) is RMSNorm
            and type(layer.self_attn.q_norm) is type(layer.self_attn.k_norm)
            and type(layer.self_attn.q_norm) in (RMSNorm, type(None))
            for layer in layers
        )
        if not layers or not plain or not self._loop_takes_projections(layers):
            return None
        arch = self.arch
        attn = [layer.self_attn for layer in layers]
        return ops.LlamaLayers(
            [layer.input_layernorm.weight for layer in layers],
            [layer.post_attention_layernorm.weight for layer in layers],
            *self._loop_projections(layers),
            [None if a.q_norm is None else a.q_norm.weight for a in attn],
            [None if a.k_norm is None else a.k_norm.weight for a in attn],
            [a.window or 0 for a in attn],
            arch.num_heads,
            arch.num_kv_heads,
            arch.head_dim,
            arch.hidden_size,
            arch.intermediate_size,
            layers[0].input_layernorm.eps,
            attn[0].scale,
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        num_tokens = input_ids.shape[0]
        input_ids, positions = self._padded(input_ids, positions)
        cos, sin = self.rope_cos[positions], self.rope_sin[positions]
        stage = self.stage
        residual: torch.Tensor | None = None
        if stage is None or stage.is_first:
            x = F.embedding(input_ids, self.model.embed_tokens.weight)
        else:  # the previous stage's residual stream
            x, residual = stage.receive(input_ids.shape[0], self.arch.hidden_size, self.dtype)
        compiled = self._compiled_layers(x.shape[0], kv_caches, meta)  # None with a stage
        if compiled is not None:
            residual, x = x, self.model.layers[0].input_layernorm(x)
            step = self._loop_step_args(meta)
            x, residual = compiled.forward(x, residual, cos, sin, kv_caches, *step)
            return self._final_norm(x, residual, num_tokens)
        for layer, kv_cache in zip(self.model.layers, kv_caches, strict=True):
            x, residual = layer(x, residual, cos, sin, kv_cache, meta)
        if stage is not None:
            assert residual is not None  # every stage has layers
            x, residual = stage.pass_on(x, residual)
        return self._final_norm(x, residual, num_tokens)
