// y = x W^T (+ b) for the few-row products of decoding, bf16 on the AMX tile unit, streaming W
// at memory speed.
//
//   pack_linear_weight(w [N, K] bf16) -> packed W (K % 32 == 0), made once at load
//   linear_small_m(x [M, K] bf16, packed, n, bias [N] bf16 or None) -> [M, N] bf16
//
// A decode step multiplies a handful of rows (one per running request) by every weight of the
// model once, so it is bound by reading the weights: 213 MB of projections per step for a 135M
// model in bf16. oneDNN's packed GEMM reads them at ~13 GB/s on this 2-core machine (its
// blocking is made for many rows; AVX512-BF16 dot products, tried first, are compute-bound
// at ~0.5 vdpbf16ps a cycle and no faster). Here one tile multiply takes 16 x 32 of x (the M
// rows, zero-extended in the tile) times a 32 x 16 block of W^T, so the tile unit has compute
// to spare and the loop is one pass over W.
//
// Packed layout: W^T zero-padded to N' (a multiple of 64) columns, as [N'/64][4][K/32][16][16][2]
// bf16: for each group of 64 output columns, its four 16-column blocks, each as K/32 1 KiB B
// tiles (the pair "VNNI" layout AMX reads) one after another, so a thread walking its groups
// reads four sequential streams (one tile of each per step; 1.6-1.8x oneDNN at 4-16 rows, vs
// 1.5-1.6x with the four blocks interleaved per step). Outputs are rounded and stored 16 lanes
// at a time (the scalar loop cost ~1/3 of a 48-row product). Row blocks past the first re-read
// the group's W from L2; sharing each W tile between row blocks (one column block at a time)
// measured no faster at 17-64 rows. Sums are fp32, rounded to bf16 once (+ bias in
// fp32 first), as oneDNN does; its accumulation order differs (results may differ by an ulp).
//
// For float32 weights on every AVX2 + FMA CPU (AMX is bf16 only), and for bf16 ones without
// AMX (an AVX2 + FMA CPU such as AMD Zen 3, which has no bf16 arithmetic at all: torch's bf16
// F.linear ran at 0.4 GB/s of weights at one row there, and oneDNN refuses to pack bf16) the
// same two functions take another layout and loop: W^T as [N'/16][K][16] bf16 (N' a multiple of
// 16) or float32, one 32-byte load per k (bf16: widened to two 8-float vectors by a shift),
// times up to 6 rows of x (widened to fp32 once per call) broadcast, into 12 fp32 accumulators;
// a 16-column panel stays in L1/L2 while every row block passes over it, prefetched ahead of
// the first. A bf16 panel met by 64 or more rows is widened into a float buffer once per call,
// so the passes do not widen again (and have the registers for 6 rows). With AVX-512, float32
// panels go through a zmm loop instead (two panels x 12 rows a pass: linear_panels_512), which
// on an Intel Emerald Rapids ran SmolLM2's projections 1.4-1.9x oneDNN's speed at
// 1-48 rows (18-23 GB/s of weights at 1-12 rows against oneDNN's 10-15; 175 vs 120 GFLOP/s at
// 48) and 1.07-1.2x at 64-128 (benchmarks/small_rows_linear.py --dtype float32).
//
// bf16 weights on an AVX512-BF16 CPU without AMX (AMD Zen 4) take a third layout and loop,
// vdpbf16ps on pairs of k (linear_panels_dp below): on Zen 4 the AVX2 loop's widening ran
// SmolLM2's projections at 0.50-0.65x oneDNN from 16 to 128 rows (it is compute-bound there,
// and fp32 FMAs do half the products of a bf16 dot product); the pair loop runs them at
// 1.08-1.55x oneDNN at 8-128 rows (~400 GFLOP/s at 128, oneDNN's bf16 GEMM rate here) and as
// fast as before at 1-4 rows (~27-29 GB/s of weights).
#include <ATen/Parallel.h>
// The ATen headers only (not <torch/extension.h>, which paged_attention.cpp's bindings need):
// ~4 s of headers a file instead of ~27.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>

#include "thread_pool.h"
#include "vec.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace {

using namespace pdserve_cpu;

constexpr int64_t kGroupCols = 64;  // output columns per group: 4 accumulator tiles of 16
constexpr int64_t kStepK = 32;      // K per tile multiply (16 bf16 pairs)
constexpr int kTileRows = 16;       // rows of x per A tile

