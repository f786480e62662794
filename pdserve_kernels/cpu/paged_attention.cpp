// Paged attention decode on the CPU: one query token per request, reading K and V straight out
// of the paged cache (no gather copy), fp32 accumulation, parallel over requests (or over
// (request, kv head) when there are few requests). Fused elementwise layers: fused_ops.cpp.
//
// Layout (engine/attention.py): kv_cache [num_blocks, 2, num_kv_heads, block_size, head_dim],
// block_tables [num_requests, max_blocks] int64 (padded with the null block 0),
// seq_lens [num_requests] int64 (context length including the new token),
// q / out [num_requests, num_q_heads, head_dim]. The query heads of one kv head are handled
// together (GQA), so each K/V row is read once per kv head.
//
// Sliding-window layers (window > 0): request r attends to positions
// [first_key(seq_len, window), seq_len), i.e. the query at position p = seq_len - 1 sees keys
// in (p - window, p]; blocks before the window are not read at all.
#include <ATen/Parallel.h>
// The ATen headers only: the Python bindings of every kernel file are in bindings.cpp, the one
// file that includes <torch/extension.h> (~27 s of headers to compile; these ~4).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include "thread_pool.h"
#include "vec.h"

#include <cmath>
#include <algorithm>
#include <type_traits>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif
#include <cstring>
#include <limits>
#include <vector>

namespace {

using namespace pdserve_cpu;

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

// The first key position a decode at position seq_len - 1 attends to (window 0: all of them).
inline int64_t first_key(int64_t seq_len, int64_t window) {
  return window > 0 ? std::max<int64_t>(0, seq_len - window) : 0;
}

template <typename T, int kD>
void decode_one(const T* q, const T* cache, const int64_t* table, int64_t first, int64_t seq_len,
                T* out, int64_t kv_head, int64_t num_kv_heads, int64_t group, int64_t block_size,
                int64_t head_dim_runtime, float scale, std::vector<float>& work) {
  // q/out point at the first query head of this kv head's group; keys [first, seq_len).
  const int64_t head_dim = kD > 0 ? kD : head_dim_runtime;
  const int64_t qd = group * head_dim;
  const int64_t len = seq_len - first;
  work.resize(2 * qd + group * len + block_size * head_dim);
  float* qf = work.data();
  float* acc = qf + qd;
  float* scores = acc + qd;  // [group, len]: scores[g, p - first]
  float* rows = scores + group * len;  // one block of K or V rows, as float
  for (int64_t i = 0; i < qd; ++i) {
    qf[i] = to_float(q[i]) * scale;
    acc[i] = 0.f;
  }
  const int64_t kv_stride = num_kv_heads * block_size * head_dim;  // K -> V of one block
  const int64_t block_stride = 2 * kv_stride;
  const int64_t head_offset = kv_head * block_size * head_dim;
  // scores[g, p] = q_g . k_p, block by block: a block's K rows of this head are contiguous
  // (the first block may be entered part-way, at the window's start).
  for (int64_t start = first; start < seq_len;) {
    const int64_t in_block = start % block_size;
    const int64_t n = std::min(block_size - in_block, seq_len - start);
    to_float_rows(rows,
                  cache + table[start / block_size] * block_stride + head_offset + in_block * head_dim,
                  n * head_dim);
    for (int64_t j = 0; j < n; ++j)
      for (int64_t g = 0; g < group; ++g)
        scores[g * len + start - first + j] =
            dot<kD>(qf + g * head_dim, rows + j * head_dim, head_dim);
    start += n;
  }
  // softmax over p, per query head
  for (int64_t g = 0; g < group; ++g) {
    float* s = scores + g * len;
    float m = -std::numeric_limits<float>::infinity();
    for (int64_t p = 0; p < len; ++p) m = std::max(m, s[p]);
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t p = 0; p < len; ++p) {
      s[p] = expf(s[p] - m);  // vectorised through libmvec (-ffast-math)
      sum += s[p];
    }
    const float inv = 1.f / sum;
    for (int64_t p = 0; p < len; ++p) s[p] *= inv;
  }
  // acc[g] = sum_p scores[g, p] * v_p
  for (int64_t start = first; start < seq_len;) {
    const int64_t in_block = start % block_size;
    const int64_t n = std::min(block_size - in_block, seq_len - start);
    to_float_rows(rows,
                  cache + table[start / block_size] * block_stride + kv_stride + head_offset +
                      in_block * head_dim,
                  n * head_dim);
    for (int64_t j = 0; j < n; ++j)
      for (int64_t g = 0; g < group; ++g)
        axpy<kD>(acc + g * head_dim, scores[g * len + start - first + j], rows + j * head_dim,
                 head_dim);
    start += n;
  }
  for (int64_t i = 0; i < qd; ++i) out[i] = static_cast<T>(acc[i]);
}

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
#define PDSERVE_DECODE_AVX2 1
// lane i = the horizontal sum of v[i], for 8 vectors.
inline __m256 reduce8(const __m256* v) {
  const __m256 h01 = _mm256_hadd_ps(v[0], v[1]), h23 = _mm256_hadd_ps(v[2], v[3]);
  const __m256 h45 = _mm256_hadd_ps(v[4], v[5]), h67 = _mm256_hadd_ps(v[6], v[7]);
  const __m256 h0123 = _mm256_hadd_ps(h01, h23), h4567 = _mm256_hadd_ps(h45, h67);
  return _mm256_add_ps(_mm256_permute2f128_ps(h0123, h4567, 0x20),
                       _mm256_permute2f128_ps(h0123, h4567, 0x31));
}

