// Every layer of a Llama-family decoder in one call: the same kernels, in the same order and on
// the same views as engine/models/llama.py's DecoderLayer.forward (so the results are
// bit-identical to it), without the Python between them.
//
// A decode step of SmolLM2-135M (30 layers) made ~25 Python-level calls a layer (modules,
// views, splits, the attention backend) around ~9 kernel calls; in one call per forward its
// bf16 decode steps took 1.8-2.1 ms less on a 2-core AMD Zen 4 (1 row 12.3 -> 10.5 ms, 8 rows
// 20.1 -> 18.0). Here a layer is
//
//   x, residual = add_rms_norm(x, residual)           (the first layer's norm: the caller's)
//   q, k, v     = views of linear(x, qkv)              (q/k norms: new q, k) rotary in place
//   store_kv(k, v)                                     decode rows: paged decode attention
//   prefill rows (one call for every prompt chunk): paged prefill attention
//   x, residual = add_rms_norm(linear(attn, o), residual)
//   x           = linear(silu_and_mul(linear(x, gate_up)), down)
//
// Padding rows (the runner pads a step's rows for the products) write no K/V and attend to
// nothing: their attention output is zero, as paged_attention leaves it.
//
// Gemma 3's layers (GemmaLayers, below) share the attention (attend) and differ around it:
// four norms a layer and the q/k norms (gemma_rms_norm, gemma_add_rms_norm), GeGLU
// (gelu_tanh_and_mul), a local RoPE table on sliding layers.
#include "decoder_layers.h"

#include <ATen/ops/add.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mean.h>
#include <ATen/ops/mul.h>
#include <ATen/ops/pow.h>
#include <ATen/ops/rsqrt.h>

#include "kernels.h"

#include <utility>

namespace pdserve_cpu {

namespace {

// RMSNorm over the last dim by the torch ops engine/models/llama.py's RMSNorm.forward runs (the
// per-head q/k norms of Qwen3), so the result is the same to the bit: float32 statistics,
// scaled in x's dtype.
at::Tensor torch_rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  at::Tensor xf = x.to(at::kFloat);
  xf = at::mul(xf, at::rsqrt(at::add(at::mean(at::pow(xf, 2), {-1}, true), eps)));
  return at::mul(weight, xf.to(x.scalar_type()));
}

// What a step's rows need from the caller for attention (checked once per forward).
struct StepRows {
  int64_t rows, tokens, num_decode;
  const c10::optional<at::Tensor>& decode_tables;
  const c10::optional<at::Tensor>& decode_lens;
  const c10::optional<at::Tensor>& query_start;
  const c10::optional<at::Tensor>& query_len;
  const c10::optional<at::Tensor>& context_len;
  const c10::optional<at::Tensor>& block_tables;
  const at::Tensor& slot_mapping;
};

StepRows check_step(const at::Tensor& x, const at::Tensor& residual, int64_t hidden_size,
                    int64_t layers, const std::vector<at::Tensor>& kv_caches,
                    const at::Tensor& slot_mapping, int64_t num_decode,
                    const c10::optional<at::Tensor>& decode_tables,
                    const c10::optional<at::Tensor>& decode_lens,
                    const c10::optional<at::Tensor>& query_start,
                    const c10::optional<at::Tensor>& query_len,
                    const c10::optional<at::Tensor>& context_len,
                    const c10::optional<at::Tensor>& block_tables) {
  TORCH_CHECK(static_cast<int64_t>(kv_caches.size()) == layers, "one KV cache per layer");
  TORCH_CHECK(x.dim() == 2 && x.size(1) == hidden_size && residual.sizes() == x.sizes(),
              "x and residual must be [rows, hidden]");
  const int64_t rows = x.size(0), tokens = slot_mapping.size(0);
  TORCH_CHECK(tokens <= rows && num_decode >= 0 && num_decode <= tokens,
              "slot_mapping and num_decode must fit the rows");
  TORCH_CHECK(num_decode == 0 || (decode_tables.has_value() && decode_lens.has_value()),
              "decode rows need their block tables and lengths");
  TORCH_CHECK(!query_start.has_value() || (query_len.has_value() && context_len.has_value() &&
                                           block_tables.has_value()),
              "prefill rows need query_start, query_len, context_len and block_tables");
  return {rows,        tokens,    num_decode,  decode_tables, decode_lens,
          query_start, query_len, context_len, block_tables,  slot_mapping};
}

// Rotary in place, the new K/V into the cache, then attention over the paged cache as
// CpuAttention runs it (decode rows by the decode kernel, prompt chunks by one prefill call);
// padding rows attend to nothing (zero). Returns the attention output [rows, heads * dim].
at::Tensor attend(const StepRows& step, at::Tensor& q, at::Tensor& k, const at::Tensor& v,
                  const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& cache,
                  double scale, int64_t window) {
  rotary_embedding(q, k, cos, sin);
  const int64_t rows = step.rows, tokens = step.tokens, num_decode = step.num_decode;
  store_kv(k.narrow(0, 0, tokens), v.narrow(0, 0, tokens), cache, step.slot_mapping);
  at::Tensor out = at::empty({rows, q.size(1), q.size(2)}, q.options());
  if (rows > tokens) out.narrow(0, tokens, rows - tokens).zero_();
  if (num_decode > 0) {
    paged_decode_attention_out(q.narrow(0, 0, num_decode), cache, *step.decode_tables,
                               *step.decode_lens, scale, out.narrow(0, 0, num_decode), window);
  }
  if (step.query_start.has_value()) {
    paged_prefill_attention_out(q, cache, *step.query_start, *step.query_len, *step.context_len,
                                *step.block_tables, scale, out, window);
  }
  return out.view({rows, q.size(1) * q.size(2)});
}

}  // namespace

