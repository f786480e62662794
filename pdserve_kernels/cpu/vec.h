// Small vector helpers shared by the CPU kernels (paged_attention.cpp, prefill_attention.cpp,
// fused_ops.cpp, linear.cpp), and the AMX tile state (prefill_attention.cpp, linear.cpp).
#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>
#include <cstring>
#include <type_traits>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif
#if defined(__SSE__)
#include <xmmintrin.h>
#endif
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define PDSERVE_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace pdserve_cpu {

// Flushes denormal inputs and results to zero in this thread while in scope (x86 MXCSR DAZ +
// FTZ), restoring the caller's mode after. Softmax weights of far-below-max scores reach the
// denormal range, and every FMA on a denormal takes a microcode assist: decode attention ran
// ~1.5x slower on them. Values below 1.2e-38 change no fp32 sum of softmax terms (the largest
// is 1), so the results are the same.
struct FlushDenormals {
#if defined(__SSE__)
  unsigned saved = _mm_getcsr();
  FlushDenormals() { _mm_setcsr(saved | 0x8040u); }
  ~FlushDenormals() { _mm_setcsr(saved); }
#else
  FlushDenormals() = default;
#endif
  FlushDenormals(const FlushDenormals&) = delete;
  FlushDenormals& operator=(const FlushDenormals&) = delete;
};

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// exp(x) = 2^n e^r, n = round(x log2 e), r = x - n ln 2 (ln 2 in two parts, so r stays exact),
// e^r by Cephes' expf polynomial: the constants exp16 and exp8 share.
namespace exp_poly {
constexpr float kLog2e = 1.44269504088896341f;
constexpr float kLn2Hi = 0.693359375f, kLn2Lo = -2.12194440e-4f;
constexpr float kP0 = 1.9875691500e-4f, kP1 = 1.3981999507e-3f, kP2 = 8.3334519073e-3f,
                kP3 = 4.1665795894e-2f, kP4 = 1.6666665459e-1f, kP5 = 5.0000001201e-1f;
}  // namespace exp_poly

#if defined(__AVX512F__)
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
// 16 bf16 values -> 16 floats (bf16 is the top half of an fp32).
inline __m512 load16(const c10::BFloat16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

// exp(x), Cephes' polynomial on the reduced argument, 2^n applied by scalef (underflows to ~0
// below -103, saturates above 88.7).
inline __m512 exp16(__m512 x) {
  using namespace exp_poly;
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-103.f)), _mm512_set1_ps(88.7f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(kLog2e)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Hi), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Lo), r);
  __m512 p = _mm512_set1_ps(kP0);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kP1));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kP2));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kP3));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kP4));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kP5));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_scalef_ps(p, n);
}

// r[i] = horizontal sum of v[i], for 16 vectors.
inline __m512 reduce16(__m512* v) {
  __m512 w[8], x[4];
  for (int i = 0; i < 8; ++i)
    w[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                         _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {
    const __m512d a = _mm512_castps_pd(w[2 * i]), b = _mm512_castps_pd(w[2 * i + 1]);
    x[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                         _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  // x[k]: each 128-bit lane m holds lane m's partial sums of v[4k .. 4k+3].
  const __m512 z01 = _mm512_add_ps(_mm512_shuffle_f32x4(x[0], x[1], 0x44),
                                   _mm512_shuffle_f32x4(x[0], x[1], 0xEE));
  const __m512 z23 = _mm512_add_ps(_mm512_shuffle_f32x4(x[2], x[3], 0x44),
                                   _mm512_shuffle_f32x4(x[2], x[3], 0xEE));
  return _mm512_add_ps(_mm512_shuffle_f32x4(z01, z23, 0x88),
                       _mm512_shuffle_f32x4(z01, z23, 0xDD));
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
// exp(x) on 8 lanes, exp16's polynomial; 2^n built in the exponent bits, so x is clamped to
// [-87.3, 88.3] (2^n stays a normal float: exp of anything lower is ~1.2e-38, not 0, which no
// softmax sum notices). libmvec's expf, which the compiler used before, took a quarter of the
// prefill attention's time on an AVX2 CPU.
inline __m256 exp8(__m256 x) {
  using namespace exp_poly;
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.3f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(kLog2e)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Hi), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Lo), r);
  __m256 p = _mm256_set1_ps(kP0);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kP1));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kP2));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kP3));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kP4));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kP5));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  const __m256i e = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

