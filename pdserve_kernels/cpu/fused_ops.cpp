// Fused elementwise layers for the CPU forward pass: each reads and writes its tensors once
// instead of once per torch op (RMSNorm alone is seven ops in torch, each a pass over memory).
//
// Rounding follows the torch code they replace (engine/models/llama.py), so bf16 results stay
// bit-identical wherever the float arithmetic is: values are computed in float32 and rounded
// to the tensor dtype exactly where torch rounds them (after each bf16 op).
//
//   rms_norm(x [T, H], w [H], eps) -> w * to_dtype(x * rsqrt(mean(x^2) + eps))
//   fused_add_rms_norm(x, residual, w, eps): residual = residual + x; x = rms_norm(residual)
//   rotary_embedding(q [T, Hq, D], k [T, Hkv, D], cos [T, D/2], sin [T, D/2]): in place,
//       rotate-half convention (Llama / Qwen / Mistral checkpoints)
//   silu_and_mul(x [T, 2I]) -> silu(x[:, :I]) * x[:, I:]
//
// Gemma 3's (engine/models/gemma3.py), in its rounding: the norm's scale applied in float32
// and rounded once; gelu rounded before it multiplies up, as torch's two ops round.
//   gemma_rms_norm(x [..., H], w [H], eps) -> to_dtype((x * rsqrt(mean(x^2) + eps)) * (1 + w))
//       (x's rows may be strided views: a q or k head of the fused qkv output)
//   gemma_add_rms_norm(x, residual, w, eps): residual = residual + x; x = gemma_rms_norm(residual)
//   gelu_tanh_and_mul(x [T, 2I]) -> gelu_tanh(x[:, :I]) * x[:, I:]
#include <ATen/Parallel.h>
// The ATen headers only (not <torch/extension.h>, which paged_attention.cpp's bindings need):
// ~4 s of headers a file instead of ~27.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>

#include "thread_pool.h"
#include "vec.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

using namespace pdserve_cpu;
using BF16 = c10::BFloat16;
// The value torch would hold after storing x in dtype T (round to nearest even for bf16).
template <typename T>
inline float round_to(float x) {
  if constexpr (std::is_same_v<T, float>) {
    return x;
  } else {
    return to_float(static_cast<BF16>(x));
  }
}

#if defined(__AVX512F__)
constexpr bool kVector = true;

// fp32 -> bf16 bits, round to nearest even (NaN is not expected in activations).
inline __m256i to_bf16_bits(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), lsb);
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16));
}
inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
inline void store16(BF16* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), to_bf16_bits(v));
}
// The vector rounded as a bf16 store would round it.
template <typename T>
inline __m512 round16(__m512 v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(to_bf16_bits(v)), 16));
  }
}
#else
constexpr bool kVector = false;
#endif

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
constexpr bool kSiluVector = true;  // silu_and_mul has a vector loop (AVX-512 or AVX2)
#else
constexpr bool kSiluVector = false;
#endif

// Rows per parallel task: enough work that waking the second thread pays off.
inline int64_t grain_rows(int64_t row_elems) { return std::max<int64_t>(1, 32768 / row_elems); }

// ---------------------------------------------------------------- RMSNorm

// 1 / sqrt(mean(x^2) + eps) of a row, the sum of squares in float32.
template <typename T>
float inv_rms(const T* x, int64_t h, float eps) {
  int64_t i = 0;
  float ss = 0.f;
#if defined(__AVX512F__)
  __m512 acc = _mm512_setzero_ps();
  for (; i + 16 <= h; i += 16) {
    const __m512 v = load16(x + i);
    acc = _mm512_fmadd_ps(v, v, acc);
  }
  ss = _mm512_reduce_add_ps(acc);
#endif
  for (; i < h; ++i) ss += to_float(x[i]) * to_float(x[i]);
  return 1.f / std::sqrt(ss / static_cast<float>(h) + eps);
}