// decode_one on AVX2 + FMA (e.g. AMD Zen 3, no AVX-512), for a range of kv heads (all of a
// request's when there are many requests, see decode()): the same two passes, with q . k taken
// 8 keys at a time (8 accumulators, one q vector load per 8 K vectors, one 8-way horizontal
// reduction per 8 scores instead of one per score) and P V 64 dims (8 accumulators) at a time;
// bf16 K/V widened once per block into a float buffer (4 KiB for 16 x 64) that every query
// head of the group then reads from L1, instead of widening each row once per query head. 1.3-1.55x decode_one in fp32 (4 x 7680 and 48 x 450 contexts, SmolLM2's
// heads) and at 48 x 450 in bf16, ~1.1x at 4 x 7680 in bf16 (benchmarks/decode_attention_cpu.py).
// The next block's rows of a head are prefetched while the same head's rows of this block are
// read (session 34, benchmarks/decode_attention_cpu.py, medians of 3 alternating runs, old ->
// new ms a call: fp32 48 x 450 1.74 -> 1.55, 4 x 7680 2.77 -> 2.57; bf16 48 x 450 1.39 -> 1.26,
// 4 x 7680 2.73 -> 2.50; the small preset's heads, fp32 48 x 216: 0.93-0.96 -> 0.83).
template <typename T, int kD>
void decode_heads_avx2(const T* q, const T* cache, const int64_t* table, int64_t first,
                       int64_t seq_len, T* out, int64_t h0, int64_t h1, int64_t num_kv_heads,
                       int64_t group, int64_t block_size, float scale, std::vector<float>& work) {
  // q/out point at the first query head of kv head h0; kv heads [h0, h1), keys [first, seq_len).
  // Block by block, every kv head of the range in turn: with all of a request's heads in one
  // task, a block's K (then V) rows of those heads are one contiguous run.
  static_assert(kD > 0 && kD % 8 == 0, "head_dim must be a multiple of 8");
  constexpr int kC = kD / 8;                     // vectors per row
  constexpr int kV = kC % 8 == 0 ? 8 : kC;       // accumulators per P V pass
  static_assert(kC % kV == 0);
  const int64_t heads = (h1 - h0) * group;  // query heads
  const int64_t qd = heads * kD;
  const int64_t len = seq_len - first;
  const int64_t stride = len + 8;  // a score row, room for a last full 8-key store
  constexpr bool kWiden = !std::is_same_v<T, float>;
  work.resize(2 * qd + heads * stride + (kWiden ? block_size * kD : 0));
  float* qf = work.data();
  float* acc = qf + qd;
  float* scores = acc + qd;               // [heads, stride]
  float* wide = scores + heads * stride;  // one block's K or V rows as floats (bf16 only)
  // n rows of the block as floats: the cache itself (float32) or `wide`, widened once.
  auto as_float = [&](const T* rows, int64_t n) -> const float* {
    if constexpr (kWiden) {
      for (int64_t i = 0; i < n * kD; i += 8) _mm256_storeu_ps(wide + i, widen8(rows + i));
      return wide;
    } else {
      return rows;
    }
  };
  for (int64_t i = 0; i < qd; ++i) {
    qf[i] = to_float(q[i]) * scale;
    acc[i] = 0.f;
  }
  const int64_t kv_stride = num_kv_heads * block_size * kD;  // K -> V of one block
  const int64_t block_stride = 2 * kv_stride;
  auto rows_of = [&](int64_t start, int64_t kv, int64_t h) -> const T* {
    return cache + table[start / block_size] * block_stride + kv * kv_stride +
           h * block_size * kD + (start % block_size) * kD;
  };
  for (int64_t start = first; start < seq_len;) {
    const int64_t n = std::min(block_size - start % block_size, seq_len - start);
    // The next block's K rows of the head, 8 rows a step ahead of these (from memory: the
    // blocks of a sequence lie anywhere, and the hardware prefetcher stops at each jump).
    const bool ahead = start + n < seq_len;
    for (int64_t h = h0; h < h1; ++h) {
      const float* k = as_float(rows_of(start, 0, h), n);
      const char* next = ahead ? reinterpret_cast<const char*>(rows_of(start + n, 0, h)) : nullptr;
      for (int64_t j0 = 0; j0 < n; j0 += 8) {
        const int64_t nk = std::min<int64_t>(8, n - j0);
        if (next != nullptr)
          for (int64_t l = 0; l < 8 * kD * int64_t{sizeof(T)}; l += 64)
            _mm_prefetch(next + j0 * kD * int64_t{sizeof(T)} + l, _MM_HINT_T0);
        const float* kr[8];
        for (int64_t i = 0; i < 8; ++i) kr[i] = k + (j0 + std::min(i, nk - 1)) * kD;  // tail: repeats
        for (int64_t g = (h - h0) * group; g < (h - h0 + 1) * group; ++g) {
          __m256 a[8];
          const __m256 q0 = _mm256_loadu_ps(qf + g * kD);
          for (int i = 0; i < 8; ++i) a[i] = _mm256_mul_ps(q0, widen8(kr[i]));
          for (int c = 1; c < kC; ++c) {
            const __m256 qc = _mm256_loadu_ps(qf + g * kD + 8 * c);
            for (int i = 0; i < 8; ++i) a[i] = _mm256_fmadd_ps(qc, widen8(kr[i] + 8 * c), a[i]);
          }
          _mm256_storeu_ps(scores + g * stride + start - first + j0, reduce8(a));  // past nk: overwritten or unused
        }
      }
    }
    start += n;
  }
  for (int64_t g = 0; g < heads; ++g) softmax8(scores + g * stride, len);  // per query head
  for (int64_t start = first; start < seq_len;) {
    const int64_t n = std::min(block_size - start % block_size, seq_len - start);
    const bool ahead = start + n < seq_len;  // the next block's V rows of the head, as for K
    for (int64_t h = h0; h < h1; ++h) {
      const float* v = as_float(rows_of(start, 1, h), n);
      if (ahead) {
        const char* next = reinterpret_cast<const char*>(rows_of(start + n, 1, h));
        for (int64_t l = 0; l < block_size * kD * int64_t{sizeof(T)}; l += 64)
          _mm_prefetch(next + l, _MM_HINT_T0);
      }
      for (int64_t g = (h - h0) * group; g < (h - h0 + 1) * group; ++g) {
        const float* w = scores + g * stride + start - first;
        for (int d0 = 0; d0 < kD; d0 += 8 * kV) {
          __m256 a[kV];
          for (int c = 0; c < kV; ++c) a[c] = _mm256_loadu_ps(acc + g * kD + d0 + 8 * c);
          for (int64_t j = 0; j < n; ++j) {
            const __m256 wj = _mm256_broadcast_ss(w + j);
            for (int c = 0; c < kV; ++c)
              a[c] = _mm256_fmadd_ps(wj, widen8(v + j * kD + d0 + 8 * c), a[c]);
          }
          for (int c = 0; c < kV; ++c) _mm256_storeu_ps(acc + g * kD + d0 + 8 * c, a[c]);
        }
      }
    }
    start += n;
  }
  for (int64_t i = 0; i < qd; ++i) out[i] = static_cast<T>(acc[i]);
}
#endif

