// bf16 products with float accumulation on vdpbf16ps (bf16_gemm.h).
//
// C is walked in tiles of up to 6 rows × 64 columns (4 registers of 16 floats a row): 24
// accumulators, 4 registers of B's words and one broadcast word of A's, 29 of the 32 registers.
// Each pair of the reduction loads a tile row of B once and broadcasts one word of A per row.
// Tiles at C's edges take the same code with fewer rows or registers, and the last register's
// columns beyond n are neither loaded nor stored.

// GCC 12 reports its own AVX-512 intrinsics as possibly uninitialised once inlined (see
// optim/adam_kernels.cpp); off before the first include, in a file compiled on its own.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif

#include "bf16_gemm.h"

#include <immintrin.h>

#include <algorithm>
#include <array>

#define ZTRAIN_BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))

namespace ztrain::models::detail {

namespace {

constexpr int kTileRows = 6;
constexpr int kTileVectors = 4;  // of 16 floats

// The first k lanes of 16 (all from 16 up, none from 0 down).
__mmask16 first_lanes(int64_t k) {
  return k >= 16 ? static_cast<__mmask16>(0xFFFF) : k <= 0 ? 0 : static_cast<__mmask16>((1u << k) - 1);
}

template <int Rows, int Vectors>
ZTRAIN_BF16 void tile(int64_t kp, const uint32_t* a, int64_t a_i, int64_t a_p, const uint32_t* b, int64_t ldb,
                      float* c, int64_t ldc, __mmask16 last, bool accumulate) {
  __m512 acc[Rows][Vectors];
#pragma GCC unroll 8
  for (int r = 0; r < Rows; ++r) {
#pragma GCC unroll 4
    for (int v = 0; v < Vectors; ++v) acc[r][v] = _mm512_setzero_ps();
  }
  for (int64_t p = 0; p < kp; ++p) {
    __m512bh bv[Vectors];
#pragma GCC unroll 4
    for (int v = 0; v < Vectors; ++v) bv[v] = (__m512bh)_mm512_loadu_si512(b + p * ldb + 16 * v);
    const uint32_t* ap = a + p * a_p;
#pragma GCC unroll 8
    for (int r = 0; r < Rows; ++r) {
      const auto av = (__m512bh)_mm512_set1_epi32(static_cast<int>(ap[r * a_i]));
#pragma GCC unroll 4
      for (int v = 0; v < Vectors; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], av, bv[v]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < Rows; ++r) {
#pragma GCC unroll 4
    for (int v = 0; v < Vectors; ++v) {
      const __mmask16 lanes = v == Vectors - 1 ? last : static_cast<__mmask16>(0xFFFF);
      float* out = c + r * ldc + 16 * v;
      __m512 x = acc[r][v];
      if (accumulate) x = _mm512_add_ps(x, _mm512_maskz_loadu_ps(lanes, out));
      _mm512_mask_storeu_ps(out, lanes, x);
    }
  }
}

using Tile = void (*)(int64_t, const uint32_t*, int64_t, int64_t, const uint32_t*, int64_t, float*, int64_t,
                      __mmask16, bool);

template <int Rows>
constexpr std::array<Tile, kTileVectors> tiles_of() {
  return {tile<Rows, 1>, tile<Rows, 2>, tile<Rows, 3>, tile<Rows, 4>};
}

// kTiles[rows - 1][vectors - 1]
constexpr std::array<std::array<Tile, kTileVectors>, kTileRows> kTiles = {
    tiles_of<1>(), tiles_of<2>(), tiles_of<3>(), tiles_of<4>(), tiles_of<5>(), tiles_of<6>()};

// 32 floats from p (those from n on read as 0) as 16 words of bf16 pairs, rounded to nearest even.
ZTRAIN_BF16 __m512i pairs_of(const float* p, int64_t n) {
  const __m512 lo = _mm512_maskz_loadu_ps(first_lanes(n), p);
  const __m512 hi = _mm512_maskz_loadu_ps(first_lanes(n - 16), p + 16);
  return (__m512i)_mm512_cvtne2ps_pbh(hi, lo);  // the low 16 elements from lo, in order
}

}  // namespace

bool bf16_dot_supported() {
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bf16");
}

void bf16_gemm(int64_t m, int64_t n, int64_t kp, const uint32_t* a, int64_t a_i, int64_t a_p, const uint32_t* b,
               int64_t ldb, float* c, int64_t ldc, bool accumulate) {
  constexpr int64_t kTileColumns = 16 * kTileVectors;
  for (int64_t j0 = 0; j0 < n; j0 += kTileColumns) {
    const int64_t columns = std::min(kTileColumns, n - j0), vectors = (columns + 15) / 16;
    const __mmask16 last = first_lanes(columns - 16 * (vectors - 1));
    for (int64_t i0 = 0; i0 < m; i0 += kTileRows) {
      const int64_t rows = std::min<int64_t>(kTileRows, m - i0);
      kTiles[rows - 1][vectors - 1](kp, a + i0 * a_i, a_i, a_p, b + j0, ldb, c + i0 * ldc + j0, ldc, last,
                                    accumulate);
    }
  }
}

ZTRAIN_BF16 void pack_rows(const float* x, int64_t rows, int64_t n, int64_t stride, uint32_t* out, int64_t ld) {
  for (int64_t i = 0; i < rows; ++i) {
    for (int64_t q = 0; q < n; q += 32) {
      const int64_t words = (std::min<int64_t>(32, n - q) + 1) / 2;
      _mm512_mask_storeu_epi32(out + i * ld + q / 2, first_lanes(words), pairs_of(x + i * stride + q, n - q));
    }
  }
}

ZTRAIN_BF16 void pack_row_pairs(const float* x, int64_t rows, int64_t n, int64_t stride, uint32_t* out,
                                int64_t ld) {
  // element 2j of the result is element j of the converted register (row 2p), 2j + 1 its 16 + j
  alignas(64) static constexpr uint16_t kInterleave[32] = {0, 16, 1, 17, 2,  18, 3,  19, 4,  20, 5,
                                                           21, 6, 22, 7, 23, 8, 24, 9, 25, 10, 26,
                                                           11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  const __m512i interleave = _mm512_load_si512(kInterleave);
  for (int64_t p = 0; p < (rows + 1) / 2; ++p) {
    const float* even = x + 2 * p * stride;
    const float* odd = even + stride;
    const bool has_odd = 2 * p + 1 < rows;
    for (int64_t j = 0; j < padded16(n); j += 16) {
      const __m512 lo = _mm512_maskz_loadu_ps(first_lanes(n - j), even + j);
      const __m512 hi = has_odd ? _mm512_maskz_loadu_ps(first_lanes(n - j), odd + j) : _mm512_setzero_ps();
      const auto both = (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
      _mm512_storeu_si512(out + p * ld + j, _mm512_permutexvar_epi16(interleave, both));
    }
  }
}

ZTRAIN_BF16 void pack_transposed(const float* x, int64_t rows, int64_t n, int64_t stride, uint32_t* out,
                                 int64_t ld) {
  const int64_t kp = (n + 1) / 2;
  alignas(64) uint32_t row[16];
  for (int64_t j = 0; j < padded16(rows); ++j) {
    for (int64_t q = 0; q < n; q += 32) {
      const int64_t words = std::min<int64_t>(16, kp - q / 2);
      _mm512_store_si512(row, j < rows ? pairs_of(x + j * stride + q, n - q) : _mm512_setzero_si512());
      for (int64_t w = 0; w < words; ++w) out[(q / 2 + w) * ld + j] = row[w];
    }
  }
}

}  // namespace ztrain::models::detail