template <typename T>
void rms_norm_row(const T* x, const T* w, T* out, int64_t h, float eps) {
  const float r = inv_rms(x, h, eps);
  int64_t i = 0;
#if defined(__AVX512F__)
  const __m512 rv = _mm512_set1_ps(r);
  for (; i + 16 <= h; i += 16)
    store16(out + i, _mm512_mul_ps(load16(w + i), round16<T>(_mm512_mul_ps(load16(x + i), rv))));
#endif
  for (; i < h; ++i) out[i] = static_cast<T>(to_float(w[i]) * round_to<T>(to_float(x[i]) * r));
}

template <typename T>
void rms_norm_impl(const at::Tensor& x, const at::Tensor& w, at::Tensor& out, double eps) {
  const int64_t h = x.size(-1), rows = x.numel() / h;
  const T* xp = x.data_ptr<T>();
  const T* wp = w.data_ptr<T>();
  T* op = out.data_ptr<T>();
  parallel_for(0, rows, grain_rows(h), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      rms_norm_row<T>(xp + t * h, wp, op + t * h, h, static_cast<float>(eps));
  });
}

// residual = residual + x (rounded to T); x = norm_row(residual) (rms_norm_row, or Gemma's)
template <typename T, void (*norm_row)(const T*, const T*, T*, int64_t, float)>
void add_then_norm_impl(at::Tensor& x, at::Tensor& residual, const at::Tensor& w, double eps) {
  const int64_t h = x.size(-1), rows = x.numel() / h;
  T* xp = x.data_ptr<T>();
  T* rp = residual.data_ptr<T>();
  const T* wp = w.data_ptr<T>();
  parallel_for(0, rows, grain_rows(h), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      T* xr = xp + t * h;
      T* rr = rp + t * h;
      int64_t i = 0;
#if defined(__AVX512F__)
      for (; i + 16 <= h; i += 16) store16(rr + i, _mm512_add_ps(load16(rr + i), load16(xr + i)));
#endif
      for (; i < h; ++i) rr[i] = static_cast<T>(to_float(rr[i]) + to_float(xr[i]));
      norm_row(rr, wp, xr, h, static_cast<float>(eps));
    }
  });
}

// ---------------------------------------------------------------- RoPE

// x [T, H, D] with any token / head strides and a contiguous last dim, rotated in place.
template <typename T>
void rope_impl(at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  const int64_t tokens = x.size(0), heads = x.size(1), half = x.size(2) / 2;
  const int64_t ts = x.stride(0), hs = x.stride(1);
  T* xp = x.data_ptr<T>();
  const T* cp = cos.data_ptr<T>();
  const T* sp = sin.data_ptr<T>();
  parallel_for(0, tokens, grain_rows(heads * half * 2), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* c = cp + t * half;
      const T* s = sp + t * half;
      for (int64_t hd = 0; hd < heads; ++hd) {
        T* x1 = xp + t * ts + hd * hs;
        T* x2 = x1 + half;
        int64_t i = 0;
#if defined(__AVX512F__)
        for (; i + 16 <= half; i += 16) {
          const __m512 a = load16(x1 + i), b = load16(x2 + i);
          const __m512 cv = load16(c + i), sv = load16(s + i);
          // torch rounds each product, then the sum (bf16); no fused multiply-add here.
          const __m512 o1 = _mm512_sub_ps(round16<T>(_mm512_mul_ps(a, cv)),
                                          round16<T>(_mm512_mul_ps(b, sv)));
          const __m512 o2 = _mm512_add_ps(round16<T>(_mm512_mul_ps(b, cv)),
                                          round16<T>(_mm512_mul_ps(a, sv)));
          store16(x1 + i, o1);
          store16(x2 + i, o2);
        }
#endif
        for (; i < half; ++i) {
          const float a = to_float(x1[i]), b = to_float(x2[i]);
          const float cv = to_float(c[i]), sv = to_float(s[i]);
          const float p1 = round_to<T>(a * cv), p2 = round_to<T>(b * sv);
          const float p3 = round_to<T>(b * cv), p4 = round_to<T>(a * sv);
          x1[i] = static_cast<T>(p1 - p2);
          x2[i] = static_cast<T>(p3 + p4);
        }
      }
    }
  });
}