#if defined(__AVX512F__)
// AVX-512 path (head_dim a multiple of 16): scores for up to 16 positions at a time (one fp32
// accumulator vector per position, then one transposing reduction of the 16 vectors instead of
// 16 horizontal sums), a vectorised online softmax, and V rows accumulated into the outputs of
// the query heads of a kv head together: each V row is loaded (bf16: widened to fp32) once per
// tile for the whole group. Requests are split between threads by work (context length).

inline void store_rounded(float* dst, __m512 v) { _mm512_storeu_ps(dst, v); }
inline void store_rounded(c10::BFloat16* dst, __m512 v) {
  for (int i = 0; i < 16; ++i) dst[i] = static_cast<c10::BFloat16>(reinterpret_cast<float*>(&v)[i]);
}

// Query heads of one kv head accumulated together over one tile (G <= kMaxGroupTile of
// them): acc[g] = acc[g] * rescale[g] + sum_j w[g][j] * v_j. Each V row slice is loaded (and
// widened, for bf16) once for all G heads, and G x kCC accumulators stay in registers as
// independent FMA chains (kCC: head-dim slices at a time, G * kCC <= 24 of the 32 registers);
// the weights come in as memory broadcasts. The sum over j runs in order, as before.
constexpr int64_t kMaxGroupTile = 8;

constexpr int slices_at_once(int slices, int heads) {
  const int cap = heads >= 24 ? 1 : 24 / heads;
  for (int c = slices; c > 1; --c)
    if (slices % c == 0 && c <= cap) return c;
  return 1;
}

template <typename T, int kD, int G>
inline void accumulate_v(float* acc, const float* w, const float* rescale, const T* v, int64_t n) {
  constexpr int kC = kD / 16;
  constexpr int kCC = slices_at_once(kC, G);
  for (int c0 = 0; c0 < kC; c0 += kCC) {
    __m512 a[G][kCC];
    for (int g = 0; g < G; ++g)
      for (int cc = 0; cc < kCC; ++cc)
        a[g][cc] = _mm512_mul_ps(_mm512_loadu_ps(acc + g * kD + 16 * (c0 + cc)),
                                 _mm512_set1_ps(rescale[g]));
    for (int64_t j = 0; j < n; ++j) {
      for (int cc = 0; cc < kCC; ++cc) {
        const __m512 vj = load16(v + j * kD + 16 * (c0 + cc));
        for (int g = 0; g < G; ++g)
          a[g][cc] = _mm512_fmadd_ps(_mm512_set1_ps(w[16 * g + j]), vj, a[g][cc]);
      }
    }
    for (int g = 0; g < G; ++g)
      for (int cc = 0; cc < kCC; ++cc) _mm512_storeu_ps(acc + g * kD + 16 * (c0 + cc), a[g][cc]);
  }
}

#if defined(__AVX512BF16__)
// bf16 V (head_dim % 32 == 0): acc[g] = acc[g] * rescale[g] + sum_j p[g][j] v_j on the bf16
// dot-product instruction, two keys at a time: rows j and j + 1 interleaved (unpacklo/hi:
// one instruction per 32 dims each) pair each dim's two values, and one vdpbf16ps adds both
// keys' terms for 16 dims. P is rounded to bf16 (as FlashAttention does; the fp32 path keeps
// fp32 weights). acc is kept in that interleaving's dim order: per 32 dims, lanes
// [0-3, 8-11, 16-19, 24-27] then [4-7, 12-15, 20-23, 28-31] (unpermute_pairs puts it back).
// Rows past n are read as zeros (their weights are 0, but their memory is another head's).
template <int kD, int G>
inline void accumulate_v_pairs(float* acc, const float* w, const float* rescale,
                               const c10::BFloat16* v, int64_t n) {
  constexpr int kChunks = kD / 32;  // 32-dim chunks, two accumulators each per head
  constexpr int kAtOnce = slices_at_once(kChunks, 2 * G);
  alignas(64) uint32_t wp[G][8];  // the weights as bf16 pairs (keys 2i, 2i + 1)
  for (int g = 0; g < G; ++g)
    _mm256_store_si256(reinterpret_cast<__m256i*>(wp[g]),
                       (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(w + 16 * g)));
  for (int c0 = 0; c0 < kChunks; c0 += kAtOnce) {
    __m512 a[G][2 * kAtOnce];
    for (int g = 0; g < G; ++g)
      for (int i = 0; i < 2 * kAtOnce; ++i)
        a[g][i] = _mm512_mul_ps(_mm512_loadu_ps(acc + g * kD + 32 * c0 + 16 * i),
                                _mm512_set1_ps(rescale[g]));
    for (int64_t j = 0; j < n; j += 2) {
      __m512bh lo[kAtOnce], hi[kAtOnce];
      for (int c = 0; c < kAtOnce; ++c) {
        const __m512i r0 = _mm512_loadu_si512(v + j * kD + 32 * (c0 + c));
        const __m512i r1 = j + 1 < n ? _mm512_loadu_si512(v + (j + 1) * kD + 32 * (c0 + c))
                                     : _mm512_setzero_si512();
        lo[c] = (__m512bh)_mm512_unpacklo_epi16(r0, r1);
        hi[c] = (__m512bh)_mm512_unpackhi_epi16(r0, r1);
      }
      for (int g = 0; g < G; ++g) {
        const __m512bh pw = (__m512bh)_mm512_set1_epi32(static_cast<int>(wp[g][j / 2]));
        for (int c = 0; c < kAtOnce; ++c) {
          a[g][2 * c] = _mm512_dpbf16_ps(a[g][2 * c], pw, lo[c]);
          a[g][2 * c + 1] = _mm512_dpbf16_ps(a[g][2 * c + 1], pw, hi[c]);
        }
      }
    }
    for (int g = 0; g < G; ++g)
      for (int i = 0; i < 2 * kAtOnce; ++i)
        _mm512_storeu_ps(acc + g * kD + 32 * c0 + 16 * i, a[g][i]);
  }
}

