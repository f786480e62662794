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
template <typename T>
inline float dot(const float* q, const T* k, int64_t d) {
  float acc = 0.f;
#pragma omp simd reduction(+ : acc)
  for (int64_t i = 0; i < d; ++i) acc += q[i] * to_float(k[i]);
  return acc;
}

// acc += w * v over one V row.
template <typename T>
inline void axpy(float* acc, float w, const T* v, int64_t d) {
#pragma omp simd
  for (int64_t i = 0; i < d; ++i) acc[i] += w * to_float(v[i]);
}

template <typename T>
void decode_one(const T* q, const T* cache, const int64_t* table, int64_t seq_len, T* out,
                int64_t kv_head, int64_t num_kv_heads, int64_t group, int64_t block_size,
                int64_t head_dim, float scale) {
  // q/out point at the first query head of this kv head's group.
  std::vector<float> qf(group * head_dim), acc(group * head_dim, 0.f), scores(group * seq_len);
  for (int64_t i = 0; i < group * head_dim; ++i) qf[i] = to_float(q[i]) * scale;
  const int64_t kv_stride = num_kv_heads * block_size * head_dim;  // K -> V of one block
  const int64_t block_stride = 2 * kv_stride;
  const int64_t head_offset = kv_head * block_size * head_dim;
  // scores[g, p] = q_g . k_p, block by block (no division per position); each K row is
  // converted to float once, then used by every query head of the group.
  std::vector<float> row(head_dim);
  for (int64_t start = 0; start < seq_len; start += block_size) {
    const T* k = cache + table[start / block_size] * block_stride + head_offset;
    const int64_t n = std::min(block_size, seq_len - start);
    for (int64_t j = 0; j < n; ++j, k += head_dim) {
      for (int64_t i = 0; i < head_dim; ++i) row[i] = to_float(k[i]);
      for (int64_t g = 0; g < group; ++g)
        scores[g * seq_len + start + j] = dot(&qf[g * head_dim], row.data(), head_dim);
    }
  }
  // softmax over p, per query head
  for (int64_t g = 0; g < group; ++g) {
    float* s = &scores[g * seq_len];
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
    const T* v = cache + table[start / block_size] * block_stride + kv_stride + head_offset;
    const int64_t n = std::min(block_size, seq_len - start);
    for (int64_t j = 0; j < n; ++j, v += head_dim) {
      for (int64_t i = 0; i < head_dim; ++i) row[i] = to_float(v[i]);
      for (int64_t g = 0; g < group; ++g)
        axpy(&acc[g * head_dim], scores[g * seq_len + start + j], row.data(), head_dim);
    }
  }
  for (int64_t i = 0; i < group * head_dim; ++i) out[i] = static_cast<T>(acc[i]);
}

template <typename T>
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
    for (int64_t i = begin; i < end; ++i) {
      const int64_t r = i / num_kv_heads, h = i % num_kv_heads;
      const int64_t offset = (r * num_q_heads + h * group) * head_dim;
      decode_one<T>(q_ptr + offset, cache_ptr, table_ptr + r * table_stride, len_ptr[r],
                    out_ptr + offset, h, num_kv_heads, group, block_size, head_dim,
                    static_cast<float>(scale));
    }
  });
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
    decode<float>(q, cache, tables, seq_lens, out, scale);
  } else if (q.scalar_type() == torch::kBFloat16) {
    decode<c10::BFloat16>(q, cache, tables, seq_lens, out, scale);
  } else {
    TORCH_CHECK(false, "paged_decode_attention supports float32 and bfloat16");
  }
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention,
        "paged attention for single-token queries (CPU)");
}