#if defined(__AVX2__) && defined(__FMA__)
#define PDSERVE_LINEAR_AVX2 1
constexpr int64_t kPanelCols = 16;  // output columns per panel (two 8-float vectors)

// How many k steps ahead of the loop the panel is prefetched (fp32: 32 lines, 2 KiB; bf16: 1 KiB),
// across the panel's end into the next one (panels lie one after another; a prefetch past the
// weight's end is harmless). The hardware prefetcher alone left 1-8-row products at ~26-28 GB/s
// here (AMD Zen 3); with it 1.05-1.15x faster (benchmarks/small_rows_linear.py).
constexpr int64_t kAheadSteps = 32;

// Rows [r0, r0 + R) of xf (fp32, K wide) times one panel (K x 16, P: bf16 or float) into
// out's columns [c0, c0 + cols): vec.h's rows_x16_fma (a bf16 panel's widening needs one more
// register than its 6 rows leave: it takes at most 4 rows).
// Not inlined: inlined into linear_small_m's loops (the row blocks), GCC kept the float32
// instantiation's accumulators and K on the stack, storing them every step (half the speed).
template <int R, typename P, typename O>
__attribute__((noinline)) void panel_rows(const float* xf, int64_t k, const P* panel, const float* bias16, O* out,
                int64_t n, int64_t r0, int64_t c0, int64_t cols) {
  const int lo_lanes = static_cast<int>(std::min<int64_t>(8, cols));
  const float* xr = xf + r0 * k;
  rows_x16_fma<R>(
      k, [&](int, __m256& lo, __m256& hi) { lo = hi = _mm256_setzero_ps(); },
      [&](int64_t kk, __m256& w0, __m256& w1) {
        _mm_prefetch(reinterpret_cast<const char*>(panel + (kk + kAheadSteps) * kPanelCols),
                     _MM_HINT_T0);
        w0 = widen8(panel + kk * kPanelCols);
        w1 = widen8(panel + kk * kPanelCols + 8);
      },
      [&](int r, int64_t kk) { return xr + r * k + kk; },
      [&](int r, __m256 lo, __m256 hi) {
        // The bias is loaded here, not before the loop: every ymm register is taken in it.
        O* o = out + (r0 + r) * n + c0;
        store8(o, _mm256_add_ps(lo, _mm256_loadu_ps(bias16)), lo_lanes);
        if (cols > 8)
          store8(o + 8, _mm256_add_ps(hi, _mm256_loadu_ps(bias16 + 8)), static_cast<int>(cols - 8));
      });
}

// All m rows times one panel, Block rows per pass, the rest in one shorter pass.
template <int Block, typename P, typename O>
void panel_all_rows(const float* xf, int64_t m, int64_t k, const P* panel, const float* bias16,
                    O* out, int64_t n, int64_t c0, int64_t cols) {
  int64_t r0 = 0;
  for (; r0 + Block <= m; r0 += Block)
    panel_rows<Block>(xf, k, panel, bias16, out, n, r0, c0, cols);
  const int64_t rest = m - r0;
  if (rest == 1) panel_rows<1>(xf, k, panel, bias16, out, n, r0, c0, cols);
  if (rest == 2) panel_rows<2>(xf, k, panel, bias16, out, n, r0, c0, cols);
  if (rest == 3) panel_rows<3>(xf, k, panel, bias16, out, n, r0, c0, cols);
  if constexpr (Block == 6) {
    if (rest == 4) panel_rows<4>(xf, k, panel, bias16, out, n, r0, c0, cols);
    if (rest == 5) panel_rows<5>(xf, k, panel, bias16, out, n, r0, c0, cols);
  }
}

// bf16 rows at or above which a panel is first widened into a per-thread float buffer (K x 16
// floats, at most 96 KiB, in L2) and the 6-row loop passes over that copy instead of the 4-row
// loop widening the bf16 panel again in every pass: 1.07x at 96 and 128 rows, even at 48-64,
// slower below. float32 panels are never copied: with the prefetch and the weights on huge pages
// (engine/host_memory.py) the passes over the weight where it lies beat the copy at every row
// count (SmolLM2's projections, 12 rows 19 vs 26 ms, 16: 26 vs 35, 48: 60 vs 65-72, 128: 148-152
// vs 155; before either, passes from memory were latency-bound and the copy won from 12 rows).
constexpr int64_t kCopyPanelRows = 64;