// acc's 32-dim chunk in accumulate_v_pairs' order -> dims in order.
inline void unpermute_pairs(const float* src, __m512& first, __m512& second) {
  const __m512 lo = _mm512_loadu_ps(src), hi = _mm512_loadu_ps(src + 16);
  first = _mm512_permutex2var_ps(
      lo, _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23), hi);
  second = _mm512_permutex2var_ps(
      lo, _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31), hi);
}
#endif

#if defined(PDSERVE_AMX)
// q . k for a kv head's G query heads and 16 keys on the tile unit: S^T [16 keys, G] = K Q^T,
// K loaded as an A operand straight from the cache block (16 rows of head_dim bf16; rows past
// the tile's keys are read but masked after), Q^T as B operands in the pair layout (qt:
// [kD / 32][16 dim pairs][G] pairs of bf16). Tiles: 0 S^T, 1 and 4 K, 2 and 3 Q^T (alternated:
// tiles are not renamed). The G heads' scores are then gathered out of st [16][G].
struct DecodeTiles {
  explicit DecodeTiles(int g) {
    AmxTiles::Config c;
    const uint16_t cols_g = static_cast<uint16_t>(4 * g);
    c.rows[0] = 16, c.colsb[0] = cols_g;  // S^T
    c.rows[1] = 16, c.colsb[1] = 64;      // K
    c.rows[4] = 16, c.colsb[4] = 64;      // K
    c.rows[2] = 16, c.colsb[2] = cols_g;  // Q^T pairs
    c.rows[3] = 16, c.colsb[3] = cols_g;  // Q^T pairs
    asm volatile("" ::: "memory");  // see AmxTiles
    _tile_loadconfig(&c);
  }
  ~DecodeTiles() { _tile_release(); }
  DecodeTiles(const DecodeTiles&) = delete;
  DecodeTiles& operator=(const DecodeTiles&) = delete;
};

template <int kD>
inline void scores_tiles(const c10::BFloat16* k, const uint32_t* qt, float* st, int g) {
  _tile_zero(0);
  for (int t = 0; t < kD / 32; ++t) {
    if (t % 2 == 0) {
      _tile_loadd(1, k + 32 * t, kD * 2);
      _tile_loadd(2, qt + t * 16 * g, 4 * g);
      _tile_dpbf16ps(0, 1, 2);
    } else {
      _tile_loadd(4, k + 32 * t, kD * 2);
      _tile_loadd(3, qt + t * 16 * g, 4 * g);
      _tile_dpbf16ps(0, 4, 3);
    }
  }
  _tile_stored(0, st, 4 * g);
}
#endif

