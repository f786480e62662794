// Paged prefill attention on the CPU: causal attention of every multi-token query of a step
// (plain prefill, a chunk of a chunked prefill, the uncached tail of a prefix-cache hit) over
// its sequence's K/V, read straight out of the paged cache (the step's K/V are stored first,
// by store_kv). One call covers every prefill of the step. FlashAttention's tiling:
//
//   task  = (sequence, kv head, tile of kQueryTile query rows); the query heads of the kv head's
//           group are stacked into one M = group * rows matrix, so each K/V tile is loaded once
//           for the whole group (GQA without repeating K/V);
//   tiles = kKeyTile keys at a time (tile t: positions [64 t, 64 t + 64)), over the keys the
//           task's rows can see only: tiles before the first row's window or past the last
//           row's position are skipped, blocks past the sequence's context never read;
//   pack  = each K/V tile a query can see is packed once per call, read straight from its
//           blocks into the layout the micro-kernels take (K transposed, widened to fp32 or
//           paired for the bf16 dot product; V likewise), and shared by every query tile of
//           the sequence: one pass over the visible K/V, as cheap as the SDPA path's gather,
//           instead of one per query tile;
//   math  = S = Q K^T and O += P V as register-blocked micro-kernels, an online softmax per row
//           (fp32 running max and sum, the fp32 accumulator rescaled when the max grows); the
//           diagonal tile and the window's edge are masked per row.
//
// Tasks are ordered by cost (longest first) and handed out dynamically to torch's threads, so
// one long prompt keeps every core busy. The products, by what the CPU has (fastest first):
//   bf16, AMX, head_dim 64 (SmolLM2, Llama 3.2 1B, Qwen2.5 0.5B): the products transposed
//     (S^T = K Q^T, O^T += V^T P^T) so the softmax is all element-wise, O^T resident in tiles
//     from the first key to the last, a lazily moved max, tasks' blocks walking the keys in
//     128-key chunks together (BlockT64 below: ~2x the layout that follows);
//   bf16, AMX (head_dim % 64 == 0, tile state granted by the OS): both products on the tile
//     unit, P rounded to bf16 as FlashAttention does on GPUs, fp32 sums; the vectorised
//     softmax is then most of the time;
//   bf16, AVX512_BF16 (head_dim % 16 == 0): the bf16 dot-product instruction, same roundings,
//     a chunk of rows at a time through S, softmax and P V while its scores sit in registers
//     (fused_rows below: ~5% faster than the tile-wide layout at 4-8k keys on AMD Zen 5);
//   AVX-512 (fp32, or bf16 without the above): fp32 FMA micro-kernels, Q and K/V widened;
//   elsewhere (or another head_dim): the same tiling with plain loops the compiler vectorises
//     for its target (AVX2 ...).
// fp32 stays fp32 throughout (the engine is token-exact with transformers in fp32).
//
// Layout (engine/attention.py): cache [num_blocks, 2, num_kv_heads, block_size, head_dim];
// q / out [num_tokens, num_q_heads, head_dim] (packed heads, any row stride); sequence s has
// query rows [query_start[s], query_start[s] + query_len[s]) at positions
// [context_len[s] - query_len[s], context_len[s]) and keys at positions [0, context_len[s]) in
// the blocks block_tables[s, :]. Sliding window (window > 0): the query at position p sees
// keys in (p - window, p].
#include <ATen/Parallel.h>
// The ATen headers only (not <torch/extension.h>, which paged_attention.cpp's bindings need):
// ~4 s of headers a file instead of ~27.
#include <ATen/core/Tensor.h>

#include "thread_pool.h"
#include "vec.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

using namespace pdserve_cpu;

constexpr int64_t kQueryTile = 32;  // query rows per task (times the group's heads)
constexpr int64_t kKeyTile = 64;    // keys per K/V tile: S and P rows are 64 wide
constexpr float kNoScore = -1e30f;  // finite: -ffast-math assumes no infinities

// The query rows [q_begin, q_end) (indices within the sequence's chunk) of sequence seq,
// against kv head kv_head.
struct Task {
  int64_t seq, kv_head, q_begin, q_end, cost;
};

// Everything a task reads and writes, shared by the tasks of one call.
template <typename T>
struct Batch {
  const T* q;
  int64_t q_row;
  T* out;
  int64_t out_row;
  const T* cache;
  int64_t num_kv_heads, block_size, head_dim, group;
  const int64_t* query_start;
  const int64_t* query_len;
  const int64_t* context_len;
  const int64_t* tables;
  int64_t table_stride;
  float scale;
  int64_t window;
};

// Half-open key range [lo, hi) the query at position p sees.
inline int64_t first_visible(int64_t p, int64_t window) {
  return window > 0 ? std::max<int64_t>(0, p - window + 1) : 0;
}

// ---- micro-kernels -------------------------------------------------------------------------
// Math element E: float (K packed transposed [D, 64], V [64, D]) or, for the bf16 dot
// product, c10::BFloat16 (K packed in pairs [D/2, 64, 2], V in pairs [32, D, 2], P bf16).
// Q is [M, D] of E; S and P rows are kKeyTile wide; acc is [M, D] fp32.

// Plain loops (any target, any head_dim): S = Q K^T.
inline void scores_plain(const float* q, const float* kt, float* s, int64_t m, int64_t d) {
  for (int64_t r = 0; r < m; ++r) {
    float* row = s + r * kKeyTile;
    std::fill(row, row + kKeyTile, 0.f);
    for (int64_t i = 0; i < d; ++i) {
      const float a = q[r * d + i];
      const float* k = kt + i * kKeyTile;
#pragma omp simd
      for (int64_t j = 0; j < kKeyTile; ++j) row[j] += a * k[j];
    }
  }
}

// Plain loops: acc = acc * rescale + P V over the tile's nk keys.
inline void accumulate_plain(float* acc, const float* rescale, const float* p, const float* v,
                             int64_t m, int64_t d, int64_t nk) {
  for (int64_t r = 0; r < m; ++r) {
    float* a = acc + r * d;
    const float f = rescale[r];
#pragma omp simd
    for (int64_t i = 0; i < d; ++i) a[i] *= f;
    for (int64_t j = 0; j < nk; ++j) {
      const float w = p[r * kKeyTile + j];
      const float* vj = v + j * d;
#pragma omp simd
      for (int64_t i = 0; i < d; ++i) a[i] += w * vj[i];
    }
  }
}

#if defined(__AVX512F__)
// R query rows x 64 keys of S in 4R accumulators (R <= 6), K rows loaded once for R rows.
template <int kD, int R>
inline void scores_rows(const float* q, const float* kt, float* s) {
  __m512 a[R][4];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 4; ++c) a[r][c] = _mm512_setzero_ps();
  for (int i = 0; i < kD; ++i) {
    __m512 k[4];
    for (int c = 0; c < 4; ++c) k[c] = _mm512_loadu_ps(kt + i * kKeyTile + 16 * c);
    for (int r = 0; r < R; ++r) {
      const __m512 b = _mm512_set1_ps(q[r * kD + i]);
      for (int c = 0; c < 4; ++c) a[r][c] = _mm512_fmadd_ps(b, k[c], a[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 4; ++c) _mm512_storeu_ps(s + r * kKeyTile + 16 * c, a[r][c]);
}

#if defined(__AVX512BF16__)
inline __m512bh broadcast_pair(const c10::BFloat16* p) {
  int32_t pair;
  std::memcpy(&pair, p, sizeof(pair));
  return (__m512bh)_mm512_set1_epi32(pair);
}

// bf16: R rows x 64 keys of S into registers a, one dpbf16 per (row, 16 keys, 2 dims); kp is
// [D/2, 64 keys, 2].
template <int kD, int R>
inline void scores_in_registers(const c10::BFloat16* q, const c10::BFloat16* kp,
                                __m512 (&a)[R][4]) {
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 4; ++c) a[r][c] = _mm512_setzero_ps();
  for (int i = 0; i < kD / 2; ++i) {
    __m512bh k[4];
    for (int c = 0; c < 4; ++c)
      k[c] = (__m512bh)_mm512_loadu_si512(kp + i * 2 * kKeyTile + 32 * c);
    for (int r = 0; r < R; ++r) {
      const __m512bh b = broadcast_pair(q + r * kD + 2 * i);
      for (int c = 0; c < 4; ++c) a[r][c] = _mm512_dpbf16_ps(a[r][c], b, k[c]);
    }
  }
}

template <int kD, int R>
inline void scores_rows(const c10::BFloat16* q, const c10::BFloat16* kp, float* s) {
  __m512 a[R][4];
  scores_in_registers<kD, R>(q, kp, a);
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 4; ++c) _mm512_storeu_ps(s + r * kKeyTile + 16 * c, a[r][c]);
}
#endif

// Rows of acc updated at once: R x D/16 accumulators stay in registers (<= 24 of 32).
template <int kD>
constexpr int kAccRows = std::max(1, std::min(6, 24 / (kD / 16)));