// Rows of x per block in the many-row products of prefill (3 MiB of x at K 768: in L3).
constexpr int64_t kRowBlock = 1024;

#if defined(__AVX512F__)
// With AVX-512 (float32 panels only): two panels side by side, each k step one zmm register
// of each, times R rows of x, each broadcast once into a register and used by both: 2R
// accumulators (32 zmm registers: room for 12 rows). A loop over one panel with the rows
// broadcast from memory took a load per FMA and fell to 0.8x oneDNN from 32 rows; the
// ymm loop above has room for 6 rows and half the lanes. Panels: 1 or 2; cols: the output
// columns they hold (up to 32, the last panel's may be fewer).
template <int R, int Panels>
__attribute__((noinline)) void panel_rows512(const float* xf, int64_t k, const float* panel,
                                             const float* bias, float* out, int64_t n,
                                             int64_t r0, int64_t c0, int64_t cols) {
  const float* panel1 = panel + k * kPanelCols;  // the next panel (Panels == 2)
  __m512 acc0[R], acc1[R];  // acc1: the second panel's (Panels == 2; else dropped unused)
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) acc0[r] = acc1[r] = _mm512_setzero_ps();
  const float* xr = xf + r0 * k;
  for (int64_t kk = 0; kk < k; ++kk) {
    _mm_prefetch(reinterpret_cast<const char*>(panel + (kk + kAheadSteps) * kPanelCols),
                 _MM_HINT_T0);
    const __m512 w0 = _mm512_loadu_ps(panel + kk * kPanelCols);
    __m512 w1 = w0;
    if constexpr (Panels == 2) {
      _mm_prefetch(reinterpret_cast<const char*>(panel1 + (kk + kAheadSteps) * kPanelCols),
                   _MM_HINT_T0);
      w1 = _mm512_loadu_ps(panel1 + kk * kPanelCols);
    }
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const __m512 xv = _mm512_set1_ps(xr[r * k + kk]);
      acc0[r] = _mm512_fmadd_ps(xv, w0, acc0[r]);
      if constexpr (Panels == 2) acc1[r] = _mm512_fmadd_ps(xv, w1, acc1[r]);
    }
  }
  const int64_t cols0 = std::min<int64_t>(kPanelCols, cols);
  const __mmask16 lanes0 = static_cast<__mmask16>((1u << cols0) - 1);
  const __mmask16 lanes1 = static_cast<__mmask16>((1u << std::max<int64_t>(0, cols - 16)) - 1);
  const __m512 b0 = _mm512_loadu_ps(bias), b1 = _mm512_loadu_ps(bias + 16);
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
    float* o = out + (r0 + r) * n + c0;
    _mm512_mask_storeu_ps(o, lanes0, _mm512_add_ps(acc0[r], b0));
    if constexpr (Panels == 2) _mm512_mask_storeu_ps(o + 16, lanes1, _mm512_add_ps(acc1[r], b1));
  }
}

// The last rows (fewer than Block) of one or two panels.
template <int Block, int Panels, int R = 1>
void panel_rest512(const float* xf, int64_t rest, int64_t k, const float* panel,
                   const float* bias, float* out, int64_t n, int64_t r0, int64_t c0,
                   int64_t cols) {
  if constexpr (R < Block) {
    if (rest == R) return panel_rows512<R, Panels>(xf, k, panel, bias, out, n, r0, c0, cols);
    panel_rest512<Block, Panels, R + 1>(xf, rest, k, panel, bias, out, n, r0, c0, cols);
  }
}

constexpr int kBlock512 = 12;