// One request, kv heads [h_begin, h_end): blocks outer, heads inner, so the cache is read in
// block order (a block's K of all heads is one contiguous run, its V the next), and each block
// is read once, K and V together, with an online softmax (running max and sum per query head,
// the accumulator rescaled when the max grows). The next block's K and V are prefetched into
// L2 while a block is computed: blocks are scattered, and a run of a few KiB is too short for
// the hardware prefetcher, so without it the loads of each block wait on memory one after
// another (bf16 K/V read at 11-13 GB/s on an AMD Zen 4 whose cores read ~30 GB/s).
template <typename T, int kD, bool kTilesQK = false>
void decode_heads_avx512(const T* q, const T* cache, const int64_t* table, int64_t first,
                         int64_t seq_len, T* out, int64_t h_begin, int64_t h_end, int64_t num_kv_heads,
                         int64_t group, int64_t block_size, float scale,
                         std::vector<float>& work) {
  static_assert(kD % 16 == 0 && kD > 0, "head_dim must be a multiple of 16");
  constexpr int kC = kD / 16;  // vectors per row
  constexpr float kNoScore = -1e30f;  // finite: -ffast-math assumes no infinities
  // bf16 V on the dot-product instruction, two keys at a time (accumulate_v_pairs)
#if defined(__AVX512BF16__)
  constexpr bool kPairsV = std::is_same_v<T, c10::BFloat16> && kD % 32 == 0;
#endif
  const int64_t nq = (h_end - h_begin) * group;  // query heads handled here
  work.resize(2 * nq * kD + 2 * nq + 16 * kD + 17 * group);
  float* qf = work.data();          // [nq, D], pre-scaled
  float* acc = qf + nq * kD;        // [nq, D]
  float* run_max = acc + nq * kD;   // [nq]
  float* run_sum = run_max + nq;    // [nq]
  float* krows = run_sum + nq;      // [16, D]: one tile of K rows as float
  float* weights = krows + 16 * kD;  // [group, 16]: one tile's softmax weights per query head
  float* rescales = weights + 16 * group;  // [group]: each head's accumulator rescale
  for (int64_t i = 0; i < nq * kD; ++i) {
    qf[i] = to_float(q[i]) * scale;
    acc[i] = 0.f;
  }
  for (int64_t i = 0; i < nq; ++i) {
    run_max[i] = kNoScore;
    run_sum[i] = 0.f;
  }
  const int64_t head_stride = block_size * kD;
  const int64_t kv_stride = num_kv_heads * head_stride;  // K -> V of one block
  const int64_t block_stride = 2 * kv_stride;
  auto widen = [](const T* src, int64_t n, float* dst) -> const float* {
    if constexpr (std::is_same_v<T, float>) {
      return src;
    } else {
      for (int64_t j = 0; j < n * kC; ++j) _mm512_storeu_ps(dst + 16 * j, load16(src + 16 * j));
      return dst;
    }
  };
#if defined(PDSERVE_AMX)
  // kTilesQK (bf16, group <= 16, block_size % 16 == 0): Q^T pairs of every head in range.
  std::vector<uint32_t> qt_all(kTilesQK ? (h_end - h_begin) * (kD / 2) * group : 0);
  alignas(64) float st[16 * 16];
  if constexpr (kTilesQK) {
    for (int64_t h = h_begin; h < h_end; ++h)
      for (int64_t g = 0; g < group; ++g) {
        const uint32_t* src =
            reinterpret_cast<const uint32_t*>(q + ((h - h_begin) * group + g) * kD);
        uint32_t* dst = qt_all.data() + (h - h_begin) * (kD / 2) * group;
        for (int64_t dp = 0; dp < kD / 2; ++dp) dst[dp * group + g] = src[dp];
      }
  }
#endif
  for (int64_t start = first; start < seq_len;) {  // tiles never cross a block boundary
    const int64_t b = start / block_size, in_block = start % block_size;
    const int64_t n = std::min<int64_t>({16, seq_len - start, block_size - in_block});
    const __mmask16 valid = static_cast<__mmask16>(n == 16 ? 0xFFFF : (1u << n) - 1);
    const T* block = cache + table[b] * block_stride + in_block * kD;
    // The next block's K and V runs of this task's heads (2 KiB each for one head of
    // SmolLM2, 6 KiB for all three) are fetched into L2 while this block's last tile is
    // computed, a share per head, spread over the heads rather than all at once (into L1,
    // or two blocks ahead, measured slower). One head, Intel AMX, 4 x 7.7k tokens: 1.45 ->
    // 1.02 ms a call (into L1, with the tiles' q . k; unmeasured on AMX since). Zen 4, bf16,
    // 30 layers' caches in turn (benchmarks/decode_attention_cpu.py), medians of alternating
    // builds: one head (4 x 7680) 1.84 -> 1.64 ms a call for L2 over L1; all heads, where
    // nothing was prefetched before, 8 x 290 tokens 0.16 -> 0.12, 48 x 450 1.41 -> 1.02.
    const bool ahead = in_block + n == block_size &&
                       (start + n) / block_size <= (seq_len - 1) / block_size;
    const char* next_k = ahead ? reinterpret_cast<const char*>(cache + table[b + 1] * block_stride +
                                                               h_begin * head_stride)
                               : nullptr;
    const int64_t run_bytes = (h_end - h_begin) * head_stride * static_cast<int64_t>(sizeof(T));
    for (int64_t h = h_begin; h < h_end; ++h) {
      if (ahead) {
        const int64_t share = h - h_begin, shares = h_end - h_begin;
        const int64_t lo = run_bytes * share / shares / 64 * 64;
        const int64_t hi = run_bytes * (share + 1) / shares;
        for (int64_t off = lo; off < hi; off += 64) {
          _mm_prefetch(next_k + off, _MM_HINT_T1);
          _mm_prefetch(next_k + kv_stride * static_cast<int64_t>(sizeof(T)) + off, _MM_HINT_T1);
        }
      }
      const T* k_raw = block + h * head_stride;
#if defined(__AVX512BF16__)
      // bf16: q . k straight from the cache with the bf16 dot-product instruction (products
      // exact in fp32, fp32 sums), no widening pass over K.
      constexpr bool kDotBf16 = std::is_same_v<T, c10::BFloat16>;
#else
      constexpr bool kDotBf16 = false;
#endif
      const float* k = kDotBf16 || kTilesQK ? nullptr : widen(k_raw, n, krows);
      const T* v = block + h * head_stride + kv_stride;  // rows widened as they are used
#if defined(PDSERVE_AMX)
      if constexpr (kTilesQK)
        scores_tiles<kD>(k_raw, qt_all.data() + (h - h_begin) * (kD / 2) * group, st,
                         static_cast<int>(group));
#endif
      for (int64_t g = 0; g < group; ++g) {
        const int64_t qi = (h - h_begin) * group + g;
        __m512 dots[16];
        __m512 raw;
        if constexpr (kTilesQK) {
#if defined(PDSERVE_AMX)
          raw = _mm512_i32gather_ps(
              _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13,
                                                   14, 15),
                                 _mm512_set1_epi32(static_cast<int>(group))),
              st + g, 4);
#endif
        } else if constexpr (kDotBf16) {
#if defined(__AVX512BF16__)
          constexpr int kP = kD / 32;  // 32-element bf16 vectors per row (kD % 32 != 0: tail)
          constexpr bool kTail = kD % 32 != 0;
          const T* qrow = q + qi * kD;
          __m512bh qv[kP + 1];
          for (int c = 0; c < kP; ++c)
            qv[c] = (__m512bh)_mm512_loadu_si512(qrow + 32 * c);
          if constexpr (kTail)
            qv[kP] = (__m512bh)_mm512_zextsi256_si512(_mm256_loadu_si256(
                reinterpret_cast<const __m256i*>(qrow + 32 * kP)));
          for (int64_t j = 0; j < 16; ++j) {
            __m512 a = _mm512_setzero_ps();
            if (j < n) {
              const T* krow = k_raw + j * kD;
              for (int c = 0; c < kP; ++c)
                a = _mm512_dpbf16_ps(a, qv[c], (__m512bh)_mm512_loadu_si512(krow + 32 * c));
              if constexpr (kTail)
                a = _mm512_dpbf16_ps(a, qv[kP], (__m512bh)_mm512_zextsi256_si512(_mm256_loadu_si256(
                                                  reinterpret_cast<const __m256i*>(krow + 32 * kP))));
            }
            dots[j] = a;
          }
#endif
        } else {
          __m512 qv[kC];
          for (int c = 0; c < kC; ++c) qv[c] = _mm512_loadu_ps(qf + qi * kD + 16 * c);
          for (int64_t j = 0; j < 16; ++j) {
            if (j >= n) {
              dots[j] = _mm512_setzero_ps();
              continue;
            }
            __m512 a = _mm512_mul_ps(qv[0], _mm512_loadu_ps(k + j * kD));
            for (int c = 1; c < kC; ++c)
              a = _mm512_fmadd_ps(qv[c], _mm512_loadu_ps(k + j * kD + 16 * c), a);
            dots[j] = a;
          }
        }
        if constexpr (!kTilesQK) raw = reduce16(dots);
        if constexpr (kDotBf16 || kTilesQK)
          raw = _mm512_mul_ps(raw, _mm512_set1_ps(scale));  // q unscaled
        const __m512 scores = _mm512_mask_blend_ps(valid, _mm512_set1_ps(kNoScore), raw);
        const float new_max = std::max(run_max[qi], _mm512_reduce_max_ps(scores));
        const __m512 p = _mm512_maskz_mov_ps(
            valid, exp16(_mm512_sub_ps(scores, _mm512_set1_ps(new_max))));
        // exp(old max - new max): 1 while the max holds, ~0 on the first tile
        const float rescale = _mm512_cvtss_f32(exp16(_mm512_set1_ps(run_max[qi] - new_max)));
        run_sum[qi] = run_sum[qi] * rescale + _mm512_reduce_add_ps(p);
        run_max[qi] = new_max;
        _mm512_storeu_ps(weights + 16 * g, p);
        rescales[g] = rescale;
      }
      // acc[g] = acc[g] * rescale[g] + sum_j p[g][j] * v_j for the group's query heads
      // together, so each V row is loaded (and widened) once per kv head, not once per head.
      float* head_acc = acc + (h - h_begin) * group * kD;
      for (int64_t g0 = 0; g0 < group; g0 += kMaxGroupTile) {
        const int64_t gn = std::min<int64_t>(kMaxGroupTile, group - g0);
        float* a = head_acc + g0 * kD;
        const float* w = weights + 16 * g0;
        const float* r = rescales + g0;
#if defined(__AVX512BF16__)
        if constexpr (kPairsV) {
          switch (gn) {
            case 1: accumulate_v_pairs<kD, 1>(a, w, r, v, n); break;
            case 2: accumulate_v_pairs<kD, 2>(a, w, r, v, n); break;
            case 3: accumulate_v_pairs<kD, 3>(a, w, r, v, n); break;
            case 4: accumulate_v_pairs<kD, 4>(a, w, r, v, n); break;
            case 5: accumulate_v_pairs<kD, 5>(a, w, r, v, n); break;
            case 6: accumulate_v_pairs<kD, 6>(a, w, r, v, n); break;
            case 7: accumulate_v_pairs<kD, 7>(a, w, r, v, n); break;
            default: accumulate_v_pairs<kD, 8>(a, w, r, v, n); break;
          }
          continue;
        }
#endif
        switch (gn) {
          case 1: accumulate_v<T, kD, 1>(a, w, r, v, n); break;
          case 2: accumulate_v<T, kD, 2>(a, w, r, v, n); break;
          case 3: accumulate_v<T, kD, 3>(a, w, r, v, n); break;
          case 4: accumulate_v<T, kD, 4>(a, w, r, v, n); break;
          case 5: accumulate_v<T, kD, 5>(a, w, r, v, n); break;
          case 6: accumulate_v<T, kD, 6>(a, w, r, v, n); break;
          case 7: accumulate_v<T, kD, 7>(a, w, r, v, n); break;
          default: accumulate_v<T, kD, 8>(a, w, r, v, n); break;
        }
      }
    }
    start += n;
  }
  for (int64_t qi = 0; qi < nq; ++qi) {
    const __m512 inv = _mm512_set1_ps(1.f / run_sum[qi]);
#if defined(__AVX512BF16__)
    if constexpr (kPairsV) {
      for (int c = 0; c < kC; c += 2) {
        __m512 first, second;
        unpermute_pairs(acc + qi * kD + 16 * c, first, second);
        store_rounded(out + qi * kD + 16 * c, _mm512_mul_ps(first, inv));
        store_rounded(out + qi * kD + 16 * c + 16, _mm512_mul_ps(second, inv));
      }
      continue;
    }
#endif
    for (int c = 0; c < kC; ++c)
      store_rounded(out + qi * kD + 16 * c, _mm512_mul_ps(_mm512_loadu_ps(acc + qi * kD + 16 * c), inv));
  }
}
#endif  // __AVX512F__