// 8 bf16 -> 8 floats (bf16 is the top half of an fp32).
inline __m256 widen8(const c10::BFloat16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

inline __m256 widen8(const float* p) { return _mm256_loadu_ps(p); }

// v's lanes rounded to bf16 (nearest even; NaN is not expected), each in the low 16 bits of its
// 32-bit lane.
inline __m256i bf16_bits8(__m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  return _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF))), 16);
}

// v as a bf16 store would leave it (float32: unchanged).
template <typename T>
inline __m256 round8(__m256 v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else {
    return _mm256_castsi256_ps(_mm256_slli_epi32(bf16_bits8(v), 16));
  }
}

// The first `lanes` of v rounded to bf16 (nearest even) at p.
inline void store8(c10::BFloat16* p, __m256 v, int lanes) {
  const __m256i bits = bf16_bits8(v);
  const __m128i packed =
      _mm_packus_epi32(_mm256_castsi256_si128(bits), _mm256_extracti128_si256(bits, 1));
  if (lanes == 8) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
  } else {
    alignas(16) uint16_t tmp[8];
    _mm_store_si128(reinterpret_cast<__m128i*>(tmp), packed);
    std::memcpy(p, tmp, 2 * lanes);
  }
}

inline void store8(float* p, __m256 v, int lanes) {  // float32 outputs: no rounding
  if (lanes == 8) {
    _mm256_storeu_ps(p, v);
  } else {
    alignas(32) float tmp[8];
    _mm256_store_ps(tmp, v);
    std::memcpy(p, tmp, 4 * lanes);
  }
}

inline float hmax8(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

inline float hsum8(__m256 v) {
  __m128 m = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_add_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_add_ss(m, _mm_movehdup_ps(m)));
}

// s[0, n) = softmax(s[0, n)) in place, n >= 1. The lanes up to the next multiple of 8 are read
// and written too (s must have room for them); what they held does not matter.
inline void softmax8(float* s, int64_t n) {
  const int64_t full = n / 8 * 8;
  const int tail = static_cast<int>(n - full);
  const __m256i tail_lanes =
      _mm256_cmpgt_epi32(_mm256_set1_epi32(tail), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  __m256 top = _mm256_set1_ps(s[0]);
  for (int64_t i = 0; i < full; i += 8) top = _mm256_max_ps(top, _mm256_loadu_ps(s + i));
  if (tail > 0)
    top = _mm256_max_ps(top, _mm256_blendv_ps(top, _mm256_loadu_ps(s + full),
                                              _mm256_castsi256_ps(tail_lanes)));
  const __m256 mx = _mm256_set1_ps(hmax8(top));
  __m256 sum = _mm256_setzero_ps();
  for (int64_t i = 0; i < full; i += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + i), mx));
    _mm256_storeu_ps(s + i, e);
    sum = _mm256_add_ps(sum, e);
  }
  if (tail > 0) {
    const __m256 e = _mm256_and_ps(exp8(_mm256_sub_ps(_mm256_loadu_ps(s + full), mx)),
                                   _mm256_castsi256_ps(tail_lanes));
    _mm256_storeu_ps(s + full, e);
    sum = _mm256_add_ps(sum, e);
  }
  const __m256 inv = _mm256_set1_ps(1.f / hsum8(sum));
  for (int64_t i = 0; i < n; i += 8) _mm256_storeu_ps(s + i, _mm256_mul_ps(_mm256_loadu_ps(s + i), inv));
}