// R rows of acc: acc = acc * rescale + P V, each V row slice loaded once for R rows.
template <int kD, int R>
inline void accumulate_rows(float* acc, const float* rescale, const float* p, const float* v,
                            int64_t nk) {
  constexpr int kC = kD / 16;
  __m512 a[R][kC];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < kC; ++c)
      a[r][c] = _mm512_mul_ps(_mm512_loadu_ps(acc + r * kD + 16 * c), _mm512_set1_ps(rescale[r]));
  for (int64_t j = 0; j < nk; ++j) {
    for (int c = 0; c < kC; ++c) {
      const __m512 vj = _mm512_loadu_ps(v + j * kD + 16 * c);
      for (int r = 0; r < R; ++r)
        a[r][c] = _mm512_fmadd_ps(_mm512_set1_ps(p[r * kKeyTile + j]), vj, a[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < kC; ++c) _mm512_storeu_ps(acc + r * kD + 16 * c, a[r][c]);
}

#if defined(__AVX512BF16__)
// bf16: vp is [32 key pairs, D, 2], p rows bf16 (zero past nk, so an odd tail pairs with 0).
template <int kD, int R>
inline void accumulate_rows(float* acc, const float* rescale, const c10::BFloat16* p,
                            const c10::BFloat16* vp, int64_t nk) {
  constexpr int kC = kD / 16;
  __m512 a[R][kC];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < kC; ++c)
      a[r][c] = _mm512_mul_ps(_mm512_loadu_ps(acc + r * kD + 16 * c), _mm512_set1_ps(rescale[r]));
  for (int64_t j = 0; j < (nk + 1) / 2; ++j) {
    for (int c = 0; c < kC; ++c) {
      const __m512bh vj = (__m512bh)_mm512_loadu_si512(vp + j * 2 * kD + 32 * c);
      for (int r = 0; r < R; ++r)
        a[r][c] = _mm512_dpbf16_ps(a[r][c], broadcast_pair(p + r * kKeyTile + 2 * j), vj);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < kC; ++c) _mm512_storeu_ps(acc + r * kD + 16 * c, a[r][c]);
}
#endif

// Runs f.template operator()<R>(row) over rows [0, m) in chunks of kMax, the tail by switch.
template <int kMax, typename F>
inline void row_chunks(int64_t m, F&& f) {
  int64_t r = 0;
  for (; r + kMax <= m; r += kMax) f(std::integral_constant<int, kMax>{}, r);
  switch (m - r) {
    case 0: return;
    case 1: return f(std::integral_constant<int, 1>{}, r);
    case 2: if constexpr (kMax > 2) return f(std::integral_constant<int, 2>{}, r); break;
    case 3: if constexpr (kMax > 3) return f(std::integral_constant<int, 3>{}, r); break;
    case 4: if constexpr (kMax > 4) return f(std::integral_constant<int, 4>{}, r); break;
    case 5: if constexpr (kMax > 5) return f(std::integral_constant<int, 5>{}, r); break;
  }
}
#endif  // __AVX512F__

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
// AVX2 + FMA without AVX-512 (e.g. AMD Zen 3: 16 ymm registers, no bf16 arithmetic, so bf16
// is widened and computed as fp32): the same fp32 micro-kernels on 8-float vectors, a pass
// covering 16 keys (S) or 16 dims (P V) for up to 6 rows: 12 accumulators, the two loaded
// vectors and a row's broadcast in the 16 registers, so each k (or key) costs 2 vector loads
// and 6 broadcasts for 12 FMAs. The first version (32 keys x 3 rows) had no register left for
// the loaded vector, so GCC folded a 256-bit load into every FMA: 15 loads per 12 FMAs, and the
// two load ports, not the FMA units, set its speed (~65% of the FMA peak per core).
constexpr int kAvx2Rows = 6;

template <int kD, int R>
inline void scores_rows_avx2(const float* q, const float* kt, float* s) {
  for (int c0 = 0; c0 < kKeyTile; c0 += 16) {
    rows_x16_fma<R>(
        kD, [](int, __m256& lo, __m256& hi) { lo = hi = _mm256_setzero_ps(); },
        [&](int64_t i, __m256& k0, __m256& k1) {
          k0 = _mm256_loadu_ps(kt + i * kKeyTile + c0);
          k1 = _mm256_loadu_ps(kt + i * kKeyTile + c0 + 8);
        },
        [&](int r, int64_t i) { return q + r * kD + i; },
        [&](int r, __m256 lo, __m256 hi) {
          _mm256_storeu_ps(s + r * kKeyTile + c0, lo);
          _mm256_storeu_ps(s + r * kKeyTile + c0 + 8, hi);
        });
  }
}

template <int kD, int R>
inline void accumulate_rows_avx2(float* acc, const float* rescale, const float* p,
                                 const float* v, int64_t nk) {
  for (int d0 = 0; d0 < kD; d0 += 16) {
    rows_x16_fma<R>(
        nk,
        [&](int r, __m256& lo, __m256& hi) {
          const __m256 f = _mm256_broadcast_ss(rescale + r);
          lo = _mm256_mul_ps(_mm256_loadu_ps(acc + r * kD + d0), f);
          hi = _mm256_mul_ps(_mm256_loadu_ps(acc + r * kD + d0 + 8), f);
        },
        [&](int64_t j, __m256& v0, __m256& v1) {
          v0 = _mm256_loadu_ps(v + j * kD + d0);
          v1 = _mm256_loadu_ps(v + j * kD + d0 + 8);
        },
        [&](int r, int64_t j) { return p + r * kKeyTile + j; },
        [&](int r, __m256 lo, __m256 hi) {
          _mm256_storeu_ps(acc + r * kD + d0, lo);
          _mm256_storeu_ps(acc + r * kD + d0 + 8, hi);
        });
  }
}

// f(std::integral_constant<int, R>, row) over rows [0, m), kAvx2Rows at a time.
template <typename F>
inline void row_chunks_avx2(int64_t m, F&& f) {
  int64_t r = 0;
  for (; r + kAvx2Rows <= m; r += kAvx2Rows) f(std::integral_constant<int, kAvx2Rows>{}, r);
  switch (m - r) {
    case 1: f(std::integral_constant<int, 1>{}, r); break;
    case 2: f(std::integral_constant<int, 2>{}, r); break;
    case 3: f(std::integral_constant<int, 3>{}, r); break;
    case 4: f(std::integral_constant<int, 4>{}, r); break;
    case 5: f(std::integral_constant<int, 5>{}, r); break;
    default: break;
  }
}

template <typename E, int kD>
constexpr bool kAvx2Kernels = std::is_same_v<E, float> && kD > 0 && kD % 16 == 0;
#endif

#if defined(PDSERVE_AMX)
// AMX (bf16, head_dim % 64 == 0, where the OS grants the tile state): both products on the tile
// unit, 16 query rows at a time (M padded to a multiple of 16 with zero rows). Q [M, D] is an A
// operand as it is; the packed K [D/2, 64, 2] and V [32, D, 2] are B operands in the pair
// (VNNI) layout the AVX-512 bf16 path uses too. The fp32 accumulator is loaded into tiles
// for P V (rows are rescaled by AVX-512 first, when their max grew: tiles cannot scale rows).

// S [M, 64] = Q [M, D] K^T; tiles 0-3: S's four 16-key column blocks, 4: Q, 5-6: K.
template <int kD>
void scores_amx(const c10::BFloat16* q, const c10::BFloat16* kp, float* s, int64_t m) {
  constexpr int kRow = 2 * kKeyTile * 2;  // bytes per K pair row
  for (int64_t r = 0; r < m; r += 16) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int t = 0; t < kD / 32; ++t) {
      const c10::BFloat16* k = kp + t * 16 * 2 * kKeyTile;  // dims [32t, 32t + 32)
      _tile_loadd(4, q + r * kD + 32 * t, kD * 2);
      _tile_loadd(5, k, kRow);
      _tile_loadd(6, k + 32, kRow);
      _tile_dpbf16ps(0, 4, 5);
      _tile_dpbf16ps(1, 4, 6);
      _tile_loadd(5, k + 64, kRow);
      _tile_loadd(6, k + 96, kRow);
      _tile_dpbf16ps(2, 4, 5);
      _tile_dpbf16ps(3, 4, 6);
    }
    float* out = s + r * kKeyTile;
    _tile_stored(0, out, kKeyTile * 4);
    _tile_stored(1, out + 16, kKeyTile * 4);
    _tile_stored(2, out + 32, kKeyTile * 4);
    _tile_stored(3, out + 48, kKeyTile * 4);
  }
}