// Boundaries (parts + 1 of them) splitting tasks [0, n) into `parts` contiguous ranges of
// about equal total cost(i).
template <typename Cost>
std::vector<int64_t> balanced_ranges(int64_t n, int64_t parts, Cost cost) {
  std::vector<int64_t> prefix(n + 1, 0);
  for (int64_t i = 0; i < n; ++i) prefix[i + 1] = prefix[i] + cost(i);
  std::vector<int64_t> bounds(parts + 1, n);
  bounds[0] = 0;
  int64_t i = 0;
  for (int64_t p = 1; p < parts; ++p) {
    const int64_t target = prefix[n] * p / parts;
    while (i < n && prefix[i] < target) ++i;
    bounds[p] = i;
  }
  return bounds;
}

// A task's fixed cost in context positions (query load, output store, scheduling).
constexpr int64_t kTaskOverhead = 16;

// How the vector decode paths split a batch: a task is a request (all its kv heads, read block
// by block: a block's K rows of all its heads are one contiguous run) when there are enough
// requests to keep every thread busy, else one (request, kv head); then one contiguous range
// of tasks per thread, of about equal work (context lengths vary within a batch, and equal task
// counts can leave one thread waiting on the other). Thread p runs tasks [bounds[p],
// bounds[p + 1]); task i is request i / tasks_per_req, kv heads from
// i % tasks_per_req * heads_per_task.
struct DecodeSplit {
  bool per_request;
  int64_t heads_per_task, tasks_per_req, parts;
  std::vector<int64_t> bounds;
};