// Panels [p0, p1) of a float32 weight for all m rows, two at a time.
void linear_panels_512(const float* xf, int64_t m, const float* packed, int64_t k, int64_t n,
                       const float* bias, float* out, int64_t p0, int64_t p1) {
  alignas(64) float bias32[2 * kPanelCols];
  for (int64_t r0 = 0; r0 < m; r0 += kRowBlock) {
    const int64_t rows = std::min(kRowBlock, m - r0);
    const float* xb = xf + r0 * k;
    float* ob = out + r0 * n;
    for (int64_t p = p0; p < p1; p += 2) {
      const bool pair = p + 1 < p1;
      const int64_t c0 = p * kPanelCols;
      const int64_t cols = std::min((pair ? 2 : 1) * kPanelCols, n - c0);
      for (int64_t c = 0; c < 2 * kPanelCols; ++c)
        bias32[c] = bias != nullptr && c < cols ? bias[c0 + c] : 0.f;
      const float* panel = packed + p * k * kPanelCols;
      int64_t r = 0;
      if (pair) {
        for (; r + kBlock512 <= rows; r += kBlock512)
          panel_rows512<kBlock512, 2>(xb, k, panel, bias32, ob, n, r, c0, cols);
        panel_rest512<kBlock512, 2>(xb, rows - r, k, panel, bias32, ob, n, r, c0, cols);
      } else {
        for (; r + kBlock512 <= rows; r += kBlock512)
          panel_rows512<kBlock512, 1>(xb, k, panel, bias32, ob, n, r, c0, cols);
        panel_rest512<kBlock512, 1>(xb, rows - r, k, panel, bias32, ob, n, r, c0, cols);
      }
    }
  }
}
#endif

#if defined(__AVX512BF16__) && !defined(PDSERVE_AMX)
// bf16 weights on an AVX512-BF16 CPU without AMX (AMD Zen 4): vdpbf16ps multiplies a pair of k
// for 16 columns in one instruction, twice the products of an fp32 FMA, so the few-row products
// of decode, which are compute-bound from ~8 rows on two cores, take it instead of the AVX2
// loop's widening (what this CPU ran before: the bf16 rows and W widened to fp32). Layout: W^T
// as [N'/16][K/2][16][2] bf16, each k pair of a 16-column panel one zmm register; x stays bf16
// (a row's pair broadcast as one 32-bit lane). Two panels x R rows a pass as in
// linear_panels_512. Each output is its row's pairs summed in k order in fp32 (vdpbf16ps:
// the two products of a pair added to the sum one after the other, denormals flushed), + bias,
// rounded to bf16 once; a row's result does not depend on the rows beside it.
#define PDSERVE_LINEAR_BF16DP 1

template <int R, int Panels>
__attribute__((noinline)) void panel_rows_dp(const c10::BFloat16* x, int64_t ldx, int64_t k,
                                             const c10::BFloat16* panel, const float* bias,
                                             c10::BFloat16* out, int64_t n, int64_t r0,
                                             int64_t c0, int64_t cols) {
  const c10::BFloat16* panel1 = panel + k * kPanelCols;  // the next panel (Panels == 2)
  __m512 acc0[R], acc1[R];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) acc0[r] = acc1[r] = _mm512_setzero_ps();
  const c10::BFloat16* xr = x + r0 * ldx;
  constexpr int64_t kPairStep = 2 * kPanelCols;  // bf16 per k pair of a panel (64 bytes)
  for (int64_t kk = 0; kk < k; kk += 2) {
    const int64_t off = (kk / 2) * kPairStep;
    _mm_prefetch(reinterpret_cast<const char*>(panel + off + kAheadSteps * kPairStep),
                 _MM_HINT_T0);
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(panel + off);
    __m512bh w1 = w0;
    if constexpr (Panels == 2) {
      _mm_prefetch(reinterpret_cast<const char*>(panel1 + off + kAheadSteps * kPairStep),
                   _MM_HINT_T0);
      w1 = (__m512bh)_mm512_loadu_si512(panel1 + off);
    }
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      int32_t pair;
      std::memcpy(&pair, xr + r * ldx + kk, sizeof(pair));
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
      acc0[r] = _mm512_dpbf16_ps(acc0[r], xv, w0);
      if constexpr (Panels == 2) acc1[r] = _mm512_dpbf16_ps(acc1[r], xv, w1);
    }
  }
  const int64_t cols0 = std::min<int64_t>(kPanelCols, cols);
  const __mmask16 lanes0 = static_cast<__mmask16>((1u << cols0) - 1);
  const __mmask16 lanes1 = static_cast<__mmask16>((1u << std::max<int64_t>(0, cols - 16)) - 1);
  const __m512 b0 = _mm512_loadu_ps(bias), b1 = _mm512_loadu_ps(bias + 16);
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
    c10::BFloat16* o = out + (r0 + r) * n + c0;
    _mm256_mask_storeu_epi16(o, lanes0, (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(acc0[r], b0)));
    if constexpr (Panels == 2)
      _mm256_mask_storeu_epi16(o + 16, lanes1,
                               (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(acc1[r], b1)));
  }
}