// acc = acc * rescale + P V. The rows whose max grew are rescaled first (AVX-512; after a row's
// first tiles its max rarely moves, and an unchanged max gives a rescale of exactly 1), then P V
// is added on the tiles: tiles 0-3 hold four 16-column blocks of acc, 4: P, 5-6: V.
template <int kD>
void accumulate_amx(float* acc, const float* rescale, const c10::BFloat16* p,
                    const c10::BFloat16* vp, int64_t m, int64_t rows_used, int64_t nk) {
  constexpr int kRow = 2 * kD * 2;  // bytes per V pair row
  const int key_tiles = nk > 32 ? 2 : 1;  // keys past nk have P = 0 and V = 0
  for (int64_t r = 0; r < rows_used; ++r) {
    if (rescale[r] == 1.f) continue;
    const __m512 f = _mm512_set1_ps(rescale[r]);
    for (int c = 0; c < kD / 16; ++c)
      _mm512_storeu_ps(acc + r * kD + 16 * c,
                       _mm512_mul_ps(_mm512_loadu_ps(acc + r * kD + 16 * c), f));
  }
  for (int64_t r = 0; r < m; r += 16) {
    for (int c = 0; c < kD / 16; c += 4) {
      float* out = acc + r * kD + 16 * c;
      _tile_loadd(0, out, kD * 4);
      _tile_loadd(1, out + 16, kD * 4);
      _tile_loadd(2, out + 32, kD * 4);
      _tile_loadd(3, out + 48, kD * 4);
      for (int t = 0; t < key_tiles; ++t) {
        const c10::BFloat16* v = vp + t * 16 * 2 * kD + 32 * c;  // keys [32t, 32t + 32)
        _tile_loadd(4, p + r * kKeyTile + 32 * t, kKeyTile * 2);
        _tile_loadd(5, v, kRow);
        _tile_loadd(6, v + 32, kRow);
        _tile_dpbf16ps(0, 4, 5);
        _tile_dpbf16ps(1, 4, 6);
        _tile_loadd(5, v + 64, kRow);
        _tile_loadd(6, v + 96, kRow);
        _tile_dpbf16ps(2, 4, 5);
        _tile_dpbf16ps(3, 4, 6);
      }
      _tile_stored(0, out, kD * 4);
      _tile_stored(1, out + 16, kD * 4);
      _tile_stored(2, out + 32, kD * 4);
      _tile_stored(3, out + 48, kD * 4);
    }
  }
}
#endif  // PDSERVE_AMX

// Whether head_dim kD takes the AVX-512 micro-kernels (E == bf16 needs AVX512_BF16 too).
template <typename E, int kD>
constexpr bool kVectorKernels =
#if defined(__AVX512F__)
    kD > 0 && kD % 16 == 0 &&
#if defined(__AVX512BF16__)
    true;
#else
    std::is_same_v<E, float>;
#endif
#else
    false;
#endif

template <typename E, int kD>
inline void scores(const E* q, const E* k, float* s, int64_t m, int64_t d) {
#if defined(__AVX512F__)
  if constexpr (kVectorKernels<E, kD>) {
    row_chunks<6>(m, [&](auto rows, int64_t r) {
      scores_rows<kD, decltype(rows)::value>(q + r * kD, k, s + r * kKeyTile);
    });
    return;
  }
#elif defined(__AVX2__) && defined(__FMA__)
  if constexpr (kAvx2Kernels<E, kD>) {
    row_chunks_avx2(m, [&](auto rows, int64_t r) {
      scores_rows_avx2<kD, decltype(rows)::value>(q + r * kD, k, s + r * kKeyTile);
    });
    return;
  }
#endif
  if constexpr (std::is_same_v<E, float>) scores_plain(q, k, s, m, d);
}

template <typename E, int kD>
inline void accumulate(float* acc, const float* rescale, const E* p, const E* v, int64_t m,
                       int64_t d, int64_t nk) {
#if defined(__AVX512F__)
  if constexpr (kVectorKernels<E, kD>) {
    row_chunks<kAccRows<kD>>(m, [&](auto rows, int64_t r) {
      accumulate_rows<kD, decltype(rows)::value>(acc + r * kD, rescale + r, p + r * kKeyTile, v,
                                                 nk);
    });
    return;
  }
#elif defined(__AVX2__) && defined(__FMA__)
  if constexpr (kAvx2Kernels<E, kD>) {
    row_chunks_avx2(m, [&](auto rows, int64_t r) {
      accumulate_rows_avx2<kD, decltype(rows)::value>(acc + r * kD, rescale + r,
                                                      p + r * kKeyTile, v, nk);
    });
    return;
  }
#endif
  if constexpr (std::is_same_v<E, float>) accumulate_plain(acc, rescale, p, v, m, d, nk);
}

// ---- one task ------------------------------------------------------------------------------

// Per-thread buffers, reused across tasks.
template <typename E>
struct Scratch {
  std::vector<E> q, p;  // Q [M, D], P [M, 64] (bf16 only)
  std::vector<float> s, acc;  // S [M, 64], acc [M, D]
  // Per row (arrays padded to whole 16-row groups): the running max and sum, this tile's
  // rescale, new max and (AVX-512) sum vector [M, 16].
  std::vector<float> row_max, row_sum, rescale, new_max, sums;
  void size(int64_t m, int64_t d) {
    const int64_t m16 = (m + 15) / 16 * 16;
    q.resize(m * d);
    p.resize(m * kKeyTile);
    s.resize(m * kKeyTile);
    acc.resize(m * d);
    row_max.assign(m16, kNoScore);
    row_sum.assign(m16, 0.f);
    rescale.resize(m16);
    new_max.assign(m16, kNoScore);
    sums.resize(m16 * 16);
  }
};

