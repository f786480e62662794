// A Llama-family decoder's layers run in one call per forward (decoder_layers.cpp).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>

#include <cstdint>
#include <tuple>
#include <vector>

namespace pdserve_cpu {

// The weights of every layer as the compiled kernels take them, and the shapes they share.
// Built once after the weights are packed (engine/models/llama.py, LlamaForCausalLM); holds
// references to the model's tensors, no copies.
class LlamaLayers {
 public:
  // One entry per layer in each list: the two RMSNorm weights, the four projections in
  // linear_small_m's packed layout, their biases (None: no bias), the per-head q and k
  // RMSNorm weights (Qwen3; None: no q/k norm) and the layer's sliding window (0: the whole
  // context).
  LlamaLayers(std::vector<at::Tensor> input_norms, std::vector<at::Tensor> post_norms,
              std::vector<at::Tensor> qkv, std::vector<at::Tensor> o,
              std::vector<at::Tensor> gate_up, std::vector<at::Tensor> down,
              std::vector<c10::optional<at::Tensor>> qkv_bias,
              std::vector<c10::optional<at::Tensor>> o_bias,
              std::vector<c10::optional<at::Tensor>> gate_up_bias,
              std::vector<c10::optional<at::Tensor>> down_bias,
              std::vector<c10::optional<at::Tensor>> q_norms,
              std::vector<c10::optional<at::Tensor>> k_norms, std::vector<int64_t> windows,
              int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t hidden_size,
              int64_t intermediate_size, double eps, double scale);

  // Every layer over one step's rows (see decoder_layers.cpp). x: the first layer's normed
  // input [T, hidden]; residual: the embedding rows. Returns (last mlp output, residual).
  std::tuple<at::Tensor, at::Tensor> forward(
      at::Tensor x, at::Tensor residual, at::Tensor cos, at::Tensor sin,
      const std::vector<at::Tensor>& kv_caches, at::Tensor slot_mapping, int64_t num_decode,
      c10::optional<at::Tensor> decode_tables, c10::optional<at::Tensor> decode_lens,
      c10::optional<at::Tensor> query_start, c10::optional<at::Tensor> query_len,
      c10::optional<at::Tensor> context_len, c10::optional<at::Tensor> block_tables) const;

  int64_t num_layers() const { return static_cast<int64_t>(input_norms_.size()); }

 private:
  std::vector<at::Tensor> input_norms_, post_norms_, qkv_, o_, gate_up_, down_;
  std::vector<c10::optional<at::Tensor>> qkv_bias_, o_bias_, gate_up_bias_, down_bias_;
  std::vector<c10::optional<at::Tensor>> q_norms_, k_norms_;
  std::vector<int64_t> windows_;
  int64_t num_heads_, num_kv_heads_, head_dim_, hidden_size_, intermediate_size_;
  double eps_, scale_;
};

// Gemma 3's layers (engine/models/gemma3.py's Gemma3DecoderLayer) in one call per forward:
// the attention of LlamaLayers, with Gemma's four norms a layer and its q/k norms
// (gemma_rms_norm: x * (1 + w) in float32), a GeGLU MLP (gelu, tanh approximation) and, on a
// sliding-window layer, the local RoPE table.
class GemmaLayers {
 public:
  // One entry per layer in each list (biases and windows as LlamaLayers'); local_rope: the
  // layer rotates by the local table (its sliding-window layers).
  GemmaLayers(std::vector<at::Tensor> input_norms, std::vector<at::Tensor> post_attention_norms,
              std::vector<at::Tensor> pre_feedforward_norms,
              std::vector<at::Tensor> post_feedforward_norms, std::vector<at::Tensor> qkv,
              std::vector<at::Tensor> o, std::vector<at::Tensor> gate_up,
              std::vector<at::Tensor> down, std::vector<c10::optional<at::Tensor>> qkv_bias,
              std::vector<c10::optional<at::Tensor>> o_bias,
              std::vector<c10::optional<at::Tensor>> gate_up_bias,
              std::vector<c10::optional<at::Tensor>> down_bias, std::vector<at::Tensor> q_norms,
              std::vector<at::Tensor> k_norms, std::vector<int64_t> windows,
              std::vector<bool> local_rope, int64_t num_heads, int64_t num_kv_heads,
              int64_t head_dim, int64_t hidden_size, int64_t intermediate_size, double eps,
              double scale);

  // As LlamaLayers::forward, with the local RoPE table beside the global one. Returns (the
  // last layer's normed MLP output, residual).
  std::tuple<at::Tensor, at::Tensor> forward(
      at::Tensor x, at::Tensor residual, at::Tensor cos, at::Tensor sin, at::Tensor local_cos,
      at::Tensor local_sin, const std::vector<at::Tensor>& kv_caches, at::Tensor slot_mapping,
      int64_t num_decode, c10::optional<at::Tensor> decode_tables,
      c10::optional<at::Tensor> decode_lens, c10::optional<at::Tensor> query_start,
      c10::optional<at::Tensor> query_len, c10::optional<at::Tensor> context_len,
      c10::optional<at::Tensor> block_tables) const;

  int64_t num_layers() const { return static_cast<int64_t>(input_norms_.size()); }

 private:
  std::vector<at::Tensor> input_norms_, post_attention_norms_, pre_feedforward_norms_,
      post_feedforward_norms_, qkv_, o_, gate_up_, down_, q_norms_, k_norms_;
  std::vector<c10::optional<at::Tensor>> qkv_bias_, o_bias_, gate_up_bias_, down_bias_;
  std::vector<int64_t> windows_;
  std::vector<bool> local_rope_;
  int64_t num_heads_, num_kv_heads_, head_dim_, hidden_size_, intermediate_size_;
  double eps_, scale_;
};

}  // namespace pdserve_cpu
