// The kernels' entry points (each defined in the file named above it), as the Python module
// (bindings.cpp) and the layer loop (decoder_layers.cpp) call them.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>

#include <cstdint>

// paged_attention.cpp
at::Tensor paged_decode_attention(at::Tensor q, at::Tensor cache, at::Tensor tables,
                                  at::Tensor seq_lens, double scale, int64_t window);
void paged_decode_attention_out(at::Tensor q, at::Tensor cache, at::Tensor tables,
                                at::Tensor seq_lens, double scale, at::Tensor out,
                                int64_t window);
void store_kv(at::Tensor k, at::Tensor v, at::Tensor cache, at::Tensor slots);
// fused_ops.cpp
at::Tensor rms_norm(at::Tensor x, at::Tensor weight, double eps);
void fused_add_rms_norm(at::Tensor x, at::Tensor residual, at::Tensor weight, double eps);
void rotary_embedding(at::Tensor q, at::Tensor k, at::Tensor cos, at::Tensor sin);
at::Tensor silu_and_mul(at::Tensor x);
at::Tensor gemma_rms_norm(at::Tensor x, at::Tensor weight, double eps);
void gemma_add_rms_norm(at::Tensor x, at::Tensor residual, at::Tensor weight, double eps);
at::Tensor gelu_tanh_and_mul(at::Tensor x);
bool fused_ops_vectorized();
// sampling_ops.cpp
at::Tensor argmax_rows(at::Tensor x);
// prefill_attention.cpp
void paged_prefill_attention_out(at::Tensor q, at::Tensor cache, at::Tensor query_start,
                                 at::Tensor query_len, at::Tensor context_len,
                                 at::Tensor block_tables, double scale, at::Tensor out,
                                 int64_t window);
// linear.cpp
bool linear_small_m_available();
bool linear_small_m_all_rows();
at::Tensor pack_linear_weight(at::Tensor w);
at::Tensor linear_small_m(at::Tensor x, at::Tensor packed, int64_t n,
                          c10::optional<at::Tensor> bias);