#if defined(__AVX512BW__)
// Transposes a 16 x 16 matrix of 32-bit elements in place: r[i] holds row i before, column i
// after (unpack 32- and 64-bit halves within 128-bit lanes, then two 4 x 4 lane shuffles).
inline void transpose16_epi32(__m512i* r) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);  // lane L: a0 b0 a1 b1
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);  // lane L: a2 b2 a3 b3
  }
  __m512i u[16];  // u[i + k], lane L: element 4 L + k of rows i .. i + 3
  for (int i = 0; i < 16; i += 4) {
    u[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    u[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    u[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    u[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int k = 0; k < 4; ++k) {  // lanes L of u[k], u[4 + k], u[8 + k], u[12 + k] -> r[4 L + k]
    const __m512i x0 = _mm512_shuffle_i32x4(u[k], u[4 + k], 0x88);  // A0 A2 B0 B2
    const __m512i x1 = _mm512_shuffle_i32x4(u[k], u[4 + k], 0xDD);  // A1 A3 B1 B3
    const __m512i x2 = _mm512_shuffle_i32x4(u[8 + k], u[12 + k], 0x88);  // C0 C2 D0 D2
    const __m512i x3 = _mm512_shuffle_i32x4(u[8 + k], u[12 + k], 0xDD);  // C1 C3 D1 D3
    r[k] = _mm512_shuffle_i32x4(x0, x2, 0x88);
    r[4 + k] = _mm512_shuffle_i32x4(x1, x3, 0x88);
    r[8 + k] = _mm512_shuffle_i32x4(x0, x2, 0xDD);
    r[12 + k] = _mm512_shuffle_i32x4(x1, x3, 0xDD);
  }
}

// 16 consecutive 32-bit elements at p (a float, or a pair of bf16), as integer bits.
inline __m512i load16_bits(const void* p) { return _mm512_loadu_si512(p); }

// pack_tile's layouts with vector instructions, for head_dim % 32 == 0 (every head_dim the
// vector micro-kernels take): K transposed 16 keys x 16 columns (floats or bf16 pairs) at a
// time, bf16 V interleaved a key pair at a time, float V copied by rows. The scalar loops
// cost ~0.5 us a key of SmolLM2's three kv heads (one bf16 element a store), most of a
// 56-query chunk's attention call. Returns false where it does not apply.
template <typename T, typename E>
bool pack_tile_vector(const T* const* krow_of, const T* const* vrow_of, int64_t nk, int64_t d,
                      E* kp, E* vp) {
  constexpr bool kPairs = !std::is_same_v<E, float>;
  if constexpr (kPairs != std::is_same_v<T, c10::BFloat16>) {
    return false;  // bf16 pairs from a bf16 cache, floats from a float cache only
  } else {
    if (d % 32 != 0) return false;
    // K: kp as 32-bit columns [cols][64 keys], cols = d (float) or d / 2 (bf16 pairs); a
    // key's row holds its cols contiguously.
    const int64_t cols = kPairs ? d / 2 : d;
    uint32_t* k32 = reinterpret_cast<uint32_t*>(kp);
    const __m512i zero = _mm512_setzero_si512();
    for (int64_t kg = 0; kg < kKeyTile; kg += 16) {
      for (int64_t cg = 0; cg < cols; cg += 16) {
        __m512i r[16];
        for (int64_t i = 0; i < 16; ++i)
          r[i] = kg + i < nk ? load16_bits(reinterpret_cast<const uint32_t*>(krow_of[kg + i]) + cg)
                             : zero;
        transpose16_epi32(r);
        for (int64_t c = 0; c < 16; ++c) _mm512_storeu_si512(k32 + (cg + c) * kKeyTile + kg, r[c]);
      }
    }
    if constexpr (kPairs) {
      // V: [32 key pairs][d][2]: keys 2m and 2m + 1 interleaved dim by dim.
      const __m512i lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9,
                                          40, 8, 39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33,
                                          1, 32, 0);
      const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
      for (int64_t m = 0; m < kKeyTile / 2; ++m) {
        E* dst = vp + m * 2 * d;
        for (int64_t c = 0; c < d; c += 32) {
          const __m512i a = 2 * m < nk ? _mm512_loadu_si512(vrow_of[2 * m] + c) : zero;
          const __m512i bv = 2 * m + 1 < nk ? _mm512_loadu_si512(vrow_of[2 * m + 1] + c) : zero;
          _mm512_storeu_si512(dst + 2 * c, _mm512_permutex2var_epi16(a, lo, bv));
          _mm512_storeu_si512(dst + 2 * c + 32, _mm512_permutex2var_epi16(a, hi, bv));
        }
      }
    } else {
      for (int64_t j = 0; j < kKeyTile; ++j) {
        if (j < nk)
          std::memcpy(vp + j * d, vrow_of[j], d * sizeof(E));
        else
          std::fill(vp + j * d, vp + (j + 1) * d, E(0.f));
      }
    }
    return true;
  }
}
#endif

// Packs keys [start, start + nk) of one kv head: K transposed (float: [D, 64]; bf16: [D/2, 64, 2])
// and V (float: [64, D]; bf16: [32, D, 2]), zero past nk. Reads only the blocks holding them.
template <typename T, typename E, bool kKeysByRow = false>
void pack_tile(const Batch<T>& b, const int64_t* table, int64_t kv_head, int64_t start,
               int64_t nk, E* kp, E* vp) {
  const int64_t d = b.head_dim, bs = b.block_size;
  const int64_t head_stride = bs * d, kv_stride = b.num_kv_heads * head_stride;
  constexpr bool kPairs = !std::is_same_v<E, float>;
#if defined(__AVX512BW__)
  if constexpr (!kKeysByRow) {
    const T* krow_of[kKeyTile];
    const T* vrow_of[kKeyTile];
    for (int64_t j = 0; j < nk; ++j) {
      const int64_t pos = start + j;
      krow_of[j] = b.cache + table[pos / bs] * 2 * kv_stride + kv_head * head_stride +
                   pos % bs * d;
      vrow_of[j] = krow_of[j] + kv_stride;
    }
    if (pack_tile_vector<T, E>(krow_of, vrow_of, nk, d, kp, vp)) return;
  }
#endif
  if (!kKeysByRow || nk < kKeyTile) std::fill(kp, kp + kKeyTile * d, E(0.f));
  if (nk < kKeyTile) std::fill(vp, vp + kKeyTile * d, E(0.f));
  for (int64_t j = 0; j < nk;) {
    const int64_t pos = start + j, in_block = pos % bs;
    const int64_t n = std::min(bs - in_block, nk - j);  // rows of this block in the tile
    const T* krows = b.cache + table[pos / bs] * 2 * kv_stride + kv_head * head_stride +
                     in_block * d;
    const T* vrows = krows + kv_stride;
    for (int64_t jj = j; jj < j + n; ++jj, krows += d, vrows += d) {
      if constexpr (kKeysByRow) {  // K as stored [64, D]; V transposed [D, 64]
        std::copy(krows, krows + d, kp + jj * d);
        for (int64_t i = 0; i < d; ++i) vp[i * kKeyTile + jj] = vrows[i];
        continue;
      }
      for (int64_t i = 0; i < d; ++i) {
        if constexpr (kPairs) {
          kp[(i / 2) * 2 * kKeyTile + 2 * jj + (i & 1)] = krows[i];
          vp[(jj / 2) * 2 * d + 2 * i + (jj & 1)] = vrows[i];
        } else {
          kp[i * kKeyTile + jj] = to_float(krows[i]);
          vp[jj * d + i] = to_float(vrows[i]);
        }
      }
    }
    j += n;
  }
}

// The packed K/V tiles of every sequence and kv head a query of the call can see: sequence s's
// tiles [first_tile[s], num_tiles[s]), kv head h's tile t (K then V, each kKeyTile * D) at
// tile_index(s, h, t) * 2 * kKeyTile * D.
template <typename E>
struct PackedKV {
  E* data = nullptr;  // the calling thread's pack buffer (pack_buffer), or owned's
  std::vector<E> owned;  // the tiles of a call too large to keep a buffer for
  std::vector<int64_t> first_tile, num_tiles, base;  // base: index of (s, head 0, first tile)
  int64_t num_kv_heads = 0, head_dim = 0;
  int64_t tile_index(int64_t s, int64_t h, int64_t t) const {
    return base[s] + h * (num_tiles[s] - first_tile[s]) + t - first_tile[s];
  }
  const E* k(int64_t s, int64_t h, int64_t t) const {
    return data + tile_index(s, h, t) * 2 * kKeyTile * head_dim;
  }
};

// The calling thread's buffer for packed tiles, kept from call to call at its largest size up
// to kKeptPackBytes (one 8k-token prompt of 3 kv heads of 64 dims: 6 MiB): a fresh allocation
// each call (196 KiB for a 56-token chunk over 224 keys of SmolLM2) came from mmap, zeroed and
// faulted in page by page, then unmapped, ~40 us of that call's ~80 (AMD Zen 4, bf16).
// pack_tile writes every element of the tiles it packs, so reused contents never leak into a
// result. Null where n is larger: the call then owns its tiles.
constexpr int64_t kKeptPackBytes = 32 << 20;
template <typename E>
E* pack_buffer(int64_t n) {
  if (n * static_cast<int64_t>(sizeof(E)) > kKeptPackBytes) return nullptr;
  thread_local std::vector<E> buffer;
  if (static_cast<int64_t>(buffer.size()) < n) buffer.resize(n);
  return buffer.data();
}

template <typename T, typename E, bool kKeysByRow = false>
PackedKV<E> pack_visible(const Batch<T>& b, int64_t num_seqs) {
  PackedKV<E> kv;
  kv.num_kv_heads = b.num_kv_heads, kv.head_dim = b.head_dim;
  int64_t total = 0;
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t first_query = b.context_len[s] - b.query_len[s];
    kv.first_tile.push_back(first_visible(first_query, b.window) / kKeyTile);
    kv.num_tiles.push_back((b.context_len[s] + kKeyTile - 1) / kKeyTile);
    kv.base.push_back(total);
    total += b.num_kv_heads * (kv.num_tiles[s] - kv.first_tile[s]);
  }
  kv.data = pack_buffer<E>(total * 2 * kKeyTile * b.head_dim);
  if (kv.data == nullptr) {
    kv.owned.resize(total * 2 * kKeyTile * b.head_dim);
    kv.data = kv.owned.data();
  }
  parallel_for(0, total, 16, [&](int64_t begin, int64_t end) {
    int64_t s = std::upper_bound(kv.base.begin(), kv.base.end(), begin) - kv.base.begin() - 1;
    for (int64_t i = begin; i < end; ++i) {
      while (s + 1 < num_seqs && kv.base[s + 1] <= i) ++s;
      const int64_t per_head = kv.num_tiles[s] - kv.first_tile[s];
      const int64_t h = (i - kv.base[s]) / per_head, t = kv.first_tile[s] + (i - kv.base[s]) % per_head;
      const int64_t start = t * kKeyTile, nk = std::min(kKeyTile, b.context_len[s] - start);
      E* kp = kv.data + i * 2 * kKeyTile * b.head_dim;
      pack_tile<T, E, kKeysByRow>(b, b.tables + s * b.table_stride, h, start, nk, kp,
                                  kp + kKeyTile * b.head_dim);
    }
  });
  return kv;
}

#if defined(__AVX512F__)
// exp(x) for x <= 0 in the masked lanes (0 elsewhere, whatever x holds there), accurate to
// ~4e-5 relative: enough for P rounded to bf16 (2^-9), with about half exp16's instructions
// (no clamping, a degree-4 polynomial of 2^f on [-1/2, 1/2]).
inline __m512 exp16_for_bf16(__m512 x, __mmask16 lanes) {
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));  // log2(e) x
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(9.6181291e-3f);  // ln(2)^k / k!
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504109e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022651e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  return _mm512_maskz_scalef_ps(lanes, p, n);
}

// 2^t on the masked lanes (0 elsewhere): a degree-3 polynomial of 2^f on [-1/2, 1/2], 8e-5
// relative (P is then rounded to bf16, 2^-9); t <= 8 on the transposed AMX path (kLazyLog2
// below), t <= 0 on the fused one.
inline __m512 exp2_lanes(__m512 t, __mmask16 lanes) {
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(5.5088684e-2f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4260405e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9327623e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.9992895e-1f));
  return _mm512_maskz_scalef_ps(lanes, p, n);
}

// Stores 16 probabilities into a P row: as they are (float), or rounded to bf16.
inline void store_p(float* dst, __m512 v) { _mm512_storeu_ps(dst, v); }
inline void store_p(c10::BFloat16* dst, __m512 v) {
#if defined(__AVX512BF16__)
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), (__m256i)_mm512_cvtneps_pbh(v));
#else
  for (int i = 0; i < 16; ++i) dst[i] = static_cast<c10::BFloat16>(reinterpret_cast<float*>(&v)[i]);
#endif
}
#endif

// Half-open range [lo, hi) of a tile's keys (tile-relative) the query at position pos sees.
inline std::pair<int64_t, int64_t> visible_in_tile(int64_t pos, int64_t start, int64_t nk,
                                                   int64_t window) {
  return {std::max<int64_t>(0, first_visible(pos, window) - start),
          std::min<int64_t>(nk, pos + 1 - start)};
}