template <int Block, int Panels, int R = 1>
void panel_rest_dp(const c10::BFloat16* x, int64_t ldx, int64_t rest, int64_t k,
                   const c10::BFloat16* panel, const float* bias, c10::BFloat16* out, int64_t n,
                   int64_t r0, int64_t c0, int64_t cols) {
  if constexpr (R < Block) {
    if (rest == R) return panel_rows_dp<R, Panels>(x, ldx, k, panel, bias, out, n, r0, c0, cols);
    panel_rest_dp<Block, Panels, R + 1>(x, ldx, rest, k, panel, bias, out, n, r0, c0, cols);
  }
}

// Panels [p0, p1) of a bf16 weight (pair layout) for all m rows, two at a time.
void linear_panels_dp(const c10::BFloat16* x, int64_t ldx, int64_t m,
                      const c10::BFloat16* packed, int64_t k, int64_t n,
                      const c10::BFloat16* bias, c10::BFloat16* out, int64_t p0, int64_t p1) {
  alignas(64) float bias32[2 * kPanelCols];
  for (int64_t r0 = 0; r0 < m; r0 += kRowBlock) {
    const int64_t rows = std::min(kRowBlock, m - r0);
    const c10::BFloat16* xb = x + r0 * ldx;
    c10::BFloat16* ob = out + r0 * n;
    for (int64_t p = p0; p < p1; p += 2) {
      const bool pair = p + 1 < p1;
      const int64_t c0 = p * kPanelCols;
      const int64_t cols = std::min((pair ? 2 : 1) * kPanelCols, n - c0);
      for (int64_t c = 0; c < 2 * kPanelCols; ++c)
        bias32[c] = bias != nullptr && c < cols ? static_cast<float>(bias[c0 + c]) : 0.f;
      const c10::BFloat16* panel = packed + p * k * kPanelCols;
      int64_t r = 0;
      if (pair) {
        for (; r + kBlock512 <= rows; r += kBlock512)
          panel_rows_dp<kBlock512, 2>(xb, ldx, k, panel, bias32, ob, n, r, c0, cols);
        panel_rest_dp<kBlock512, 2>(xb, ldx, rows - r, k, panel, bias32, ob, n, r, c0, cols);
      } else {
        for (; r + kBlock512 <= rows; r += kBlock512)
          panel_rows_dp<kBlock512, 1>(xb, ldx, k, panel, bias32, ob, n, r, c0, cols);
        panel_rest_dp<kBlock512, 1>(xb, ldx, rows - r, k, panel, bias32, ob, n, r, c0, cols);
      }
    }
  }
}
#endif

// Panels [p0, p1) for all m rows.
template <typename W>
void linear_panels_avx2(const float* xf, int64_t m, const W* packed, int64_t k, int64_t n,
                        const W* bias, W* out, int64_t p0, int64_t p1) {
  alignas(32) float bias16[kPanelCols];
  // The panel's float copy: one buffer per thread, kept across calls (a decode step makes ~240).
  static thread_local std::vector<float> wide;
  constexpr bool kBf16 = std::is_same_v<W, c10::BFloat16>;
  const bool copy = kBf16 && m >= kCopyPanelRows;
  if (copy && static_cast<int64_t>(wide.size()) < k * kPanelCols) wide.resize(k * kPanelCols);
  // Blocks of kRowBlock rows, each over all the panels: a block's x stays in cache while
  // the panels pass by (with every row against each panel, a 4096-row x of K 1536, 25 MB, came
  // from memory once per panel: 157 GFLOP/s against 180 at 2048 rows).
  for (int64_t r0 = 0; r0 < m; r0 += kRowBlock) {
    const int64_t rows = std::min(kRowBlock, m - r0);
    const float* xb = xf + r0 * k;
    W* ob = out + r0 * n;
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t c0 = p * kPanelCols, cols = std::min(kPanelCols, n - c0);
      for (int64_t c = 0; c < kPanelCols; ++c)
        bias16[c] = bias != nullptr && c < cols ? static_cast<float>(bias[c0 + c]) : 0.f;
      const W* panel = packed + p * k * kPanelCols;
      if (!copy) {
        panel_all_rows<kBf16 ? 4 : 6>(xb, rows, k, panel, bias16, ob, n, c0, cols);
        continue;
      }
      for (int64_t i = 0; i < k * kPanelCols; i += 8) _mm256_storeu_ps(&wide[i], widen8(panel + i));
      panel_all_rows<6>(xb, rows, k, wide.data(), bias16, ob, n, c0, cols);
    }
  }
}