inline DecodeSplit split_decode(int64_t num_reqs, int64_t num_kv_heads, const int64_t* len_ptr,
                                int64_t window) {
  const bool per_request = num_reqs >= 4 * at::get_num_threads();
  const int64_t heads_per_task = per_request ? num_kv_heads : 1;
  const int64_t tasks_per_req = num_kv_heads / heads_per_task;
  const int64_t num_tasks = num_reqs * tasks_per_req;
  const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), num_tasks));
  std::vector<int64_t> bounds = balanced_ranges(num_tasks, parts, [&](int64_t i) {
    const int64_t len = len_ptr[i / tasks_per_req];
    return len - first_key(len, window) + kTaskOverhead;
  });
  return {per_request, heads_per_task, tasks_per_req, parts, std::move(bounds)};
}

template <typename T, int kD>
void decode(const at::Tensor& q, const at::Tensor& cache, const at::Tensor& tables,
            const at::Tensor& seq_lens, at::Tensor& out, double scale, int64_t window) {
  const int64_t num_reqs = q.size(0), num_q_heads = q.size(1), head_dim = q.size(2);
  const int64_t num_kv_heads = cache.size(2), block_size = cache.size(3);
  const int64_t group = num_q_heads / num_kv_heads;
  const T* q_ptr = q.data_ptr<T>();
  const T* cache_ptr = cache.data_ptr<T>();
  const int64_t* table_ptr = tables.data_ptr<int64_t>();
  const int64_t* len_ptr = seq_lens.data_ptr<int64_t>();
  T* out_ptr = out.data_ptr<T>();
  const int64_t table_stride = tables.size(1);
  const int64_t q_row = q.stride(0), out_row = out.stride(0);  // heads are packed within a row
#if defined(__AVX512F__)
  if constexpr (kD > 0 && kD % 16 == 0) {
    const DecodeSplit split = split_decode(num_reqs, num_kv_heads, len_ptr, window);
    const int64_t heads_per_task = split.heads_per_task, tasks_per_req = split.tasks_per_req;
    const std::vector<int64_t>& bounds = split.bounds;
    // bf16 with AMX, one kv head a task: q . k on the tile unit (scores_tiles), where tiles
    // of 16 keys sit in one block and a group's heads fit one tile's 16 columns. (With all
    // heads in a task, the AVX-512 dot products measured as fast.)
    bool tiles_qk = false;
#if defined(PDSERVE_AMX)
    if constexpr (std::is_same_v<T, c10::BFloat16> && kD % 32 == 0)
      tiles_qk = !split.per_request && group <= 16 && block_size % 16 == 0 && amx_granted();
#endif
    parallel_for(0, split.parts, 1, [&](int64_t part_begin, int64_t part_end) {
      const FlushDenormals flush;
      std::vector<float> work;  // per thread, reused across tasks
      auto run = [&](auto tiles) {
        for (int64_t i = bounds[part_begin]; i < bounds[part_end]; ++i) {
          const int64_t r = i / tasks_per_req, h0 = i % tasks_per_req * heads_per_task;
          const int64_t head = h0 * group * head_dim;
          decode_heads_avx512<T, kD, decltype(tiles)::value>(
              q_ptr + r * q_row + head, cache_ptr, table_ptr + r * table_stride,
              first_key(len_ptr[r], window), len_ptr[r], out_ptr + r * out_row + head, h0,
              h0 + heads_per_task, num_kv_heads, group, block_size, static_cast<float>(scale),
              work);
        }
      };
#if defined(PDSERVE_AMX)
      if constexpr (std::is_same_v<T, c10::BFloat16> && kD % 32 == 0) {
        if (tiles_qk) {
          const DecodeTiles config(static_cast<int>(group));
          return run(std::true_type{});
        }
      }
#endif
      run(std::false_type{});
    });
    (void)tiles_qk;
    return;
  }
#endif
#if defined(PDSERVE_DECODE_AVX2)
  if constexpr (kD > 0 && kD % 8 == 0) {
    // Split as the AVX-512 path (split_decode). (Session 33, benchmarks/decode_attention_cpu.py,
    // SmolLM2's heads: 48 x 450 fp32 1.84 -> 1.63-1.69 ms a call, bf16 1.85-1.90 -> 1.41-1.69;
    // 8 x 2048 bf16 1.21 -> 0.99-1.03.)
    const DecodeSplit split = split_decode(num_reqs, num_kv_heads, len_ptr, window);
    const int64_t heads_per_task = split.heads_per_task, tasks_per_req = split.tasks_per_req;
    const std::vector<int64_t>& bounds = split.bounds;
    parallel_for(0, split.parts, 1, [&](int64_t part_begin, int64_t part_end) {
      const FlushDenormals flush;
      std::vector<float> work;  // per thread, reused across tasks
      for (int64_t i = bounds[part_begin]; i < bounds[part_end]; ++i) {
        const int64_t r = i / tasks_per_req, h0 = i % tasks_per_req * heads_per_task;
        const int64_t head = h0 * group * head_dim;
        decode_heads_avx2<T, kD>(q_ptr + r * q_row + head, cache_ptr, table_ptr + r * table_stride,
                                 first_key(len_ptr[r], window), len_ptr[r],
                                 out_ptr + r * out_row + head, h0, h0 + heads_per_task,
                                 num_kv_heads, group, block_size, static_cast<float>(scale), work);
      }
    });
    return;
  }
#endif
  parallel_for(0, num_reqs * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    const FlushDenormals flush;
    std::vector<float> work;  // per thread, reused across (request, kv head) pairs
    for (int64_t i = begin; i < end; ++i) {
      const int64_t r = i / num_kv_heads, h = i % num_kv_heads;
      const int64_t head = h * group * head_dim;
      decode_one<T, kD>(q_ptr + r * q_row + head, cache_ptr, table_ptr + r * table_stride,
                        first_key(len_ptr[r], window), len_ptr[r], out_ptr + r * out_row + head, h,
                        num_kv_heads, group, block_size, head_dim, static_cast<float>(scale), work);
    }
  });
}