// Online softmax of one tile's scores s into P (p: s itself for float, bf16 rows otherwise).
// Row r = g * rows + i is query row i (at position p0 + i) of group head g and sees the tile's
// keys visible_in_tile(p0 + i); its P row is exp(s - max) there and 0 elsewhere. Updates the
// rows' running max and sum, and sets rescale[r], the factor the row's accumulator takes
// before this tile's P V is added (~0 on a row's first tile: row_max is kNoScore; 1 on a tile
// the row does not see).
template <typename E>
void softmax_tile(float* s, E* p, Scratch<E>& w, int64_t group, int64_t rows, int64_t p0,
                  int64_t start, int64_t nk, int64_t window, float score_scale) {
  float* row_max = w.row_max.data();
  float* row_sum = w.row_sum.data();
  float* rescale = w.rescale.data();
  const int64_t m = group * rows;
#if defined(__AVX512F__)
  // Per row: the max (one horizontal reduction) and the exps; the sums stay vectors (sums[r])
  // and the rows' rescales and sums are then updated 16 rows at a time.
  float* new_max = w.new_max.data();
  float* sums = w.sums.data();
  for (int64_t i = 0; i < rows; ++i) {
    const auto [lo, hi] = visible_in_tile(p0 + i, start, nk, window);
    for (int64_t g = 0; g < group; ++g) {
      const int64_t r = g * rows + i;
      float* sr = s + r * kKeyTile;
      __m512 sum = _mm512_setzero_ps();
      if (lo >= hi) {
        new_max[r] = row_max[r];
        for (int c = 0; c < 4; ++c) store_p(p + r * kKeyTile + 16 * c, sum);
      } else {
        const uint64_t visible = (hi - lo == 64 ? ~0ull : ((1ull << (hi - lo)) - 1)) << lo;
        __m512 x[4];
        __m512 top = _mm512_set1_ps(row_max[r]);
        for (int c = 0; c < 4; ++c) {
          x[c] = _mm512_mul_ps(_mm512_loadu_ps(sr + 16 * c), _mm512_set1_ps(score_scale));
          top = _mm512_mask_max_ps(top, static_cast<__mmask16>(visible >> (16 * c)), top, x[c]);
        }
        const __m512 mx = _mm512_set1_ps(_mm512_reduce_max_ps(top));
        for (int c = 0; c < 4; ++c) {
          const __mmask16 lanes = static_cast<__mmask16>(visible >> (16 * c));
          const __m512 e = std::is_same_v<E, float>
                               ? _mm512_maskz_mov_ps(lanes, exp16(_mm512_sub_ps(x[c], mx)))
                               : exp16_for_bf16(_mm512_sub_ps(x[c], mx), lanes);
          store_p(p + r * kKeyTile + 16 * c, e);
          sum = _mm512_add_ps(sum, e);
        }
        new_max[r] = _mm512_cvtss_f32(mx);
      }
      _mm512_storeu_ps(sums + 16 * r, sum);
    }
  }
  for (int64_t r = 0; r < m; r += 16) {  // the arrays are padded to whole 16-row groups
    const __m512 old_max = _mm512_loadu_ps(row_max + r), top = _mm512_loadu_ps(new_max + r);
    const __m512 f = exp16(_mm512_sub_ps(old_max, top));
    __m512 tile_sums[16];
    for (int j = 0; j < 16; ++j) tile_sums[j] = _mm512_loadu_ps(sums + 16 * (r + j));
    _mm512_storeu_ps(rescale + r, f);
    _mm512_storeu_ps(row_sum + r, _mm512_fmadd_ps(_mm512_loadu_ps(row_sum + r), f,
                                                  reduce16(tile_sums)));
    _mm512_storeu_ps(row_max + r, top);
  }
#elif defined(__AVX2__) && defined(__FMA__)
  // Per row: the visible lanes' max, their exps (exp8; the rest 0), the sum; 8 vectors a row.
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256 scale = _mm256_set1_ps(score_scale);
  for (int64_t r = 0; r < m; ++r) {
    const auto [lo, hi] = visible_in_tile(p0 + r % rows, start, nk, window);
    float* sr = s + r * kKeyTile;
    if (lo >= hi) {
      rescale[r] = 1.f;
      std::fill(sr, sr + kKeyTile, 0.f);
      continue;
    }
    __m256 x[kKeyTile / 8];
    __m256 top = _mm256_set1_ps(row_max[r]);
    __m256 sum = _mm256_setzero_ps();
    if (lo == 0 && hi == kKeyTile) {  // every key visible: most tiles of a long prompt
      for (int c = 0; c < kKeyTile / 8; ++c) {
        x[c] = _mm256_mul_ps(_mm256_loadu_ps(sr + 8 * c), scale);
        top = _mm256_max_ps(top, x[c]);
      }
      const __m256 mxv = _mm256_set1_ps(hmax8(top));
      for (int c = 0; c < kKeyTile / 8; ++c) {
        const __m256 e = exp8(_mm256_sub_ps(x[c], mxv));
        _mm256_storeu_ps(sr + 8 * c, e);
        sum = _mm256_add_ps(sum, e);
      }
    } else {
      const __m256i below = _mm256_set1_epi32(static_cast<int>(lo) - 1);
      const __m256i end = _mm256_set1_epi32(static_cast<int>(hi));
      __m256 visible[kKeyTile / 8];
      for (int c = 0; c < kKeyTile / 8; ++c) {
        const __m256i j = _mm256_add_epi32(lane, _mm256_set1_epi32(8 * c));
        visible[c] = _mm256_castsi256_ps(
            _mm256_and_si256(_mm256_cmpgt_epi32(j, below), _mm256_cmpgt_epi32(end, j)));
        x[c] = _mm256_mul_ps(_mm256_loadu_ps(sr + 8 * c), scale);
        top = _mm256_max_ps(top, _mm256_blendv_ps(_mm256_set1_ps(kNoScore), x[c], visible[c]));
      }
      const __m256 mxv = _mm256_set1_ps(hmax8(top));
      for (int c = 0; c < kKeyTile / 8; ++c) {
        const __m256 e = _mm256_and_ps(exp8(_mm256_sub_ps(x[c], mxv)), visible[c]);
        _mm256_storeu_ps(sr + 8 * c, e);
        sum = _mm256_add_ps(sum, e);
      }
    }
    const float mx = hmax8(top);
    rescale[r] = expf(row_max[r] - mx);
    row_sum[r] = row_sum[r] * rescale[r] + hsum8(sum);
    row_max[r] = mx;
  }
  if constexpr (!std::is_same_v<E, float>)
    for (int64_t j = 0; j < m * kKeyTile; ++j) p[j] = static_cast<E>(s[j]);
#else
  for (int64_t r = 0; r < m; ++r) {
    const auto [lo, hi] = visible_in_tile(p0 + r % rows, start, nk, window);
    float* sr = s + r * kKeyTile;
    if (lo >= hi) {
      rescale[r] = 1.f;
      std::fill(sr, sr + kKeyTile, 0.f);
      continue;
    }
    float mx = row_max[r];
    for (int64_t j = lo; j < hi; ++j) mx = std::max(mx, sr[j] * score_scale);
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t j = 0; j < kKeyTile; ++j) {
      const float e = expf(sr[j] * score_scale - mx);  // libmvec under -ffast-math
      sr[j] = (j >= lo && j < hi) ? e : 0.f;
      sum += sr[j];
    }
    rescale[r] = expf(row_max[r] - mx);
    row_sum[r] = row_sum[r] * rescale[r] + sum;
    row_max[r] = mx;
  }
  if constexpr (!std::is_same_v<E, float>)
    for (int64_t j = 0; j < m * kKeyTile; ++j) p[j] = static_cast<E>(s[j]);
#endif
}

#if defined(__AVX512BF16__)
// ---- bf16, AVX512_BF16: one row chunk's S, softmax and P V in one pass ----------------------
// The layout above stores a tile's S for every row of the task (M x 64 floats), reads it back
// for the softmax and once more as P: with the task's accumulator and the K/V tile ~76 KiB a
// tile, past a 48 KiB L1. Here R rows (kAccRows: 6 at head_dim 64) go through all three
// while their scores are still in registers: S = Q K^T into 4R accumulators, the softmax on
// them (max in raw scores, exps in base 2 with the scale and log2(e) folded into one FMA), P
// as bf16 into an R x 64 buffer, then acc = acc * rescale + P V for the same R rows.
// A row's sum of exps stays a 16-lane vector (Scratch::sums) until the end: no horizontal sum a
// tile. A row's max moves only when a tile's max exceeds it, so its rescale (a scalar exp2)
// is computed on those tiles alone. Same products and roundings as the layout above (P
// rounded to bf16, fp32 sums). AMD Zen 5, SmolLM2's heads, 2 threads, alternating builds: 8192
// tokens 107.0 / 106.2 -> 102.0 / 100.4 ms, 4096 28.7 / 27.0 -> 26.1 / 26.2, 1024 the same.

