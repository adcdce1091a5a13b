#pragma once
// Small matrix products in bf16 with float accumulation, on AVX-512 BF16's dot-product instruction
// (vdpbf16ps: each of 16 float lanes adds the products of a pair of bf16 elements): the gemms of
// bf16 attention's blocks (attention.cpp), where libtorch's CPU gemm of bf16 into float runs at
// about the speed of its float one (98 against 103 GFLOP/s at 64 × 256 × 64 on a Zen 5 core,
// whose bf16 matmul peak is 478) and its bf16 gemm rounds the result.
//
// The operands are bf16 pairs along the reduction dimension, each pair a 32-bit word (its first
// element in the low half, as in memory). The packers build them from float matrices, rounding
// to nearest even (exact for floats widened from bf16) and padding with zeros: an odd reduction
// length gets a zero second half, and a row of B's words is padded to a multiple of 16 words.
// Internal to ztrain; callers run these only where models::detail::fused_simd() is kAvx512Bf16 or
// kAmx, and bf16_gemm_amx where it is kAmx.

#include <cstdint>

namespace ztrain::models::detail {

/// Whether this CPU runs the code below: AVX-512 F, BW and BF16.
bool bf16_dot_supported();

/// Whether this CPU, its OS and this process run bf16_gemm_amx: AMX-TILE and AMX-BF16 beside the
/// above, the tile state enabled by the OS, and the process's permission to use it (asked for on
/// the first call; Linux grants it per process).
bool amx_supported();

/// 16-word rows: n rounded up to a multiple of 16.
inline int64_t padded16(int64_t n) { return (n + 15) / 16 * 16; }

/// C[m, n] = A · B (+ C if accumulate), floats with row stride ldc, over kp pairs: A's word (i, p)
/// at a[i · a_i + p · a_p], B's word (p, j) at b[p · ldb + j] with ldb ≥ padded16(n) (the words
/// beyond n are read, and must be readable; their products are not stored).
void bf16_gemm(int64_t m, int64_t n, int64_t kp, const uint32_t* a, int64_t a_i, int64_t a_p, const uint32_t* b,
               int64_t ldb, float* c, int64_t ldc, bool accumulate);

/// bf16_gemm on AMX's tiles, for A's words along its rows: word (i, p) at a[i · lda + p]. Full
/// 16 × 16 tiles of A and B are read where they are; those at the edges are copied, zero-padded.
/// Where amx_supported() only.
void bf16_gemm_amx(int64_t m, int64_t n, int64_t kp, const uint32_t* a, int64_t lda, const uint32_t* b, int64_t ldb,
                   float* c, int64_t ldc, bool accumulate);

/// Pairs along each row: out[i · ld + p] = (x[i][2p], x[i][2p + 1]) for the rows x + i · stride of
/// n floats, p < ⌈n / 2⌉ (the operand A of a product over n, or B transposed).
void pack_rows(const float* x, int64_t rows, int64_t n, int64_t stride, uint32_t* out, int64_t ld);

/// Pairs across rows: out[p · ld + j] = (x[2p][j], x[2p + 1][j]) for p < ⌈rows / 2⌉, j < n, zeros
/// up to padded16(n) (the operand B of a product over rows, or A as a i = 1, a_p = ld).
void pack_row_pairs(const float* x, int64_t rows, int64_t n, int64_t stride, uint32_t* out, int64_t ld);

/// Pairs down the columns, a column to a row: out[j · ld + p] = (x[2p][j], x[2p + 1][j]) for j < n,
/// p < ⌈rows / 2⌉ (the operand A of xᵀ's product over rows, as bf16_gemm_amx reads it).
void pack_columns(const float* x, int64_t rows, int64_t n, int64_t stride, uint32_t* out, int64_t ld);

/// pack_rows transposed: out[p · ld + j] = (x[j][2p], x[j][2p + 1]) for j < rows, zeros up to
/// padded16(rows) (the operand B of x's transpose, over n).
void pack_transposed(const float* x, int64_t rows, int64_t n, int64_t stride, uint32_t* out, int64_t ld);

}  // namespace ztrain::models::detail