LlamaLayers::LlamaLayers(std::vector<at::Tensor> input_norms, std::vector<at::Tensor> post_norms,
                         std::vector<at::Tensor> qkv, std::vector<at::Tensor> o,
                         std::vector<at::Tensor> gate_up, std::vector<at::Tensor> down,
                         std::vector<c10::optional<at::Tensor>> qkv_bias,
                         std::vector<c10::optional<at::Tensor>> o_bias,
                         std::vector<c10::optional<at::Tensor>> gate_up_bias,
                         std::vector<c10::optional<at::Tensor>> down_bias,
                         std::vector<c10::optional<at::Tensor>> q_norms,
                         std::vector<c10::optional<at::Tensor>> k_norms,
                         std::vector<int64_t> windows, int64_t num_heads, int64_t num_kv_heads,
                         int64_t head_dim, int64_t hidden_size, int64_t intermediate_size,
                         double eps, double scale)
    : input_norms_(std::move(input_norms)),
      post_norms_(std::move(post_norms)),
      qkv_(std::move(qkv)),
      o_(std::move(o)),
      gate_up_(std::move(gate_up)),
      down_(std::move(down)),
      qkv_bias_(std::move(qkv_bias)),
      o_bias_(std::move(o_bias)),
      gate_up_bias_(std::move(gate_up_bias)),
      down_bias_(std::move(down_bias)),
      q_norms_(std::move(q_norms)),
      k_norms_(std::move(k_norms)),
      windows_(std::move(windows)),
      num_heads_(num_heads),
      num_kv_heads_(num_kv_heads),
      head_dim_(head_dim),
      hidden_size_(hidden_size),
      intermediate_size_(intermediate_size),
      eps_(eps),
      scale_(scale) {
  const size_t n = input_norms_.size();
  TORCH_CHECK(n > 0, "LlamaLayers needs at least one layer");
  TORCH_CHECK(post_norms_.size() == n && qkv_.size() == n && o_.size() == n &&
                  gate_up_.size() == n && down_.size() == n && qkv_bias_.size() == n &&
                  o_bias_.size() == n && gate_up_bias_.size() == n && down_bias_.size() == n &&
                  q_norms_.size() == n && k_norms_.size() == n && windows_.size() == n,
              "LlamaLayers: every list needs one entry per layer");
  TORCH_CHECK(num_heads > 0 && num_kv_heads > 0 && num_heads % num_kv_heads == 0 && head_dim > 0,
              "LlamaLayers: bad head counts");
}

