// Paged attention decode on the CPU: one query token per request, reading K and V straight out
// of the paged cache (no gather copy), fp32 accumulation, parallel over (request, kv head).
//
// Layout (engine/attention.py): kv_cache [num_blocks, 2, num_kv_heads, block_size, head_dim],
// block_tables [num_requests, max_blocks] int64 (padded with the null block 0),
// seq_lens [num_requests] int64 (context length including the new token),
// q / out [num_requests, num_q_heads, head_dim]. The query heads of one kv head are handled
// together (GQA), so each K/V row is read once per kv head.
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

namespace {

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// Dot product of a float query row with one K row of the cache.
// Dot product of a float query row with a float K row (kD known at compile time when > 0:
// the loops then unroll into a few full-width vector instructions).
template <int kD>
inline float dot(const float* q, const float* k, int64_t d) {
  const int64_t n = kD > 0 ? kD : d;
  float acc = 0.f;
#pragma omp simd reduction(+ : acc)
  for (int64_t i = 0; i < n; ++i) acc += q[i] * k[i];
  return acc;
}

// acc += w * v over one float V row.
template <int kD>
inline void axpy(float* acc, float w, const float* v, int64_t d) {
  const int64_t n = kD > 0 ? kD : d;
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) acc[i] += w * v[i];
}

// Converts n contiguous cache values to float (one vectorised pass over a whole block).
template <typename T>
inline void to_float_rows(float* dst, const T* src, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) dst[i] = to_float(src[i]);
}

template <typename T, int kD>
void decode_one(const T* q, const T* cache, const int64_t* table, int64_t seq_len, T* out,
                int64_t kv_head, int64_t num_kv_heads, int64_t group, int64_t block_size,
                int64_t head_dim_runtime, float scale, std::vector<float>& work) {
  // q/out point at the first query head of this kv head's group.
  const int64_t head_dim = kD > 0 ? kD : head_dim_runtime;
  const int64_t qd = group * head_dim;
  work.resize(2 * qd + group * seq_len + block_size * head_dim);
  float* qf = work.data();
  float* acc = qf + qd;
  float* scores = acc + qd;  // [group, seq_len]
  float* rows = scores + group * seq_len;  // one block of K or V rows, as float
  for (int64_t i = 0; i < qd; ++i) {
    qf[i] = to_float(q[i]) * scale;
    acc[i] = 0.f;
  }
  const int64_t kv_stride = num_kv_heads * block_size * head_dim;  // K -> V of one block
  const int64_t block_stride = 2 * kv_stride;
  const int64_t head_offset = kv_head * block_size * head_dim;
  // scores[g, p] = q_g . k_p, block by block: a block's K rows of this head are contiguous.
  for (int64_t start = 0; start < seq_len; start += block_size) {
    const int64_t n = std::min(block_size, seq_len - start);
    to_float_rows(rows, cache + table[start / block_size] * block_stride + head_offset, n * head_dim);
    for (int64_t j = 0; j < n; ++j)
      for (int64_t g = 0; g < group; ++g)
        scores[g * seq_len + start + j] = dot<kD>(qf + g * head_dim, rows + j * head_dim, head_dim);
  }
  // softmax over p, per query head
  for (int64_t g = 0; g < group; ++g) {
    float* s = scores + g * seq_len;
    float m = -std::numeric_limits<float>::infinity();
    for (int64_t p = 0; p < seq_len; ++p) m = std::max(m, s[p]);
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t p = 0; p < seq_len; ++p) {
      s[p] = expf(s[p] - m);  // vectorised through libmvec (-ffast-math)
      sum += s[p];
    }
    const float inv = 1.f / sum;
    for (int64_t p = 0; p < seq_len; ++p) s[p] *= inv;
  }
  // acc[g] = sum_p scores[g, p] * v_p
  for (int64_t start = 0; start < seq_len; start += block_size) {
    const int64_t n = std::min(block_size, seq_len - start);
    to_float_rows(rows, cache + table[start / block_size] * block_stride + kv_stride + head_offset,
                  n * head_dim);
    for (int64_t j = 0; j < n; ++j)
      for (int64_t g = 0; g < group; ++g)
        axpy<kD>(acc + g * head_dim, scores[g * seq_len + start + j], rows + j * head_dim, head_dim);
  }
  for (int64_t i = 0; i < qd; ++i) out[i] = static_cast<T>(acc[i]);
}

