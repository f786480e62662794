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
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include "vec.h"

#include <algorithm>
#include <cstdint>

namespace {

using namespace pdserve_cpu;

constexpr int64_t kGroupCols = 64;  // output columns per group: 4 accumulator tiles of 16
constexpr int64_t kStepK = 32;      // K per tile multiply (16 bf16 pairs)
constexpr int kTileRows = 16;       // rows of x per A tile

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

bool linear_small_m_available() {
#if defined(PDSERVE_AMX)
  return amx_granted();
#else
  return false;
#endif
}

torch::Tensor pack_linear_weight(torch::Tensor w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kBFloat16, "w must be bf16 [N, K]");
  const int64_t n = w.size(0), k = w.size(1);
  TORCH_CHECK(k % kStepK == 0, "K must be a multiple of 32");
  const int64_t groups = (n + kGroupCols - 1) / kGroupCols;
  // [N', K] -> [groups, 4 blocks, 16 cols, K/32, 16 pairs, 2] -> [groups, 4, K/32, 16, 16, 2]
  auto padded = torch::zeros({groups * kGroupCols, k}, w.options());
  padded.narrow(0, 0, n).copy_(w);
  return padded.view({groups, 4, 16, k / kStepK, 16, 2})
      .permute({0, 1, 3, 4, 2, 5})
      .contiguous()
      .view({-1});
}

torch::Tensor linear_small_m(torch::Tensor x, torch::Tensor packed, int64_t n,
                             c10::optional<torch::Tensor> bias) {
#if defined(PDSERVE_AMX)
  TORCH_CHECK(linear_small_m_available(), "the OS does not grant AMX to this process");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kBFloat16 && x.stride(1) == 1,
              "x must be bf16 [M, K] with contiguous rows");
  const int64_t m = x.size(0), k = x.size(1);
  const int64_t groups = (n + kGroupCols - 1) / kGroupCols;
  TORCH_CHECK(m >= 1, "x has no rows");
  TORCH_CHECK(k % kStepK == 0 && packed.is_contiguous() &&
                  packed.scalar_type() == torch::kBFloat16 &&
                  packed.numel() == groups * kGroupCols * k,
              "packed is not pack_linear_weight's of an [n, K] weight");
  const c10::BFloat16* b = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == torch::kBFloat16 && bias->is_contiguous() &&
                    bias->numel() == n,
                "bias must be contiguous bf16 [n]");
    b = bias->data_ptr<c10::BFloat16>();
  }
  auto out = torch::empty({m, n}, x.options());
  const c10::BFloat16* xp = x.data_ptr<c10::BFloat16>();
  const c10::BFloat16* wp = packed.data_ptr<c10::BFloat16>();
  c10::BFloat16* op = out.data_ptr<c10::BFloat16>();
  // Groups per task: at least 64 KiB of W, so waking the second thread pays off.
  const int64_t grain = std::max<int64_t>(1, (64 << 10) / (kGroupCols * k * 2));
  at::parallel_for(0, groups, grain, [&](int64_t g0, int64_t g1) {
    linear_groups(xp, x.stride(0), m, wp, k, n, b, op, g0, g1);
  });
  return out;
#else
  TORCH_CHECK(false, "linear_small_m needs AMX (see linear_small_m_available)");
#endif
}