// Rows [r0, r0 + R) of the task (row r = g * rows + i at position p0 + i) against one tile.
// The rows' running state, in the task's Scratch: ref, the max in log2 units (score * scale *
// log2 e; kNoScore before the row's first key), and sums, the sum of exps as 16 lanes a row.
template <int kD, int R>
inline void fused_rows(const c10::BFloat16* q, const c10::BFloat16* kp, const c10::BFloat16* vp,
                       float* acc, float* ref_of, float* sums_of, int64_t r0, int64_t rows,
                       int64_t p0, int64_t start, int64_t nk, int64_t window, float c) {
  __m512 a[R][4];
  scores_in_registers<kD, R>(q, kp, a);
  alignas(64) c10::BFloat16 p[R][kKeyTile];
  float rescale[R];
  for (int r = 0; r < R; ++r) {
    const int64_t row = r0 + r;
    const auto [lo, hi] = visible_in_tile(p0 + row % rows, start, nk, window);
    rescale[r] = 1.f;
    if (lo >= hi) {
      for (int j = 0; j < 4; ++j) store_p(p[r] + 16 * j, _mm512_setzero_ps());
      continue;
    }
    const uint64_t visible = (hi - lo == 64 ? ~0ull : ((1ull << (hi - lo)) - 1)) << lo;
    __m512 top = _mm512_set1_ps(kNoScore);
    for (int j = 0; j < 4; ++j)
      top = _mm512_mask_max_ps(top, static_cast<__mmask16>(visible >> (16 * j)), top, a[r][j]);
    const float tile_ref = _mm512_reduce_max_ps(top) * c;
    float& ref = ref_of[row];
    if (tile_ref > ref) {
      rescale[r] = std::exp2(ref - tile_ref);  // 0 on the row's first tile (ref = kNoScore)
      ref = tile_ref;
    }
    const __m512 cv = _mm512_set1_ps(c), refv = _mm512_set1_ps(ref);
    __m512 sum = _mm512_setzero_ps();
    for (int j = 0; j < 4; ++j) {
      const __m512 e = exp2_lanes(_mm512_fmsub_ps(a[r][j], cv, refv),
                                     static_cast<__mmask16>(visible >> (16 * j)));
      store_p(p[r] + 16 * j, e);
      sum = _mm512_add_ps(sum, e);
    }
    float* sums = sums_of + 16 * row;
    _mm512_storeu_ps(sums, _mm512_fmadd_ps(_mm512_loadu_ps(sums), _mm512_set1_ps(rescale[r]), sum));
  }
  accumulate_rows<kD, R>(acc, rescale, p[0], vp, nk);
}

// Whether head_dim kD takes the fused path (R rows' scores in 4R of the 32 registers).
template <typename E, int kD>
constexpr bool kFused = std::is_same_v<E, c10::BFloat16> && kD > 0 && kD % 16 == 0 &&
                        4 * kAccRows<(kD > 0 ? kD : 16)> <= 24;
#endif  // __AVX512BF16__
#if defined(PDSERVE_AMX)
// ---- AMX, head_dim 64, transposed: S^T = K Q^T and O^T += V^T P^T ---------------------------
// 16 query rows (consecutive positions of one query head) at a time, over all their keys,
// 32 keys a step, with O^T [64 dims, 16 rows] resident in tiles 0-3 from the first key to the
// last. Transposing the products makes every softmax operation vertical: a zmm holds one key's
// scores for the 16 rows, so the rows' maxima, exps and sums are element-wise (no horizontal
// reductions, no per-row loops), and P^T comes out of the exps already in the B-operand layout
// (key pairs interleaved). The running max is updated lazily (as FlashAttention-4 does): a
// row's exps are taken against a reference max that moves only when a score exceeds it by
// more than 2^kLazyLog2, so after a row's first keys the accumulator tiles are almost never
// stored, rescaled and reloaded. Tiles: 0-3 O^T, 4-5 S^T (two 16-key halves), 6 K or V^T
// (A operands), 7 Q^T or P^T (B operands). K is packed as stored ([64 keys, 64]) and V
// transposed ([64 dims, 64 keys]), both A operands.
constexpr float kLazyLog2 = 8.f;  // P <= 2^8 between rescales: exact in fp32 sums, bf16 P

// Lanes r (rows at positions first_pos + r) that see the key at position key.
inline __mmask16 rows_seeing(int64_t key, int64_t first_pos, int64_t window) {
  const int64_t from = key - first_pos;  // causal: rows r >= from
  uint32_t m = from <= 0 ? 0xFFFFu : from >= 16 ? 0u : (0xFFFFu << from) & 0xFFFFu;
  if (window > 0) {  // and rows r < from + window
    const int64_t to = from + window;
    m &= to >= 16 ? 0xFFFFu : to <= 0 ? 0u : (1u << to) - 1;
  }
  return static_cast<__mmask16>(m);
}

// S^T [32 keys, 16 rows] = K Q^T of the 32 keys at k (packed [keys, 64]) into st, on tiles
// 4-5 (accumulators), 6 (K) and 7 (Q^T pairs qt).
inline void scores_t64(const c10::BFloat16* k, const uint32_t* qt, float* st) {
  constexpr int kRow = 64 * 2;
  _tile_zero(4);
  _tile_zero(5);
  _tile_loadd(7, qt, 64);
  _tile_loadd(6, k, kRow);
  _tile_dpbf16ps(4, 6, 7);
  _tile_loadd(6, k + 16 * 64, kRow);
  _tile_dpbf16ps(5, 6, 7);
  _tile_loadd(7, qt + 256, 64);
  _tile_loadd(6, k + 32, kRow);
  _tile_dpbf16ps(4, 6, 7);
  _tile_loadd(6, k + 16 * 64 + 32, kRow);
  _tile_dpbf16ps(5, 6, 7);
  _tile_stored(4, st, 64);
  _tile_stored(5, st + 256, 64);
}

// One block of 16 query rows (consecutive positions of one query head) and its state between
// key chunks: Q^T in the B-operand pair layout, O^T spilled from its tiles, the rows'
// reference max (log2 units; exps are taken against it) and sum of exps.
struct BlockT64 {
  alignas(64) uint32_t qt[2 * 16 * 16];  // [2 dim halves][16 dim pairs][16 rows]
  alignas(64) float ot[64 * 16];         // [64 dims][16 rows]
  alignas(64) float ref[16], sum[16];
  int64_t head, first_token, first_pos, nr;
  bool live;  // whether O^T holds anything yet

  template <typename T>
  void start(const Batch<T>& b, int64_t head_, int64_t first_token_, int64_t first_pos_,
             int64_t nr_) {
    head = head_, first_token = first_token_, first_pos = first_pos_, nr = nr_, live = false;
    std::memset(qt, 0, sizeof(qt));
    for (int64_t r = 0; r < nr; ++r) {
      const uint32_t* src =
          reinterpret_cast<const uint32_t*>(b.q + (first_token + r) * b.q_row + head * 64);
      for (int64_t dp = 0; dp < 32; ++dp) qt[(dp / 16) * 256 + (dp % 16) * 16 + r] = src[dp];
    }
    std::fill(ref, ref + 16, kNoScore);
    std::fill(sum, sum + 16, 0.f);
  }

  // Writes the rows' outputs (O / sum).
  template <typename T>
  void finish(const Batch<T>& b) const {
    for (int64_t r = 0; r < nr; ++r) {
      const float inv = 1.f / sum[r];  // > 0: every row sees its own position
      T* dst = b.out + (first_token + r) * b.out_row + head * 64;
      for (int64_t x = 0; x < 64; ++x) dst[x] = static_cast<T>(ot[16 * x + r] * inv);
    }
  }

  inline void spill() {
    _tile_stored(0, ot, 64);
    _tile_stored(1, ot + 256, 64);
    _tile_stored(2, ot + 512, 64);
    _tile_stored(3, ot + 768, 64);
  }
  inline void fill() {
    _tile_loadd(0, ot, 64);
    _tile_loadd(1, ot + 256, 64);
    _tile_loadd(2, ot + 512, 64);
    _tile_loadd(3, ot + 768, 64);
  }