// ---------------------------------------------------------------- SiLU * up

template <typename T>
void silu_and_mul_impl(const at::Tensor& x, at::Tensor& out) {
  const int64_t d = out.size(-1), rows = out.numel() / d;
  const T* xp = x.data_ptr<T>();
  T* op = out.data_ptr<T>();
  // With the vector loop a row of SmolLM2's MLP (d 1536) takes ~1 us, so decode-sized calls
  // stay on the calling thread: waking the second one cost more than the work (AMD Zen 3, 8
  // rows: 36 us on two threads with idle workers asleep vs 24 us on one before the AVX2 loop).
  const int64_t grain = kSiluVector ? std::max<int64_t>(1, 65536 / d) : grain_rows(3 * d);
  parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* gate = xp + t * 2 * d;
      const T* up = gate + d;
      T* o = op + t * d;
      int64_t i = 0;
#if defined(__AVX512F__)
      const __m512 one = _mm512_set1_ps(1.f);
      for (; i + 16 <= d; i += 16) {
        const __m512 g = load16(gate + i);
        const __m512 silu = _mm512_div_ps(g, _mm512_add_ps(one, exp16(_mm512_sub_ps(_mm512_setzero_ps(), g))));
        store16(o + i, _mm512_mul_ps(round16<T>(silu), load16(up + i)));
      }
#elif defined(__AVX2__) && defined(__FMA__)
      // exp8 clamps its argument to 88.3, so 1 + e^-g stays finite for any gate (silu -> -0).
      const __m256 one = _mm256_set1_ps(1.f);
      for (; i + 8 <= d; i += 8) {
        const __m256 g = widen8(gate + i);
        const __m256 silu = _mm256_div_ps(g, _mm256_add_ps(one, exp8(_mm256_sub_ps(_mm256_setzero_ps(), g))));
        store8(o + i, _mm256_mul_ps(round8<T>(silu), widen8(up + i)), 8);
      }
#endif
      for (; i < d; ++i) {
        const float g = to_float(gate[i]);
        // exp's argument capped (as exp16 does): under -ffast-math the division is a
        // reciprocal estimate refined by Newton's step, which turns 1 / inf into NaN (seen on
        // AVX2 machines, where this loop is the only one, with a gate below -88).
        o[i] = static_cast<T>(round_to<T>(g / (1.f + std::exp(std::min(-g, 88.f)))) *
                              to_float(up[i]));
      }
    }
  });
}

// ---------------------------------------------------------------- Gemma 3

template <typename T>
void gemma_rms_norm_row(const T* x, const T* w, T* out, int64_t h, float eps) {
  const float r = inv_rms(x, h, eps);
  int64_t i = 0;
#if defined(__AVX512F__)
  const __m512 rv = _mm512_set1_ps(r), one = _mm512_set1_ps(1.f);
  for (; i + 16 <= h; i += 16)
    store16(out + i, _mm512_mul_ps(_mm512_mul_ps(load16(x + i), rv),
                                   _mm512_add_ps(load16(w + i), one)));
#endif
  for (; i < h; ++i) out[i] = static_cast<T>((to_float(x[i]) * r) * (to_float(w[i]) + 1.f));
}

// x [A, H] or [A, B, H], any strides but a contiguous last dim; out contiguous, x's shape.
template <typename T>
void gemma_rms_norm_impl(const at::Tensor& x, const at::Tensor& w, at::Tensor& out, double eps) {
  const int64_t h = x.size(-1), rows = x.numel() / h;
  const int64_t inner = x.dim() == 3 ? x.size(1) : 1;
  const int64_t outer_stride = x.stride(0), inner_stride = x.dim() == 3 ? x.stride(1) : 0;
  const T* xp = x.data_ptr<T>();
  const T* wp = w.data_ptr<T>();
  T* op = out.data_ptr<T>();
  parallel_for(0, rows, grain_rows(h), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* row = xp + (r / inner) * outer_stride + (r % inner) * inner_stride;
      gemma_rms_norm_row<T>(row, wp, op + r * h, h, static_cast<float>(eps));
    }
  });
}

