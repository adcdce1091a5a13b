#pragma once
// bf16 in AVX2 registers, shared by the Adam kernels (optim), the fused kernels (models) and the
// communicator's sums (comm): eight bf16 widened to floats, which is exact, and eight floats
// rounded to bf16 to nearest even, as c10::BFloat16 rounds (add 0x7FFF plus the lowest kept bit,
// keep the top half; NaN becomes the quiet NaN 0x7FC0). The functions carry their instruction set
// in a target attribute (the library is built for baseline x86-64); callers run them only on CPUs
// with AVX2. Internal to ztrain.

#include <immintrin.h>

#include <cstdint>

namespace ztrain::detail {

__attribute__((target("avx2"))) inline __m256 avx2_load_bf16(const uint16_t* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// The eight bf16 nearest to v, packed.
__attribute__((target("avx2"))) inline __m128i avx2_pack_bf16(__m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), nan);
  // packus packs within each 128-bit half, [r0..3 r0..3 | r4..7 r4..7]; qwords 0 and 2 are r0..7.
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), _MM_SHUFFLE(3, 1, 2, 0));
  return _mm256_castsi256_si128(packed);
}

__attribute__((target("avx2"))) inline void avx2_store_bf16(uint16_t* p, __m256 v) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), avx2_pack_bf16(v));
}

// v rounded to bf16 as above, kept as floats (their low 16 bits zero).
__attribute__((target("avx2"))) inline __m256 avx2_round_bf16(__m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_and_si256(_mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))),
                                     _mm256_set1_epi32(static_cast<int>(0xFFFF0000u)));
  const __m256 nan = _mm256_cmp_ps(v, v, _CMP_UNORD_Q);
  return _mm256_blendv_ps(_mm256_castsi256_ps(r), _mm256_castsi256_ps(_mm256_set1_epi32(0x7FC00000)), nan);
}

}  // namespace ztrain::detail