// The broadcast-FMA block of the AVX2 matrix kernels (prefill S = Q K^T and P V, the few-row
// linear): for R <= 6 rows and 16 columns, n steps of
//     acc[r][0:16] += x(r, i) * w(i)[0:16]     (x(r, i): a pointer to a float, broadcast)
// with acc's 12 vectors set by init(r, lo, hi) and handed to done(r, lo, hi), and w(i, w0, w1)
// loading the 16 columns of step i. 12 accumulators, the two loaded vectors and a broadcast
// fill the 16 ymm registers. The accumulators are named variables, not an array: GCC kept an
// __m256 acc[R][2] on the stack as well in one caller, storing all 12 every step (40-60% of
// the loop's speed).
template <int R, typename Init, typename W, typename X, typename Done>
inline void rows_x16_fma(int64_t n, Init&& init, W&& w, X&& x, Done&& done) {
  static_assert(R >= 1 && R <= 6, "at most 6 rows per pass (16 ymm registers)");
  const __m256 z = _mm256_setzero_ps();  // rows past R: never used
  __m256 a00 = z, a01 = z, a10 = z, a11 = z, a20 = z, a21 = z;
  __m256 a30 = z, a31 = z, a40 = z, a41 = z, a50 = z, a51 = z;
  init(0, a00, a01);
  if constexpr (R > 1) init(1, a10, a11);
  if constexpr (R > 2) init(2, a20, a21);
  if constexpr (R > 3) init(3, a30, a31);
  if constexpr (R > 4) init(4, a40, a41);
  if constexpr (R > 5) init(5, a50, a51);
  for (int64_t i = 0; i < n; ++i) {
    __m256 w0, w1;
    w(i, w0, w1);
#define PDSERVE_ROW_FMA(r, lo, hi)                      \
  if constexpr (R > r) {                                \
    const __m256 xv = _mm256_broadcast_ss(x(r, i));     \
    lo = _mm256_fmadd_ps(xv, w0, lo);                   \
    hi = _mm256_fmadd_ps(xv, w1, hi);                   \
  }
    PDSERVE_ROW_FMA(0, a00, a01)
    PDSERVE_ROW_FMA(1, a10, a11)
    PDSERVE_ROW_FMA(2, a20, a21)
    PDSERVE_ROW_FMA(3, a30, a31)
    PDSERVE_ROW_FMA(4, a40, a41)
    PDSERVE_ROW_FMA(5, a50, a51)
#undef PDSERVE_ROW_FMA
  }
  done(0, a00, a01);
  if constexpr (R > 1) done(1, a10, a11);
  if constexpr (R > 2) done(2, a20, a21);
  if constexpr (R > 3) done(3, a30, a31);
  if constexpr (R > 4) done(4, a40, a41);
  if constexpr (R > 5) done(5, a50, a51);
}
#endif

#if defined(PDSERVE_AMX)
// Asks Linux for the AMX tile state once per process (arch_prctl ARCH_REQ_XCOMP_PERM).
inline bool amx_granted() {
  static const bool granted = [] {
    constexpr int kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return granted;
}

// Configures the 8 tiles, 64 bytes wide, in this thread while in scope: tiles [0, short_tiles)
// with short_rows rows (accumulators and A operands of fewer than 16 rows), the rest 16.
struct AmxTiles {
  struct Config {  // ldtilecfg's 64-byte layout, palette 1
    uint8_t palette = 1, start_row = 0, reserved[14] = {};
    uint16_t colsb[16] = {};
    uint8_t rows[16] = {};
  };
  explicit AmxTiles(int short_rows = 16, int short_tiles = 0) {
    Config c;
    for (int i = 0; i < 8; ++i)
      c.colsb[i] = 64, c.rows[i] = static_cast<uint8_t>(i < short_tiles ? short_rows : 16);
    // GCC's _tile_loadconfig tells the compiler it reads 8 bytes only: without this barrier
    // the rest of the config may be stored after the ldtilecfg (which then faults).
    asm volatile("" ::: "memory");
    _tile_loadconfig(&c);
  }
  ~AmxTiles() { _tile_release(); }
  AmxTiles(const AmxTiles&) = delete;
  AmxTiles& operator=(const AmxTiles&) = delete;
};
#endif

}  // namespace pdserve_cpu
