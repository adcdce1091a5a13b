// bf16 products with float accumulation on vdpbf16ps (bf16_gemm.h).
//
// C is walked in tiles of up to 6 rows × 64 columns (4 registers of 16 floats a row): 24
// accumulators, 4 registers of B's words and one broadcast word of A's, 29 of the 32 registers.
// Each pair of the reduction loads a tile row of B once and broadcasts one word of A per row.
// Tiles at C's edges take the same code with fewer rows or registers, and the last register's
// columns beyond n are neither loaded nor stored.
//
// On AMX (bf16_gemm_amx) C is walked in blocks of 2 × 2 tiles of 16 × 16 floats (tiles 0–3), each
// pass over 16 pairs of the reduction loading two tiles of A's rows (4, 5) and two of B's columns
// (6, 7) for four tile products. GCC's tile loads are asm statements that do not tell the compiler
// they read memory, so a compiler barrier precedes each one that reads what this code wrote.

// GCC 12 reports its own AVX-512 intrinsics as possibly uninitialised once inlined (see
// optim/adam_kernels.cpp); off before the first include, in a file compiled on its own.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif

#include "bf16_gemm.h"

#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <array>

#define ZTRAIN_BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))
#define ZTRAIN_AMX __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,amx-tile,amx-bf16")))

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

// Palette 1's tile configuration: tiles 0–7 of 16 rows × 64 bytes.
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t bytes_per_row[16] = {64, 64, 64, 64, 64, 64, 64, 64};
  uint8_t rows[16] = {16, 16, 16, 16, 16, 16, 16, 16};
};

// Completes this code's stores before a tile instruction that reads them.
inline void before_tile_read() { asm volatile("" ::: "memory"); }

// A 16 × 16 tile of 32-bit words from `rows` rows of `words` words ld apart (both clipped to 0–16),
// zeros elsewhere.
ZTRAIN_AMX void edge_tile(const uint32_t* x, int64_t ld, int64_t rows, int64_t words, uint32_t* tile) {
  const __mmask16 lanes = first_lanes(words);
  for (int64_t r = 0; r < 16; ++r) {
    _mm512_store_si512(tile + 16 * r, r < rows ? _mm512_maskz_loadu_epi32(lanes, x + r * ld) : _mm512_setzero_si512());
  }
}

// Whether C's tile of rows [i, i + 16) and columns [j, j + 16) lies within m × n.
bool whole_tile(int64_t i, int64_t j, int64_t m, int64_t n) { return i + 16 <= m && j + 16 <= n; }

// The rows [i, i + 16) and columns [j, j + 16) of C that are within m × n, from a tile stored by
// `store(address, stride in bytes)`: straight into C where the tile is whole (its accumulator
// started from C's values if `accumulate`), else through `edge`, added to C's values if `accumulate`.
template <class Store>
ZTRAIN_AMX void write_tile(Store store, int64_t i, int64_t j, int64_t m, int64_t n, float* c, int64_t ldc,
                           float* edge, bool accumulate) {
  if (i >= m || j >= n) return;
  if (whole_tile(i, j, m, n)) return store(c + i * ldc + j, ldc * 4);
  store(edge, 64);
  const __mmask16 lanes = first_lanes(n - j);
  for (int64_t r = 0; r < std::min<int64_t>(16, m - i); ++r) {
    float* row = c + (i + r) * ldc + j;
    __m512 x = _mm512_load_ps(edge + 16 * r);
    if (accumulate) x = _mm512_add_ps(x, _mm512_maskz_loadu_ps(lanes, row));
    _mm512_mask_storeu_ps(row, lanes, x);
  }
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

bool amx_supported() {
  static const bool supported = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!bf16_dot_supported() || !__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
    if (!(d & (1u << 24)) || !(d & (1u << 22))) return false;  // AMX-TILE, AMX-BF16
    if (!__get_cpuid(1, &a, &b, &c, &d) || !(c & (1u << 27))) return false;  // OSXSAVE: XCR0 readable
    unsigned xcr0 = 0, high = 0;
    asm volatile("xgetbv" : "=a"(xcr0), "=d"(high) : "c"(0));
    if ((xcr0 & (3u << 17)) != (3u << 17)) return false;  // the OS saves the tile configuration and data
    constexpr int kRequestPermission = 0x1023, kTileData = 18;  // ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA
    return syscall(SYS_arch_prctl, kRequestPermission, kTileData) == 0;
  }();
  return supported;
}