  // Attends to the keys in [from, to) (multiples of 32) the rows see. The steps are
  // software-pipelined: step i + 1's scores are issued before step i's softmax, so the tile
  // unit and the vector units overlap.
  template <typename T>
  void advance(const Batch<T>& b, const PackedKV<c10::BFloat16>& kv, int64_t seq,
               int64_t kv_head, int64_t from, int64_t to) {
    const int64_t last_pos = first_pos + nr - 1;
    const int64_t begin = std::max(from, first_visible(first_pos, b.window) / 32 * 32);
    const int64_t end = std::min(to, last_pos + 1);
    if (begin >= end) return;
    alignas(64) float st[2][32 * 16];  // S^T of two steps: [32 keys][16 rows]
    alignas(64) uint32_t pt[16 * 16];  // P^T pairs: [16 key pairs][16 rows]
    const __m512 cv = _mm512_set1_ps(b.scale * 1.44269504088896341f);  // scores -> log2 units
    const __m512i interleave = _mm512_set_epi16(
        31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6, 21, 5, 20,
        4, 19, 3, 18, 2, 17, 1, 16, 0);
    auto tile = [&](int64_t key0) { return kv.k(seq, kv_head, key0 / kKeyTile); };
    __m512 rv = _mm512_load_ps(ref), sv = _mm512_load_ps(sum);
    if (live) {
      fill();
    } else {
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
    }
    scores_t64(tile(begin) + begin % kKeyTile * 64, qt, st[0]);
    for (int64_t key0 = begin, i = 0; key0 < end; key0 += 32, ++i) {
      if (key0 + 32 < end) scores_t64(tile(key0 + 32) + (key0 + 32) % kKeyTile * 64, qt,
                                      st[(i + 1) & 1]);
      const float* sc = st[i & 1];
      // Which rows see which of the 32 keys: all of them away from the diagonal and window.
      const bool all = key0 + 31 <= first_pos &&
                       (b.window == 0 || key0 >= first_visible(last_pos, b.window));
      __mmask16 seen[32];
      __m512 top = _mm512_set1_ps(kNoScore);
      for (int j = 0; j < 32; ++j) {
        seen[j] = all ? __mmask16(0xFFFF) : rows_seeing(key0 + j, first_pos, b.window);
        top = _mm512_mask_max_ps(top, seen[j], top, _mm512_load_ps(sc + 16 * j));
      }
      top = _mm512_mul_ps(top, cv);  // c > 0
      const __mmask16 grow =
          _mm512_cmp_ps_mask(top, _mm512_add_ps(rv, _mm512_set1_ps(kLazyLog2)), _CMP_GT_OQ);
      if (grow) {  // these rows' reference max moves up to this step's max
        const __m512 moved = _mm512_mask_mov_ps(rv, grow, top);
        const __m512 factor = _mm512_mask_mov_ps(_mm512_set1_ps(1.f), grow,
                                                 exp2_lanes(_mm512_sub_ps(rv, moved), grow));
        sv = _mm512_mul_ps(sv, factor);
        rv = moved;
        if (live) {
          spill();
          for (int64_t x = 0; x < 64; ++x)
            _mm512_store_ps(ot + 16 * x, _mm512_mul_ps(_mm512_load_ps(ot + 16 * x), factor));
          fill();
        }
      }
      __m512 sums[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
      for (int j = 0; j < 32; j += 2) {
        const __m512 e0 =
            exp2_lanes(_mm512_fmsub_ps(_mm512_load_ps(sc + 16 * j), cv, rv), seen[j]);
        const __m512 e1 =
            exp2_lanes(_mm512_fmsub_ps(_mm512_load_ps(sc + 16 * j + 16), cv, rv), seen[j + 1]);
        sums[0] = _mm512_add_ps(sums[0], e0);
        sums[1] = _mm512_add_ps(sums[1], e1);
        _mm512_store_si512(pt + 8 * j, _mm512_permutexvar_epi16(
                                           interleave, (__m512i)_mm512_cvtne2ps_pbh(e1, e0)));
      }
      sv = _mm512_add_ps(sv, _mm512_add_ps(sums[0], sums[1]));
      // O^T += V^T P^T. (Tiles are not renamed: the V^T loads rotate over 6, 4 and 5, free
      // once the scores are stored, so a load need not wait for the product reading the last.)
      const c10::BFloat16* vt = tile(key0) + kKeyTile * 64 + key0 % kKeyTile;
      constexpr int kRow = kKeyTile * 2;
      _tile_loadd(7, pt, 64);
      _tile_loadd(6, vt, kRow);
      _tile_loadd(4, vt + 16 * kKeyTile, kRow);
      _tile_dpbf16ps(0, 6, 7);
      _tile_loadd(5, vt + 32 * kKeyTile, kRow);
      _tile_dpbf16ps(1, 4, 7);
      _tile_loadd(6, vt + 48 * kKeyTile, kRow);
      _tile_dpbf16ps(2, 5, 7);
      _tile_dpbf16ps(3, 6, 7);
      live = true;
    }
    spill();
    _mm512_store_ps(ref, rv);
    _mm512_store_ps(sum, sv);
  }
};

// The task's blocks (16 rows of one query head each) walk the keys together, a chunk of
// kKeyChunk keys at a time: a chunk's K/V (32 KiB) is read from memory once and then from
// the core's caches by every block of the task (FlashAttention keeps a K/V tile in shared
// memory the same way), instead of each block streaming the whole context.
constexpr int64_t kKeyChunk = 128;
constexpr int64_t kQueryTileT64 = 128;  // query rows per task on this path (64: 5% slower at 8k)

template <typename T>
void run_task_t64(const Batch<T>& b, const PackedKV<c10::BFloat16>& kv, const Task& t,
                  std::vector<BlockT64>& blocks) {
  const int64_t qlen = b.query_len[t.seq], ctx = b.context_len[t.seq];
  const int64_t first_pos = ctx - qlen + t.q_begin, last_pos = ctx - qlen + t.q_end - 1;
  blocks.resize(b.group * ((t.q_end - t.q_begin + 15) / 16));
  int64_t n = 0;
  for (int64_t g = 0; g < b.group; ++g)
    for (int64_t i = t.q_begin; i < t.q_end; i += 16)
      blocks[n++].start(b, t.kv_head * b.group + g, b.query_start[t.seq] + i, ctx - qlen + i,
                        std::min<int64_t>(16, t.q_end - i));
  for (int64_t from = first_visible(first_pos, b.window) / kKeyChunk * kKeyChunk;
       from <= last_pos; from += kKeyChunk)
    for (BlockT64& block : blocks) block.advance(b, kv, t.seq, t.kv_head, from, from + kKeyChunk);
  for (const BlockT64& block : blocks) block.finish(b);
}
#endif  // PDSERVE_AMX

template <typename T, typename E, int kD, bool kAmx>
void run_task(const Batch<T>& b, const PackedKV<E>& kv, const Task& t, Scratch<E>& w) {
  const int64_t d = kD > 0 ? kD : b.head_dim, group = b.group;
  const int64_t rows = t.q_end - t.q_begin, m = group * rows;  // M: row g * rows + i
  const int64_t m_tiles = kAmx ? (m + 15) / 16 * 16 : m;  // AMX: whole 16-row tiles, zero-padded
  const int64_t qlen = b.query_len[t.seq], ctx = b.context_len[t.seq];
  const int64_t p0 = ctx - qlen + t.q_begin;  // position of the task's first query row
  const int64_t first_token = b.query_start[t.seq] + t.q_begin;
  const int64_t first_head = t.kv_head * group;
  constexpr bool kFloat = std::is_same_v<E, float>;
  // bf16 products take Q as stored (scaling it would round it again); float Q is pre-scaled.
  const float q_scale = kFloat ? b.scale : 1.f, score_scale = kFloat ? 1.f : b.scale;
  w.size(m_tiles, d);
  std::fill(w.q.begin() + m * d, w.q.end(), E(0.f));  // the padding rows (AMX), never written
  std::fill(w.p.begin() + m * kKeyTile, w.p.end(), E(0.f));
  for (int64_t g = 0; g < group; ++g)
    for (int64_t i = 0; i < rows; ++i) {
      const T* src = b.q + (first_token + i) * b.q_row + (first_head + g) * d;
      E* dst = w.q.data() + (g * rows + i) * d;
      for (int64_t x = 0; x < d; ++x) {
        if constexpr (kFloat) dst[x] = to_float(src[x]) * q_scale;
        else dst[x] = src[x];
      }
    }
  std::fill(w.acc.begin(), w.acc.end(), 0.f);
  const int64_t key_end = p0 + rows;  // past the last row's position
#if defined(__AVX512BF16__)
  if constexpr (!kAmx && kFused<E, kD>) {
    float* ref = w.row_max.data();  // kNoScore from w.size
    std::fill(w.sums.begin(), w.sums.end(), 0.f);
    const float c = b.scale * 1.44269504088896341f;  // scores to log2 units
    for (int64_t tile = first_visible(p0, b.window) / kKeyTile; tile * kKeyTile < key_end;
         ++tile) {
      const int64_t start = tile * kKeyTile, nk = std::min(kKeyTile, key_end - start);
      const E* k = kv.k(t.seq, t.kv_head, tile);
      row_chunks<kAccRows<kD>>(m, [&](auto n, int64_t r) {
        fused_rows<kD, decltype(n)::value>(w.q.data() + r * kD, k, k + kKeyTile * kD,
                                           w.acc.data() + r * kD, ref, w.sums.data(), r, rows,
                                           p0, start, nk, b.window, c);
      });
    }
    for (int64_t r = 0; r < m; ++r)
      w.row_sum[r] = _mm512_reduce_add_ps(_mm512_loadu_ps(w.sums.data() + 16 * r));
  } else
#endif
  {
    E* p = kFloat ? reinterpret_cast<E*>(w.s.data()) : w.p.data();
    for (int64_t tile = first_visible(p0, b.window) / kKeyTile; tile * kKeyTile < key_end;
         ++tile) {
      const int64_t start = tile * kKeyTile, nk = std::min(kKeyTile, key_end - start);
      const E* k = kv.k(t.seq, t.kv_head, tile);
      const E* v = k + kKeyTile * d;
#if defined(PDSERVE_AMX)
      if constexpr (kAmx) scores_amx<kD>(w.q.data(), k, w.s.data(), m_tiles);
#endif
      if constexpr (!kAmx) scores<E, kD>(w.q.data(), k, w.s.data(), m, d);
      softmax_tile(w.s.data(), p, w, group, rows, p0, start, nk, b.window, score_scale);
#if defined(PDSERVE_AMX)
      if constexpr (kAmx)
        accumulate_amx<kD>(w.acc.data(), w.rescale.data(), p, v, m_tiles, m, nk);
#endif
      if constexpr (!kAmx) accumulate<E, kD>(w.acc.data(), w.rescale.data(), p, v, m, d, nk);
    }
  }
  for (int64_t g = 0; g < group; ++g)
    for (int64_t i = 0; i < rows; ++i) {
      const int64_t r = g * rows + i;
      const float inv = 1.f / w.row_sum[r];  // > 0: every row sees its own position
      T* dst = b.out + (first_token + i) * b.out_row + (first_head + g) * d;
      for (int64_t x = 0; x < d; ++x) dst[x] = static_cast<T>(w.acc[r * d + x] * inv);
    }
}

// ---- the call ------------------------------------------------------------------------------

template <typename T>
std::vector<Task> make_tasks(const Batch<T>& b, int64_t num_seqs,
                             int64_t query_tile = kQueryTile) {
  std::vector<Task> tasks;
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t qlen = b.query_len[s], first_pos = b.context_len[s] - qlen;
    for (int64_t q0 = 0; q0 < qlen; q0 += query_tile) {
      const int64_t q1 = std::min(qlen, q0 + query_tile);
      const int64_t keys = first_pos + q1 - first_visible(first_pos + q0, b.window);
      const int64_t cost = (q1 - q0) * (keys + kKeyTile);  // + kKeyTile: the task's fixed cost
      for (int64_t h = 0; h < b.num_kv_heads; ++h) tasks.push_back({s, h, q0, q1, cost});
    }
  }
  // Longest first, then dynamic: the threads finish within about one short task of each other.
  std::stable_sort(tasks.begin(), tasks.end(),
                   [](const Task& x, const Task& y) { return x.cost > y.cost; });
  return tasks;
}