std::tuple<at::Tensor, at::Tensor> LlamaLayers::forward(
    at::Tensor x, at::Tensor residual, at::Tensor cos, at::Tensor sin,
    const std::vector<at::Tensor>& kv_caches, at::Tensor slot_mapping, int64_t num_decode,
    c10::optional<at::Tensor> decode_tables, c10::optional<at::Tensor> decode_lens,
    c10::optional<at::Tensor> query_start, c10::optional<at::Tensor> query_len,
    c10::optional<at::Tensor> context_len, c10::optional<at::Tensor> block_tables) const {
  const int64_t layers = num_layers();
  const StepRows step =
      check_step(x, residual, hidden_size_, layers, kv_caches, slot_mapping, num_decode,
                 decode_tables, decode_lens, query_start, query_len, context_len, block_tables);
  const int64_t rows = step.rows;
  const int64_t q_size = num_heads_ * head_dim_, kv_size = num_kv_heads_ * head_dim_;
  for (int64_t i = 0; i < layers; ++i) {
    if (i > 0) fused_add_rms_norm(x, residual, input_norms_[i], eps_);
    at::Tensor qkv = linear_small_m(x, qkv_[i], q_size + 2 * kv_size, qkv_bias_[i]);
    at::Tensor q = qkv.narrow(1, 0, q_size).view({rows, num_heads_, head_dim_});
    at::Tensor k = qkv.narrow(1, q_size, kv_size).view({rows, num_kv_heads_, head_dim_});
    at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({rows, num_kv_heads_, head_dim_});
    if (q_norms_[i].has_value() && k_norms_[i].has_value()) {
      q = torch_rms_norm(q, *q_norms_[i], eps_);
      k = torch_rms_norm(k, *k_norms_[i], eps_);
    }
    at::Tensor out = attend(step, q, k, v, cos, sin, kv_caches[i], scale_, windows_[i]);
    at::Tensor attn = linear_small_m(out, o_[i], hidden_size_, o_bias_[i]);
    fused_add_rms_norm(attn, residual, post_norms_[i], eps_);
    at::Tensor gate_up = linear_small_m(attn, gate_up_[i], 2 * intermediate_size_, gate_up_bias_[i]);
    x = linear_small_m(silu_and_mul(gate_up), down_[i], hidden_size_, down_bias_[i]);
  }
  return {x, residual};
}

GemmaLayers::GemmaLayers(
    std::vector<at::Tensor> input_norms, std::vector<at::Tensor> post_attention_norms,
    std::vector<at::Tensor> pre_feedforward_norms, std::vector<at::Tensor> post_feedforward_norms,
    std::vector<at::Tensor> qkv, std::vector<at::Tensor> o, std::vector<at::Tensor> gate_up,
    std::vector<at::Tensor> down, std::vector<c10::optional<at::Tensor>> qkv_bias,
    std::vector<c10::optional<at::Tensor>> o_bias,
    std::vector<c10::optional<at::Tensor>> gate_up_bias,
    std::vector<c10::optional<at::Tensor>> down_bias, std::vector<at::Tensor> q_norms,
    std::vector<at::Tensor> k_norms, std::vector<int64_t> windows, std::vector<bool> local_rope,
    int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t hidden_size,
    int64_t intermediate_size, double eps, double scale)
    : input_norms_(std::move(input_norms)),
      post_attention_norms_(std::move(post_attention_norms)),
      pre_feedforward_norms_(std::move(pre_feedforward_norms)),
      post_feedforward_norms_(std::move(post_feedforward_norms)),
      qkv_(std::move(qkv)),
      o_(std::move(o)),
      gate_up_(std::move(gate_up)),
      down_(std::move(down)),
      q_norms_(std::move(q_norms)),
      k_norms_(std::move(k_norms)),
      qkv_bias_(std::move(qkv_bias)),
      o_bias_(std::move(o_bias)),
      gate_up_bias_(std::move(gate_up_bias)),
      down_bias_(std::move(down_bias)),
      windows_(std::move(windows)),
      local_rope_(std::move(local_rope)),
      num_heads_(num_heads),
      num_kv_heads_(num_kv_heads),
      head_dim_(head_dim),
      hidden_size_(hidden_size),
      intermediate_size_(intermediate_size),
      eps_(eps),
      scale_(scale) {
  const size_t n = input_norms_.size();
  TORCH_CHECK(n > 0, "GemmaLayers needs at least one layer");
  for (const size_t size :
       {post_attention_norms_.size(), pre_feedforward_norms_.size(),
        post_feedforward_norms_.size(), qkv_.size(), o_.size(), gate_up_.size(), down_.size(),
        q_norms_.size(), k_norms_.size(), qkv_bias_.size(), o_bias_.size(), gate_up_bias_.size(),
        down_bias_.size(), windows_.size(), local_rope_.size()})
    TORCH_CHECK(size == n, "GemmaLayers: every list needs one entry per layer");
  TORCH_CHECK(num_heads > 0 && num_kv_heads > 0 && num_heads % num_kv_heads == 0 && head_dim > 0,
              "GemmaLayers: bad head counts");
}