template <typename T, int kD>
void decode(const torch::Tensor& q, const torch::Tensor& cache, const torch::Tensor& tables,
            const torch::Tensor& seq_lens, torch::Tensor& out, double scale) {
  const int64_t num_reqs = q.size(0), num_q_heads = q.size(1), head_dim = q.size(2);
  const int64_t num_kv_heads = cache.size(2), block_size = cache.size(3);
  const int64_t group = num_q_heads / num_kv_heads;
  const T* q_ptr = q.data_ptr<T>();
  const T* cache_ptr = cache.data_ptr<T>();
  const int64_t* table_ptr = tables.data_ptr<int64_t>();
  const int64_t* len_ptr = seq_lens.data_ptr<int64_t>();
  T* out_ptr = out.data_ptr<T>();
  const int64_t table_stride = tables.size(1);
  at::parallel_for(0, num_reqs * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> work;  // per thread, reused across (request, kv head) pairs
    for (int64_t i = begin; i < end; ++i) {
      const int64_t r = i / num_kv_heads, h = i % num_kv_heads;
      const int64_t offset = (r * num_q_heads + h * group) * head_dim;
      decode_one<T, kD>(q_ptr + offset, cache_ptr, table_ptr + r * table_stride, len_ptr[r],
                        out_ptr + offset, h, num_kv_heads, group, block_size, head_dim,
                        static_cast<float>(scale), work);
    }
  });
}

template <typename T>
void decode_dispatch(const torch::Tensor& q, const torch::Tensor& cache,
                     const torch::Tensor& tables, const torch::Tensor& seq_lens,
                     torch::Tensor& out, double scale) {
  switch (q.size(2)) {  // common head sizes get fully unrolled inner loops
    case 64: return decode<T, 64>(q, cache, tables, seq_lens, out, scale);
    case 128: return decode<T, 128>(q, cache, tables, seq_lens, out, scale);
    case 32: return decode<T, 32>(q, cache, tables, seq_lens, out, scale);
    default: return decode<T, 0>(q, cache, tables, seq_lens, out, scale);
  }
}

}  // namespace

torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor cache, torch::Tensor tables,
                                     torch::Tensor seq_lens, double scale) {
  TORCH_CHECK(q.is_contiguous() && cache.is_contiguous() && tables.is_contiguous() &&
                  seq_lens.is_contiguous(),
              "paged_decode_attention needs contiguous inputs");
  TORCH_CHECK(cache.dim() == 5 && q.dim() == 3, "bad ranks");
  TORCH_CHECK(q.scalar_type() == cache.scalar_type(), "q and cache dtypes differ");
  TORCH_CHECK(tables.scalar_type() == torch::kInt64 && seq_lens.scalar_type() == torch::kInt64,
              "block tables and seq lens must be int64");
  TORCH_CHECK(q.size(1) % cache.size(2) == 0, "q heads must be a multiple of kv heads");
  auto out = torch::empty_like(q);
  if (q.scalar_type() == torch::kFloat32) {
    decode_dispatch<float>(q, cache, tables, seq_lens, out, scale);
  } else if (q.scalar_type() == torch::kBFloat16) {
    decode_dispatch<c10::BFloat16>(q, cache, tables, seq_lens, out, scale);
  } else {
    TORCH_CHECK(false, "paged_decode_attention supports float32 and bfloat16");
  }
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention,
        "paged attention for single-token queries (CPU)");
}