#endif

#if defined(PDSERVE_AMX)
// 16 bf16 (the masked lanes; 0 elsewhere) as fp32.
inline __m512 load16_masked(const c10::BFloat16* p, __mmask16 lanes) {
  const __m256i h = _mm256_maskz_loadu_epi16(lanes, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// The masked lanes of v rounded to bf16 (nearest even) and stored at p.
inline void store16_bf16(c10::BFloat16* p, __m512 v, __mmask16 lanes) {
  _mm256_mask_storeu_epi16(p, lanes, (__m256i)_mm512_cvtneps_pbh(v));
}

// Output columns [g0, g1) * 64 for the m rows of x, 16 rows at a time (a group's W, at most
// 192 KiB, stays in L2 for the row blocks after the first).
void linear_groups(const c10::BFloat16* x, int64_t ldx, int64_t m, const c10::BFloat16* packed,
                   int64_t k, int64_t n, const c10::BFloat16* bias, c10::BFloat16* out, int64_t g0,
                   int64_t g1) {
  const int64_t steps = k / kStepK;
  const int64_t group_elems = steps * kGroupCols * kStepK;
  alignas(64) float sums[kTileRows * kGroupCols];
  const int64_t tail = m % kTileRows;
  for (int rows : {kTileRows, static_cast<int>(tail)}) {
    const int64_t r_begin = rows == kTileRows ? 0 : m - tail;
    const int64_t r_end = rows == kTileRows ? m - tail : m;
    if (rows == 0 || r_begin == r_end) continue;
    const AmxTiles tiles(rows, 5);  // 0-3: accumulators, 4: x (rows tall); 5-6: W
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t c0 = g * kGroupCols, cols = std::min(kGroupCols, n - c0);
      for (int64_t r0 = r_begin; r0 < r_end; r0 += rows) {
        const c10::BFloat16* w = packed + g * group_elems;
        const c10::BFloat16* xr = x + r0 * ldx;
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        const int64_t block = steps * 512;  // one 16-column block's tiles, all K
        for (int64_t s = 0; s < steps; ++s, w += 512) {
          _tile_loadd(4, xr + s * kStepK, ldx * 2);
          _tile_loadd(5, w, 64);
          _tile_loadd(6, w + block, 64);
          _tile_dpbf16ps(0, 4, 5);
          _tile_dpbf16ps(1, 4, 6);
          _tile_loadd(5, w + 2 * block, 64);
          _tile_loadd(6, w + 3 * block, 64);
          _tile_dpbf16ps(2, 4, 5);
          _tile_dpbf16ps(3, 4, 6);
        }
        _tile_stored(0, sums, kGroupCols * 4);
        _tile_stored(1, sums + 16, kGroupCols * 4);
        _tile_stored(2, sums + 32, kGroupCols * 4);
        _tile_stored(3, sums + 48, kGroupCols * 4);
        for (int64_t cb = 0; cb * 16 < cols; ++cb) {
          const __mmask16 lanes =
              static_cast<__mmask16>((1u << std::min<int64_t>(16, cols - cb * 16)) - 1);
          const __m512 b16 = bias != nullptr ? load16_masked(bias + c0 + cb * 16, lanes)
                                             : _mm512_setzero_ps();
          for (int64_t r = 0; r < rows; ++r)
            store16_bf16(out + (r0 + r) * n + c0 + cb * 16,
                         _mm512_add_ps(_mm512_load_ps(sums + r * kGroupCols + cb * 16), b16),
                         lanes);
        }
      }
    }
  }
}

#endif
}  // namespace