// gelu, tanh approximation: 0.5 g (1 + tanh(y)), y = sqrt(2 / pi) (g + 0.044715 g^3), taken as
// g / (1 + e^-2y) (the same value: 1 + tanh(y) = 2 sigmoid(2y)), which keeps its precision
// where 1 + tanh(y) cancels (g below ~-3: there 1 - 2 / (e^2y + 1) flipped ~5% of bf16 results
// against torch's); exp16 clamps e^-2y, so a very negative gate gives -0, not NaN.
constexpr float kGeluBeta = 0.7978845608028654f, kGeluKappa = 0.044715f;

template <typename T>
void gelu_tanh_and_mul_impl(const at::Tensor& x, at::Tensor& out) {
  const int64_t d = out.size(-1), rows = out.numel() / d;
  const T* xp = x.data_ptr<T>();
  T* op = out.data_ptr<T>();
  parallel_for(0, rows, std::max<int64_t>(1, 65536 / d), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* gate = xp + t * 2 * d;
      const T* up = gate + d;
      T* o = op + t * d;
      int64_t i = 0;
#if defined(__AVX512F__)
      const __m512 one = _mm512_set1_ps(1.f), minus_two_beta = _mm512_set1_ps(-2.f * kGeluBeta),
                   kappa = _mm512_set1_ps(kGeluKappa);
      for (; i + 16 <= d; i += 16) {
        const __m512 g = load16(gate + i);
        const __m512 cube = _mm512_mul_ps(_mm512_mul_ps(g, g), g);
        const __m512 inner = _mm512_add_ps(g, _mm512_mul_ps(kappa, cube));
        const __m512 e = exp16(_mm512_mul_ps(minus_two_beta, inner));
        const __m512 gelu = _mm512_div_ps(g, _mm512_add_ps(one, e));
        store16(o + i, _mm512_mul_ps(round16<T>(gelu), load16(up + i)));
      }
#endif
      for (; i < d; ++i) {
        const float g = to_float(gate[i]);
        const float e = std::exp(std::min(-2.f * kGeluBeta * (g + kGeluKappa * g * g * g), 88.f));
        const float gelu = g / (1.f + e);
        o[i] = static_cast<T>(round_to<T>(gelu) * to_float(up[i]));
      }
    }
  });
}

void check_cpu(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor");
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16, name,
              " must be float32 or bfloat16");
}

}  // namespace

at::Tensor rms_norm(at::Tensor x, at::Tensor weight, double eps) {
  check_cpu(x, "x");
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous(), "rms_norm needs contiguous inputs");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type() && weight.numel() == x.size(-1),
              "weight must be [hidden] in x's dtype");
  auto out = at::empty_like(x);
  if (x.scalar_type() == at::kFloat) rms_norm_impl<float>(x, weight, out, eps);
  else rms_norm_impl<BF16>(x, weight, out, eps);
  return out;
}

// The arguments of an in-place residual add + norm (fused_add_rms_norm, gemma_add_rms_norm).
static void check_add_norm_args(const at::Tensor& x, const at::Tensor& residual,
                                const at::Tensor& weight, const char* name) {
  check_cpu(x, "x");
  TORCH_CHECK(x.is_contiguous() && residual.is_contiguous() && weight.is_contiguous(), name,
              " needs contiguous inputs");
  TORCH_CHECK(residual.sizes() == x.sizes() && residual.scalar_type() == x.scalar_type(),
              "residual must match x");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type() && weight.numel() == x.size(-1),
              "weight must be [hidden] in x's dtype");
}