ZTRAIN_AMX void bf16_gemm_amx(int64_t m, int64_t n, int64_t kp, const uint32_t* a, int64_t lda, const uint32_t* b,
                              int64_t ldb, float* c, int64_t ldc, bool accumulate) {
  alignas(64) uint32_t a_edge[2][256], b_edge[2][256];
  alignas(64) float c_edge[256];
  static const TileConfig config;
  _tile_loadconfig(&config);
  // A's tile of rows [i, i + 16) and B's of columns [j, j + 16), pairs [p, p + 16): where they are
  // when whole, else copied (`edge`); B's rows are ldb ≥ padded16(n) words long.
  const auto a_tile = [&](int64_t i, int64_t p, uint32_t* edge) {
    if (i + 16 <= m && p + 16 <= kp) return a + i * lda + p;
    edge_tile(a + i * lda + p, lda, m - i, kp - p, edge);
    before_tile_read();
    return static_cast<const uint32_t*>(edge);
  };
  const auto b_tile = [&](int64_t p, int64_t j, uint32_t* edge) {
    if (p + 16 <= kp && j < n) return b + p * ldb + j;
    edge_tile(b + p * ldb + j, ldb, j < n ? kp - p : 0, 16, edge);
    before_tile_read();
    return static_cast<const uint32_t*>(edge);
  };
  // whether C's tile at (i, j) starts from C's values rather than zeros
  const auto from_c = [&](int64_t i, int64_t j) { return accumulate && whole_tile(i, j, m, n); };
  const int64_t a_stride = lda * 4, b_stride = ldb * 4, c_stride = ldc * 4;
  if (accumulate) before_tile_read();
  for (int64_t i = 0; i < m; i += 32) {
    for (int64_t j = 0; j < n; j += 32) {
      float* c_ij = c + i * ldc + j;
      if (from_c(i, j)) {
        _tile_loadd(0, c_ij, c_stride);
      } else {
        _tile_zero(0);
      }
      if (from_c(i, j + 16)) {
        _tile_loadd(1, c_ij + 16, c_stride);
      } else {
        _tile_zero(1);
      }
      if (from_c(i + 16, j)) {
        _tile_loadd(2, c_ij + 16 * ldc, c_stride);
      } else {
        _tile_zero(2);
      }
      if (from_c(i + 16, j + 16)) {
        _tile_loadd(3, c_ij + 16 * ldc + 16, c_stride);
      } else {
        _tile_zero(3);
      }
      for (int64_t p = 0; p < kp; p += 16) {
        const uint32_t *a0 = a_tile(i, p, a_edge[0]), *a1 = a_tile(i + 16, p, a_edge[1]);
        const uint32_t *b0 = b_tile(p, j, b_edge[0]), *b1 = b_tile(p, j + 16, b_edge[1]);
        _tile_loadd(4, a0, a0 == a_edge[0] ? 64 : a_stride);
        _tile_loadd(5, a1, a1 == a_edge[1] ? 64 : a_stride);
        _tile_loadd(6, b0, b0 == b_edge[0] ? 64 : b_stride);
        _tile_loadd(7, b1, b1 == b_edge[1] ? 64 : b_stride);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
      }
      const auto write = [&](auto store, int64_t ti, int64_t tj) {
        write_tile(store, ti, tj, m, n, c, ldc, c_edge, accumulate);
      };
      write([](float* at, int64_t stride) { _tile_stored(0, at, stride); }, i, j);
      write([](float* at, int64_t stride) { _tile_stored(1, at, stride); }, i, j + 16);
      write([](float* at, int64_t stride) { _tile_stored(2, at, stride); }, i + 16, j);
      write([](float* at, int64_t stride) { _tile_stored(3, at, stride); }, i + 16, j + 16);
    }
  }
  _tile_release();
}

ZTRAIN_BF16 void pack_rows(const float* x, int64_t rows, int64_t n, int64_t stride, uint32_t* out, int64_t ld) {
  for (int64_t i = 0; i < rows; ++i) {
    for (int64_t q = 0; q < n; q += 32) {
      const int64_t words = (std::min<int64_t>(32, n - q) + 1) / 2;
      _mm512_mask_storeu_epi32(out + i * ld + q / 2, first_lanes(words), pairs_of(x + i * stride + q, n - q));
    }
  }
}

namespace {
// The words (x[2p][j + l], x[2p + 1][j + l]) for l < 16, p being the pair of rows `even` and `odd`
// (null past the last row: zeros), those from `columns` on zero.
ZTRAIN_BF16 __m512i row_pair_words(const float* even, const float* odd, int64_t columns) {
  // element 2l of the result is element l of the converted register (row 2p), 2l + 1 its 16 + l
  alignas(64) static constexpr uint16_t kInterleave[32] = {0, 16, 1, 17, 2,  18, 3,  19, 4,  20, 5,
                                                           21, 6, 22, 7, 23, 8, 24, 9, 25, 10, 26,
                                                           11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  const __m512 lo = _mm512_maskz_loadu_ps(first_lanes(columns), even);
  const __m512 hi = odd ? _mm512_maskz_loadu_ps(first_lanes(columns), odd) : _mm512_setzero_ps();
  const auto both = (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
  return _mm512_permutexvar_epi16(_mm512_load_si512(kInterleave), both);
}
}  // namespace

ZTRAIN_BF16 void pack_row_pairs(const float* x, int64_t rows, int64_t n, int64_t stride, uint32_t* out,
                                int64_t ld) {
  for (int64_t p = 0; p < (rows + 1) / 2; ++p) {
    const float *even = x + 2 * p * stride, *odd = 2 * p + 1 < rows ? even + stride : nullptr;
    for (int64_t j = 0; j < padded16(n); j += 16) {
      _mm512_storeu_si512(out + p * ld + j, row_pair_words(even + j, odd ? odd + j : nullptr, n - j));
    }
  }
}

ZTRAIN_BF16 void pack_columns(const float* x, int64_t rows, int64_t n, int64_t stride, uint32_t* out, int64_t ld) {
  const __m512i offsets = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                             _mm512_set1_epi32(static_cast<int>(ld)));
  for (int64_t p = 0; p < (rows + 1) / 2; ++p) {
    const float *even = x + 2 * p * stride, *odd = 2 * p + 1 < rows ? even + stride : nullptr;
    for (int64_t j = 0; j < n; j += 16) {
      const __m512i words = row_pair_words(even + j, odd ? odd + j : nullptr, n - j);
      _mm512_mask_i32scatter_epi32(out + j * ld + p, first_lanes(n - j), offsets, words, 4);
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
