"""Gemma 3 text models (``Gemma3ForCausalLM``, model_type "gemma3_text") in plain torch, over
the paged KV cache, on the Llama layers of models/llama.py (fused projections, RoPE, attention).

What Gemma 3 adds, matching transformers' Gemma3ForCausalLM:

- embeddings scaled by sqrt(hidden_size), the scale rounded to the model dtype first;
- RMSNorm as x * (1 + weight), in float32 and rounded to the model dtype once;
- per-head q/k norms, and four norms per layer: the attention and MLP outputs are normed before
  they join the residual stream (post_attention / post_feedforward), the MLP input after
  (pre_feedforward);
- a GeGLU MLP (gelu, tanh approximation); attention scores scaled by query_pre_attn_scalar^-1/2;
- sliding-window layers (``ModelArch.layer_sliding``): the query at position p attends to keys
  in (p - sliding_window, p] only (engine/attention.py applies the window), with their own RoPE
  base (local_rope_theta); the full-attention layers use rope_theta and rope_scaling;
- tied embeddings, optional final logit softcapping.

On the compiled CPU kernels the norms and GeGLU are one pass each (gemma_rms_norm,
gemma_add_rms_norm, gelu_tanh_and_mul), and a forward runs every layer in one call
(CausalLM._compiled_layers, pdserve_kernels/cpu/decoder_layers.cpp GemmaLayers: the same kernels
in the same order, bit-identical to the layers below).

KV cache layout: the same as every model's (engine/attention.py), one tensor over all layers
with the same blocks for each, so a sliding-window layer keeps the K/V of every position although
it only attends to the last sliding_window. The block manager, prefix caching and KV transfer
stay unaware of layer kinds; the price is memory (for Gemma 3 270M, 15 of its 18 layers would
need 512 positions per request, not max_model_len).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.engine.attention import AttentionMetadata
from pdserve.engine.models.llama import (
    MLP,
    Attention,
    CausalLM,
    UsesFusedOps,
    _param,
    make_lm_head,
    rope_cos_sin,
    rope_inv_freq,
)

if TYPE_CHECKING:
    from pdserve.engine.models.loader import ModelArch


class GemmaRMSNorm(UsesFusedOps, nn.Module):
    """x / rms(x) * (1 + weight), computed in float32 and rounded to x's dtype once (as
    transformers' Gemma3RMSNorm): the torch ops, or on the compiled CPU kernels one pass
    (gemma_rms_norm; Llama's rms_norm kernel rounds before it scales)."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = _param(dim, dtype=dtype, fill=0.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._fusable(x) and x.dim() in (2, 3) and x.stride(-1) == 1:
            return self.fused_ops.gemma_rms_norm(x, self.weight, self.eps)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * (1.0 + self.weight.float())).to(x.dtype)

    def add_and_norm(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(residual + x), residual + x), like llama.RMSNorm.add_and_norm (on the compiled
        kernels in place: x and residual are the layer's own)."""
        if self._fusable(x) and x.is_contiguous() and residual.is_contiguous():
            self.fused_ops.gemma_add_rms_norm(x, residual, self.weight, self.eps)
            return x, residual
        residual = residual + x
        return self(residual), residual


class Gemma3Attention(Attention):
    """Llama's attention with Gemma's q/k norms, its score scale and, for a sliding-window
    layer, its window."""

    norm_class = GemmaRMSNorm

    def __init__(self, arch: ModelArch, dtype: torch.dtype, sliding: bool) -> None:
        super().__init__(arch, dtype)
        self.scale = (arch.query_pre_attn_scalar or arch.head_dim) ** -0.5
        self.window = arch.sliding_window if sliding else None


class GeGLU(MLP):
    """down(gelu_tanh(gate) * up), the fused gate/up projection of Llama's MLP."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self._fusable(gate_up):
            return self.down_proj(self.fused_ops.gelu_tanh_and_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, arch: ModelArch, dtype: torch.dtype, sliding: bool) -> None:
        super().__init__()
        self.sliding = sliding
        """Sliding-window layer: local RoPE and a window on attention."""
        hidden, eps = arch.hidden_size, arch.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(hidden, eps, dtype)
        self.self_attn = Gemma3Attention(arch, dtype, sliding)
        self.post_attention_layernorm = GemmaRMSNorm(hidden, eps, dtype)
        self.pre_feedforward_layernorm = GemmaRMSNorm(hidden, eps, dtype)
        self.mlp = GeGLU(arch, dtype)
        self.post_feedforward_layernorm = GemmaRMSNorm(hidden, eps, dtype)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(normed MLP output, residual), whose sum is the layer's output hidden state, as in
        llama.DecoderLayer. residual None: x is the (scaled) embedding."""
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm.add_and_norm(x, residual)
        x = self.post_attention_layernorm(self.self_attn(x, cos, sin, kv_cache, meta))
        x, residual = self.pre_feedforward_layernorm.add_and_norm(x, residual)
        return self.post_feedforward_layernorm(self.mlp(x)), residual


class Gemma3Model(nn.Module):
    def __init__(self, arch: ModelArch, dtype: torch.dtype) -> None:
        super().__init__()
        self.embed_tokens = nn.Module()
        self.embed_tokens.weight = _param(arch.vocab_size, arch.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(
            Gemma3DecoderLayer(arch, dtype, sliding) for sliding in arch.layer_sliding
        )
        self.norm = GemmaRMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype)


class Gemma3ForCausalLM(CausalLM):
    """A Gemma 3 text decoder (module docstring)."""

    applies_sliding_window = True

    def __init__(self, arch: ModelArch, dtype: torch.dtype) -> None:
        super().__init__()
        if len(arch.layer_sliding) != arch.num_layers:
            raise ValueError("Gemma 3 needs a layer type (sliding or full) for every layer")
        self.arch = arch
        self.dtype = dtype
        self.model = Gemma3Model(arch, dtype)
        self.lm_head = make_lm_head(arch, dtype)
        # transformers: a float32 scalar, cast to the weights' dtype before multiplying
        scale = torch.tensor(arch.hidden_size**0.5, dtype=torch.float32).to(dtype)
        self.register_buffer("embed_scale", scale, persistent=False)
        max_positions = arch.max_position_embeddings
        inv_freq = rope_inv_freq(arch.head_dim, arch.rope_theta, arch.rope_scaling)
        if arch.local_rope_theta is not None:
            local_inv_freq = rope_inv_freq(arch.head_dim, arch.local_rope_theta, None)
        else:
            local_inv_freq = inv_freq
        for prefix, freqs in (("rope", inv_freq), ("local_rope", local_inv_freq)):
            cos, sin = rope_cos_sin(freqs, max_positions, dtype)
            self.register_buffer(f"{prefix}_cos", cos, persistent=False)
            self.register_buffer(f"{prefix}_sin", sin, persistent=False)

    def _build_compiled_layers(self) -> Any | None:
        """The compiled loop (pdserve_kernels/cpu GemmaLayers) where every layer is a plain
        Gemma 3 layer on the few-row kernel's projections (CausalLM._compiled_layers)."""
        ops = self.fused_ops
        if ops is None or not hasattr(ops, "GemmaLayers") or self.stage is not None:
            return None
        layers = list(self.model.layers)
        norms = (
            "input_layernorm",
            "post_attention_layernorm",
            "pre_feedforward_layernorm",
            "post_feedforward_layernorm",
        )
        plain = all(
            type(layer) is Gemma3DecoderLayer
            and type(layer.self_attn) is Gemma3Attention
            and type(layer.mlp) is GeGLU
            and all(type(getattr(layer, name)) is GemmaRMSNorm for name in norms)
            and type(layer.self_attn.q_norm) is GemmaRMSNorm
            and type(layer.self_attn.k_norm) is GemmaRMSNorm
            for layer in layers
        )
        if not layers or not plain or not self._loop_takes_projections(layers):
            return None
        arch = self.arch
        attn = [layer.self_attn for layer in layers]
        return ops.GemmaLayers(
            *([getattr(layer, name).weight for layer in layers] for name in norms),
            *self._loop_projections(layers),
            [a.q_norm.weight for a in attn],
            [a.k_norm.weight for a in attn],
            [a.window or 0 for a in attn],
            [layer.sliding for layer in layers],
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
        rope = {
            False: (self.rope_cos[positions], self.rope_sin[positions]),
            True: (self.local_rope_cos[positions], self.local_rope_sin[positions]),
        }
        x = F.embedding(input_ids, self.model.embed_tokens.weight) * self.embed_scale
        compiled = self._compiled_layers(x.shape[0], kv_caches, meta)
        if compiled is not None:
            residual, x = x, self.model.layers[0].input_layernorm(x)
            step = self._loop_step_args(meta)
            x, residual = compiled.forward(x, residual, *rope[False], *rope[True], kv_caches, *step)
            return self._final_norm(x, residual, num_tokens)
        residual = None
        for layer, kv_cache in zip(self.model.layers, kv_caches, strict=True):
            cos, sin = rope[layer.sliding]
            x, residual = layer(x, residual, cos, sin, kv_cache, meta)
        return self._final_norm(x, residual, num_tokens)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N, vocab] float32 logits, softcapped where the config asks."""
        logits = super().compute_logits(hidden)
        cap = self.arch.final_logit_softcapping
        if cap is None:
            return logits
        return torch.tanh(logits / cap) * cap