// A layer, as Gemma3DecoderLayer.forward on the fused kernels (the first layer's input norm is
// the caller's):
//   residual += x; x = norm(residual)
//   q, k, v = views of linear(x, qkv); q, k = q_norm(q), k_norm(k); attention (attend)
//   x = post_attention_norm(linear(attn, o)); residual += x; x = pre_feedforward_norm(residual)
//   gate, up = views of linear(x, gate_up)
//   x = post_feedforward_norm(linear(gelu_tanh(gate) * up, down))
std::tuple<at::Tensor, at::Tensor> GemmaLayers::forward(
    at::Tensor x, at::Tensor residual, at::Tensor cos, at::Tensor sin, at::Tensor local_cos,
    at::Tensor local_sin, const std::vector<at::Tensor>& kv_caches, at::Tensor slot_mapping,
    int64_t num_decode, c10::optional<at::Tensor> decode_tables,
    c10::optional<at::Tensor> decode_lens, c10::optional<at::Tensor> query_start,
    c10::optional<at::Tensor> query_len, c10::optional<at::Tensor> context_len,
    c10::optional<at::Tensor> block_tables) const {
  const int64_t layers = num_layers();
  const StepRows step =
      check_step(x, residual, hidden_size_, layers, kv_caches, slot_mapping, num_decode,
                 decode_tables, decode_lens, query_start, query_len, context_len, block_tables);
  const int64_t rows = step.rows;
  const int64_t q_size = num_heads_ * head_dim_, kv_size = num_kv_heads_ * head_dim_;
  const int64_t inter = intermediate_size_;
  for (int64_t i = 0; i < layers; ++i) {
    if (i > 0) gemma_add_rms_norm(x, residual, input_norms_[i], eps_);
    at::Tensor qkv = linear_small_m(x, qkv_[i], q_size + 2 * kv_size, qkv_bias_[i]);
    at::Tensor q = qkv.narrow(1, 0, q_size).view({rows, num_heads_, head_dim_});
    at::Tensor k = qkv.narrow(1, q_size, kv_size).view({rows, num_kv_heads_, head_dim_});
    at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({rows, num_kv_heads_, head_dim_});
    q = gemma_rms_norm(q, q_norms_[i], eps_);
    k = gemma_rms_norm(k, k_norms_[i], eps_);
    const bool local = local_rope_[i];
    at::Tensor out = attend(step, q, k, v, local ? local_cos : cos, local ? local_sin : sin,
                            kv_caches[i], scale_, windows_[i]);
    at::Tensor attn = linear_small_m(out, o_[i], hidden_size_, o_bias_[i]);
    x = gemma_rms_norm(attn, post_attention_norms_[i], eps_);
    gemma_add_rms_norm(x, residual, pre_feedforward_norms_[i], eps_);
    at::Tensor gate_up = linear_small_m(x, gate_up_[i], 2 * inter, gate_up_bias_[i]);
    x = gemma_rms_norm(linear_small_m(gelu_tanh_and_mul(gate_up), down_[i], hidden_size_,
                                      down_bias_[i]),
                       post_feedforward_norms_[i], eps_);
  }
  return {x, residual};
}

}  // namespace pdserve_cpu