#if defined(PDSERVE_AMX)
template <typename T>
void prefill_t64(const Batch<T>& b, int64_t num_seqs) {
  const PackedKV<c10::BFloat16> kv = pack_visible<T, c10::BFloat16, true>(b, num_seqs);
  const std::vector<Task> tasks = make_tasks(b, num_seqs, kQueryTileT64);
  const int64_t n = static_cast<int64_t>(tasks.size());
  std::atomic<int64_t> next{0};
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), n));
  parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    const FlushDenormals flush;
    const AmxTiles tiles;
    std::vector<BlockT64> blocks;
    for (int64_t i = next++; i < n; i = next++) run_task_t64(b, kv, tasks[i], blocks);
  });
}
#endif

template <typename T, typename E, int kD, bool kAmx = false>
void prefill(const Batch<T>& b, int64_t num_seqs) {
  const PackedKV<E> kv = pack_visible<T, E>(b, num_seqs);
  const std::vector<Task> tasks = make_tasks(b, num_seqs);
  const int64_t n = static_cast<int64_t>(tasks.size());
  std::atomic<int64_t> next{0};
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), n));
  parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    const FlushDenormals flush;
#if defined(PDSERVE_AMX)
    std::conditional_t<kAmx, AmxTiles, FlushDenormals> tiles;  // (a second flush: a no-op)
#endif
    Scratch<E> scratch;
    for (int64_t i = next++; i < n; i = next++) run_task<T, E, kD, kAmx>(b, kv, tasks[i], scratch);
  });
}

template <typename T, int kD>
void prefill_math(const Batch<T>& b, int64_t num_seqs) {
#if defined(PDSERVE_AMX)
  if constexpr (std::is_same_v<T, c10::BFloat16> && kD > 0 && kD % 64 == 0) {
    if (amx_granted()) {  // the tile unit
      if constexpr (kD == 64) return prefill_t64(b, num_seqs);
      return prefill<T, c10::BFloat16, kD, true>(b, num_seqs);
    }
  }
#endif
  if constexpr (std::is_same_v<T, c10::BFloat16> && kVectorKernels<c10::BFloat16, kD>)
    prefill<T, c10::BFloat16, kD>(b, num_seqs);  // bf16 dot products
  else
    prefill<T, float, kD>(b, num_seqs);
}

template <typename T>
void prefill_dispatch(const Batch<T>& b, int64_t num_seqs) {
  switch (b.head_dim) {  // common head sizes get the register-blocked micro-kernels
    case 64: return prefill_math<T, 64>(b, num_seqs);
    case 128: return prefill_math<T, 128>(b, num_seqs);
    case 32: return prefill_math<T, 32>(b, num_seqs);
    case 256: return prefill_math<T, 256>(b, num_seqs);  // Gemma 3
    default: return prefill_math<T, 0>(b, num_seqs);
  }
}

template <typename T>
Batch<T> make_batch(const at::Tensor& q, const at::Tensor& cache,
                    const at::Tensor& query_start, const at::Tensor& query_len,
                    const at::Tensor& context_len, const at::Tensor& tables, double scale,
                    at::Tensor& out, int64_t window) {
  return Batch<T>{q.data_ptr<T>(),
                  q.stride(0),
                  out.data_ptr<T>(),
                  out.stride(0),
                  cache.data_ptr<T>(),
                  cache.size(2),
                  cache.size(3),
                  cache.size(4),
                  q.size(1) / cache.size(2),
                  query_start.data_ptr<int64_t>(),
                  query_len.data_ptr<int64_t>(),
                  context_len.data_ptr<int64_t>(),
                  tables.data_ptr<int64_t>(),
                  tables.size(1),
                  static_cast<float>(scale),
                  window};
}

}  // namespace

// Writes the attention output of every prefill sequence's query rows into out's rows (other
// rows untouched). q and out: [num_tokens, num_q_heads, head_dim] with packed heads and any
// row stride; query_start, query_len, context_len: [num_seqs] int64; block_tables
// [num_seqs, max_blocks] int64, covering each sequence's context_len keys. window > 0: a
// sliding-window layer's (0: the whole context).
void paged_prefill_attention_out(at::Tensor q, at::Tensor cache, at::Tensor query_start,
                                 at::Tensor query_len, at::Tensor context_len,
                                 at::Tensor block_tables, double scale, at::Tensor out,
                                 int64_t window) {
  TORCH_CHECK(cache.dim() == 5 && q.dim() == 3 && out.dim() == 3 && block_tables.dim() == 2,
              "bad ranks");
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == q.size(2) && out.stride(2) == 1 &&
                  out.stride(1) == out.size(2),
              "q and out need packed heads: stride(1) == head_dim, stride(2) == 1");
  TORCH_CHECK(out.sizes() == q.sizes() && out.scalar_type() == q.scalar_type(),
              "out must match q's shape and dtype");
  TORCH_CHECK(q.scalar_type() == cache.scalar_type(), "q and cache dtypes differ");
  TORCH_CHECK(q.size(2) == cache.size(4) && q.size(1) % cache.size(2) == 0,
              "q heads must be a multiple of kv heads, with the cache's head_dim");
  TORCH_CHECK(cache.is_contiguous() && block_tables.is_contiguous(),
              "paged_prefill_attention needs a contiguous cache and block tables");
  const int64_t num_seqs = query_start.numel();
  for (const at::Tensor* t : {&query_start, &query_len, &context_len})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous() && t->numel() == num_seqs,
                "query_start, query_len and context_len: contiguous int64, one per sequence");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && block_tables.size(0) == num_seqs,
              "block_tables: int64, one row per sequence");
  TORCH_CHECK(window >= 0, "window must be >= 0 (0: no sliding window)");
  const int64_t* qs = query_start.data_ptr<int64_t>();
  const int64_t* ql = query_len.data_ptr<int64_t>();
  const int64_t* cl = context_len.data_ptr<int64_t>();
  const int64_t block_size = cache.size(3);
  for (int64_t s = 0; s < num_seqs; ++s)
    TORCH_CHECK(ql[s] >= 1 && cl[s] >= ql[s] && qs[s] >= 0 && qs[s] + ql[s] <= q.size(0) &&
                    (cl[s] + block_size - 1) / block_size <= block_tables.size(1),
                "sequence ", s, ": bad query_start/query_len/context_len or too few blocks");
  if (q.scalar_type() == at::kFloat) {
    prefill_dispatch(
        make_batch<float>(q, cache, query_start, query_len, context_len, block_tables, scale,
                          out, window),
        num_seqs);
  } else if (q.scalar_type() == at::kBFloat16) {
    prefill_dispatch(make_batch<c10::BFloat16>(q, cache, query_start, query_len, context_len,
                                               block_tables, scale, out, window),
                     num_seqs);
  } else {
    TORCH_CHECK(false, "paged_prefill_attention supports float32 and bfloat16");
  }
}