// Whether linear_small_m runs here at all: float32 (and, without AMX, bf16) on any AVX2 + FMA
// CPU; bf16 on an AMX build only where the OS grants AMX (pack_linear_weight refuses it else).
bool linear_small_m_available() {
#if defined(PDSERVE_LINEAR_AVX2)
  return true;
#else
  return false;
#endif
}

// Whether linear_small_m should take products of every row count, prefill's too: the AVX2 +
// FMA loop on a CPU without AVX-512, where it outran oneDNN's packed GEMM at every row count
// measured (AMD Zen 3, SmolLM2's projections, float32: 172-183 vs 127-164 GFLOP/s at 64-2048
// rows; bf16: 143-160 vs 118-157, oneDNN multiplying in float32), so the engine keeps no oneDNN
// copy of the weights at all. On AMX (bf16 decode rows) and on AVX-512 CPUs oneDNN takes the
// many-row products.
bool linear_small_m_all_rows() {
#if defined(PDSERVE_LINEAR_AVX2) && !defined(__AVX512F__)
  return true;
#else
  return false;
#endif
}

at::Tensor pack_linear_weight(at::Tensor w) {
  TORCH_CHECK(w.dim() == 2 && (w.scalar_type() == at::kBFloat16 ||
                               w.scalar_type() == at::kFloat),
              "w must be bf16 or float32 [N, K]");
  const int64_t n = w.size(0), k = w.size(1);
  TORCH_CHECK(k % kStepK == 0, "K must be a multiple of 32");
#if defined(PDSERVE_AMX)
  if (w.scalar_type() == at::kBFloat16) {
    TORCH_CHECK(amx_granted(), "the OS does not grant AMX to this process");
    const int64_t groups = (n + kGroupCols - 1) / kGroupCols;
    // [N', K] -> [groups, 4 blocks, 16 cols, K/32, 16 pairs, 2] -> [groups, 4, K/32, 16, 16, 2]
    auto padded = at::zeros({groups * kGroupCols, k}, w.options());
    padded.narrow(0, 0, n).copy_(w);
    return padded.view({groups, 4, 16, k / kStepK, 16, 2})
        .permute({0, 1, 3, 4, 2, 5})
        .contiguous()
        .view({-1});
  }
#endif
#if defined(PDSERVE_LINEAR_AVX2)
  const int64_t panels = (n + kPanelCols - 1) / kPanelCols;
  auto padded = at::zeros({panels * kPanelCols, k}, w.options());
  padded.narrow(0, 0, n).copy_(w);
#if defined(PDSERVE_LINEAR_BF16DP)
  // bf16: [N', K] -> [panels, 16 cols, K/2, 2] -> [panels, K/2, 16 cols, 2]
  if (w.scalar_type() == at::kBFloat16)
    return padded.view({panels, kPanelCols, k / 2, 2}).permute({0, 2, 1, 3}).contiguous().view({-1});
#endif
  // [N', K] -> [panels, 16 cols, K] -> [panels, K, 16 cols]
  return padded.view({panels, kPanelCols, k}).transpose(1, 2).contiguous().view({-1});
#else
  TORCH_CHECK(false, "linear_small_m needs AVX2 + FMA (see linear_small_m_available)");
#endif
}

at::Tensor linear_small_m(at::Tensor x, at::Tensor packed, int64_t n,
                             c10::optional<at::Tensor> bias) {
#if defined(PDSERVE_AMX)
  if (x.scalar_type() == at::kBFloat16 && packed.scalar_type() == at::kBFloat16) {
    TORCH_CHECK(amx_granted(), "the OS does not grant AMX to this process");
    TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "x must be bf16 [M, K] with contiguous rows");
    const int64_t m = x.size(0), k = x.size(1);
    const int64_t groups = (n + kGroupCols - 1) / kGroupCols;
    TORCH_CHECK(m >= 1, "x has no rows");
    TORCH_CHECK(k % kStepK == 0 && packed.is_contiguous() &&
                    packed.numel() == groups * kGroupCols * k,
                "packed is not pack_linear_weight's of an [n, K] weight");
    const c10::BFloat16* b = nullptr;
    if (bias.has_value() && bias->defined()) {
      TORCH_CHECK(bias->scalar_type() == at::kBFloat16 && bias->is_contiguous() &&
                      bias->numel() == n,
                  "bias must be contiguous bf16 [n]");
      b = bias->data_ptr<c10::BFloat16>();
    }
    auto out = at::empty({m, n}, x.options());
    const c10::BFloat16* xp = x.data_ptr<c10::BFloat16>();
    const c10::BFloat16* wp = packed.data_ptr<c10::BFloat16>();
    c10::BFloat16* op = out.data_ptr<c10::BFloat16>();
    // Groups per task: at least 64 KiB of W, so waking the second thread pays off.
    const int64_t grain = std::max<int64_t>(1, (64 << 10) / (kGroupCols * k * 2));
    parallel_for(0, groups, grain, [&](int64_t g0, int64_t g1) {
      linear_groups(xp, x.stride(0), m, wp, k, n, b, op, g0, g1);
    });
    return out;
  }