template <typename T>
void decode_dispatch(const at::Tensor& q, const at::Tensor& cache,
                     const at::Tensor& tables, const at::Tensor& seq_lens,
                     at::Tensor& out, double scale, int64_t window) {
  switch (q.size(2)) {  // common head sizes get fully unrolled inner loops
    case 64: return decode<T, 64>(q, cache, tables, seq_lens, out, scale, window);
    case 128: return decode<T, 128>(q, cache, tables, seq_lens, out, scale, window);
    case 32: return decode<T, 32>(q, cache, tables, seq_lens, out, scale, window);
    case 256: return decode<T, 256>(q, cache, tables, seq_lens, out, scale, window);  // Gemma 3
    default: return decode<T, 0>(q, cache, tables, seq_lens, out, scale, window);
  }
}

}  // namespace

// q and out: [num_requests, num_q_heads, head_dim] with packed heads (stride(1) == head_dim,
// stride(2) == 1) and any row stride, e.g. q a view into the fused qkv projection's output and
// out rows of the layer's attention output: no copy on either side. window > 0: a sliding-window
// layer's decode, over the last `window` positions only (window 0: the whole context).
void paged_decode_attention_out(at::Tensor q, at::Tensor cache, at::Tensor tables,
                                at::Tensor seq_lens, double scale, at::Tensor out,
                                int64_t window) {
  TORCH_CHECK(cache.dim() == 5 && q.dim() == 3 && out.dim() == 3, "bad ranks");
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == q.size(2) && out.stride(2) == 1 &&
                  out.stride(1) == out.size(2),
              "q and out need packed heads: stride(1) == head_dim, stride(2) == 1");
  TORCH_CHECK(out.sizes() == q.sizes() && out.scalar_type() == q.scalar_type(),
              "out must match q's shape and dtype");
  TORCH_CHECK(cache.is_contiguous() && tables.is_contiguous() && seq_lens.is_contiguous(),
              "paged_decode_attention needs a contiguous cache, block tables and seq lens");
  TORCH_CHECK(q.scalar_type() == cache.scalar_type(), "q and cache dtypes differ");
  TORCH_CHECK(tables.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kLong,
              "block tables and seq lens must be int64");
  TORCH_CHECK(tables.size(0) == q.size(0) && seq_lens.size(0) == q.size(0),
              "one block table row and one seq len per request");
  TORCH_CHECK(q.size(1) % cache.size(2) == 0, "q heads must be a multiple of kv heads");
  TORCH_CHECK(window >= 0, "window must be >= 0 (0: no sliding window)");
  if (q.scalar_type() == at::kFloat) {
    decode_dispatch<float>(q, cache, tables, seq_lens, out, scale, window);
  } else if (q.scalar_type() == at::kBFloat16) {
    decode_dispatch<c10::BFloat16>(q, cache, tables, seq_lens, out, scale, window);
  } else {
    TORCH_CHECK(false, "paged_decode_attention supports float32 and bfloat16");
  }
}

at::Tensor paged_decode_attention(at::Tensor q, at::Tensor cache, at::Tensor tables,
                                     at::Tensor seq_lens, double scale, int64_t window) {
  TORCH_CHECK(q.dim() == 3, "bad ranks");
  auto out = at::empty(q.sizes(), q.options());
  paged_decode_attention_out(q, cache, tables, seq_lens, scale, out, window);
  return out;
}

// Stores new tokens' K and V ([T, Hkv, D], any row strides, unit stride along D) at their
// slots of one layer's cache: token t goes to block slots[t] / block_size, offset
// slots[t] % block_size. A row copy per (token, head): index_copy_ cost ~60x more for a
// decode batch (its per-row bookkeeping), and nothing here needs the whole-tensor form.
template <typename T>
void store_kv_impl(const at::Tensor& k, const at::Tensor& v, at::Tensor& cache,
                   const at::Tensor& slots) {
  const int64_t tokens = k.size(0), heads = k.size(1), d = k.size(2);
  const int64_t block_size = cache.size(3);
  const int64_t num_slots = cache.size(0) * block_size;
  const int64_t* slot_ptr = slots.data_ptr<int64_t>();
  const T* k_ptr = k.data_ptr<T>();
  const T* v_ptr = v.data_ptr<T>();
  T* cache_ptr = cache.data_ptr<T>();
  const int64_t head_stride = block_size * d, kv_stride = heads * head_stride;
  const int64_t k_tok = k.stride(0), k_head = k.stride(1), v_tok = v.stride(0), v_head = v.stride(1);
  const size_t row_bytes = d * sizeof(T);
  for (int64_t t = 0; t < tokens; ++t) {
    const int64_t s = slot_ptr[t];
    TORCH_CHECK(s >= 0 && s < num_slots, "slot ", s, " outside the cache (", num_slots, " slots)");
    T* dst = cache_ptr + (s / block_size) * 2 * kv_stride + (s % block_size) * d;
    for (int64_t h = 0; h < heads; ++h) {
      std::memcpy(dst + h * head_stride, k_ptr + t * k_tok + h * k_head, row_bytes);
      std::memcpy(dst + kv_stride + h * head_stride, v_ptr + t * v_tok + h * v_head, row_bytes);
    }
  }
}

void store_kv(at::Tensor k, at::Tensor v, at::Tensor cache, at::Tensor slots) {
  TORCH_CHECK(k.dim() == 3 && v.sizes() == k.sizes() && cache.dim() == 5, "bad ranks");
  TORCH_CHECK(k.size(1) == cache.size(2) && k.size(2) == cache.size(4),
              "k/v heads or head_dim differ from the cache's");
  TORCH_CHECK(k.stride(2) == 1 && v.stride(2) == 1 && cache.is_contiguous(),
              "store_kv needs unit stride along head_dim and a contiguous cache");
  TORCH_CHECK(k.scalar_type() == cache.scalar_type() && v.scalar_type() == cache.scalar_type(),
              "k, v and cache dtypes differ");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() &&
                  slots.size(0) == k.size(0),
              "slots must be contiguous int64, one per token");
  if (k.scalar_type() == at::kFloat) {
    store_kv_impl<float>(k, v, cache, slots);
  } else if (k.scalar_type() == at::kBFloat16) {
    store_kv_impl<c10::BFloat16>(k, v, cache, slots);
  } else {
    TORCH_CHECK(false, "store_kv supports float32 and bfloat16");
  }
}