void fused_add_rms_norm(at::Tensor x, at::Tensor residual, at::Tensor weight, double eps) {
  check_add_norm_args(x, residual, weight, "fused_add_rms_norm");
  if (x.scalar_type() == at::kFloat)
    add_then_norm_impl<float, rms_norm_row<float>>(x, residual, weight, eps);
  else add_then_norm_impl<BF16, rms_norm_row<BF16>>(x, residual, weight, eps);
}

void rotary_embedding(at::Tensor q, at::Tensor k, at::Tensor cos, at::Tensor sin) {
  check_cpu(q, "q");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && q.stride(2) == 1 && k.stride(2) == 1,
              "q and k must be [tokens, heads, head_dim] with a contiguous last dim");
  TORCH_CHECK(q.size(2) % 2 == 0 && k.size(2) == q.size(2), "head_dim must be even and shared");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.size(0) == q.size(0) &&
                  cos.size(1) == q.size(2) / 2 && sin.sizes() == cos.sizes(),
              "cos / sin must be [tokens, head_dim / 2]");
  TORCH_CHECK(k.scalar_type() == q.scalar_type() && cos.scalar_type() == q.scalar_type() &&
                  sin.scalar_type() == q.scalar_type(),
              "q, k, cos and sin must share a dtype");
  if (q.scalar_type() == at::kFloat) {
    rope_impl<float>(q, cos, sin);
    rope_impl<float>(k, cos, sin);
  } else {
    rope_impl<BF16>(q, cos, sin);
    rope_impl<BF16>(k, cos, sin);
  }
}

at::Tensor silu_and_mul(at::Tensor x) {
  check_cpu(x, "x");
  TORCH_CHECK(x.is_contiguous() && x.size(-1) % 2 == 0, "x must be contiguous [..., 2 * d]");
  auto sizes = x.sizes().vec();
  sizes.back() /= 2;
  auto out = at::empty(sizes, x.options());
  if (x.scalar_type() == at::kFloat) silu_and_mul_impl<float>(x, out);
  else silu_and_mul_impl<BF16>(x, out);
  return out;
}

at::Tensor gemma_rms_norm(at::Tensor x, at::Tensor weight, double eps) {
  check_cpu(x, "x");
  TORCH_CHECK((x.dim() == 2 || x.dim() == 3) && x.stride(-1) == 1,
              "gemma_rms_norm: x must be [rows, hidden] or [rows, heads, dim], unit last stride");
  TORCH_CHECK(weight.is_contiguous() && weight.scalar_type() == x.scalar_type() &&
                  weight.numel() == x.size(-1),
              "weight must be [hidden] in x's dtype");
  auto out = at::empty(x.sizes(), x.options());
  if (x.numel() == 0) return out;
  if (x.scalar_type() == at::kFloat) gemma_rms_norm_impl<float>(x, weight, out, eps);
  else gemma_rms_norm_impl<BF16>(x, weight, out, eps);
  return out;
}

void gemma_add_rms_norm(at::Tensor x, at::Tensor residual, at::Tensor weight, double eps) {
  check_add_norm_args(x, residual, weight, "gemma_add_rms_norm");
  if (x.scalar_type() == at::kFloat)
    add_then_norm_impl<float, gemma_rms_norm_row<float>>(x, residual, weight, eps);
  else add_then_norm_impl<BF16, gemma_rms_norm_row<BF16>>(x, residual, weight, eps);
}

at::Tensor gelu_tanh_and_mul(at::Tensor x) {
  check_cpu(x, "x");
  TORCH_CHECK(x.is_contiguous() && x.size(-1) % 2 == 0, "x must be contiguous [..., 2 * d]");
  auto sizes = x.sizes().vec();
  sizes.back() /= 2;
  auto out = at::empty(sizes, x.options());
  if (x.scalar_type() == at::kFloat) gelu_tanh_and_mul_impl<float>(x, out);
  else gelu_tanh_and_mul_impl<BF16>(x, out);
  return out;
}

bool fused_ops_vectorized() { return kVector; }