#endif
#if defined(PDSERVE_LINEAR_AVX2)
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.scalar_type() == packed.scalar_type() &&
                  (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat),
              "x must be bf16 or float32 [M, K] with contiguous rows, in packed's dtype");
  const int64_t m = x.size(0), k = x.size(1);
  const int64_t panels = (n + kPanelCols - 1) / kPanelCols;
  TORCH_CHECK(m >= 1, "x has no rows");
  TORCH_CHECK(k % kStepK == 0 && packed.is_contiguous() &&
                  packed.numel() == panels * kPanelCols * k,
              "packed is not pack_linear_weight's of an [n, K] weight");
  if (bias.has_value() && bias->defined())
    TORCH_CHECK(bias->scalar_type() == x.scalar_type() && bias->is_contiguous() &&
                    bias->numel() == n,
                "bias must be contiguous [n] in x's dtype");
  auto out = at::empty({m, n}, x.options());
  auto run = [&](auto tag) {
    using W = decltype(tag);
    const W* b = bias.has_value() && bias->defined() ? bias->data_ptr<W>() : nullptr;
    const W* xp = x.data_ptr<W>();
    const W* wp = packed.data_ptr<W>();
    W* op = out.data_ptr<W>();
    // Panels per task: at least 64 KiB of W, so waking the second thread pays off.
    const int64_t grain = std::max<int64_t>(1, (64 << 10) / (kPanelCols * k * sizeof(W)));
#if defined(PDSERVE_LINEAR_BF16DP)
    if constexpr (std::is_same_v<W, c10::BFloat16>) {  // x's bf16 pairs read where they lie
      parallel_for(0, panels, grain, [&](int64_t p0, int64_t p1) {
        linear_panels_dp(xp, x.stride(0), m, wp, k, n, b, op, p0, p1);
      });
      return;
    }
#endif
    // x as float32 rows packed K apart: x itself when it already is, else widened (or packed)
    // once, both threads a share of the rows, into a buffer the calling thread keeps (a
    // prefill's x is megabytes: a fresh allocation each call would fault its pages in again).
    static thread_local std::vector<float> xf;
    const float* xrows = nullptr;
    if constexpr (std::is_same_v<W, float>) {
      if (x.stride(0) == k) xrows = xp;
    }
    if (xrows == nullptr) {
      if (static_cast<int64_t>(xf.size()) < m * k) xf.resize(m * k);
      float* dst = xf.data();
      const int64_t ldx = x.stride(0);
      parallel_for(0, m, std::max<int64_t>(1, 16384 / k), [&](int64_t r0, int64_t r1) {
        for (int64_t r = r0; r < r1; ++r)
          for (int64_t j = 0; j < k; j += 8) _mm256_storeu_ps(dst + r * k + j, widen8(xp + r * ldx + j));
      });
      xrows = dst;
    }
    parallel_for(0, panels, grain, [&](int64_t p0, int64_t p1) {
#if defined(__AVX512F__)
      if constexpr (std::is_same_v<W, float>)
        return linear_panels_512(xrows, m, wp, k, n, b, op, p0, p1);
#endif
      linear_panels_avx2<W>(xrows, m, wp, k, n, b, op, p0, p1);
    });
  };
#if defined(PDSERVE_AMX)
  run(float{});  // bf16 with bf16 took the AMX branch above, mixed dtypes failed the check
#else
  if (x.scalar_type() == at::kFloat) run(float{});
  else run(c10::BFloat16{});
#endif
  return out;
#else
  TORCH_CHECK(false, "linear_small_m needs AVX2 + FMA (see linear_small_m_available)");
#endif
}
