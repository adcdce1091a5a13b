#pragma once
// Pieces shared by the fused kernels of this area (gelu.cpp, cross_entropy.cpp, dropout.cpp,
// attention.cpp): which tensors they take, and in AVX2 loads and stores of 8 float or bf16
// elements as floats, a register's largest element and sum, and exp; in AVX-512, exp of 16 floats
// and the mask of a row's tail, and loads and stores of 16 float or bf16 elements as floats.
// Each AVX2 or AVX-512 function carries its instruction set in a target attribute (the library is
// built for baseline x86-64); callers run them only where models::detail::fused_simd() says so.
// Internal to ztrain.

#include "../bf16_avx2.h"

#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#define ZTRAIN_AVX2 __attribute__((target("avx2,fma")))
#define ZTRAIN_AVX512 __attribute__((target("avx512f,avx512dq,avx2,fma")))

namespace ztrain::models::detail::simd {

/// Whether the fused kernels take a tensor: a strided float or bf16 one on the CPU.
inline bool float_or_bf16_on_cpu(const at::Tensor& x) {
  return x.device().is_cpu() && x.layout() == at::kStrided &&
         (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16);
}

/// fn(T{}) with T the element type of a tensor that float_or_bf16_on_cpu takes.
template <class Fn>
void for_type(at::ScalarType type, Fn&& fn) {
  if (type == at::kFloat) {
    fn(float{});
  } else {
    fn(c10::BFloat16{});
  }
}

inline float to_float(float v) { return v; }
inline float to_float(c10::BFloat16 v) { return static_cast<float>(v); }

constexpr float kMinusInf = -std::numeric_limits<float>::infinity();

/// Whether this CPU runs the AVX2 + FMA code below.
inline bool avx2_supported() { return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"); }

/// Whether it runs the AVX-512 code too.
inline bool avx512_supported() {
  return avx2_supported() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq");
}

ZTRAIN_AVX2 inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }

/// bf16 widens to float exactly.
ZTRAIN_AVX2 inline __m256 load8(const c10::BFloat16* p) {
  return ztrain::detail::avx2_load_bf16(reinterpret_cast<const uint16_t*>(p));
}

ZTRAIN_AVX2 inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }

/// Rounds to nearest even, as c10::BFloat16 does.
ZTRAIN_AVX2 inline void store8(c10::BFloat16* p, __m256 v) {
  ztrain::detail::avx2_store_bf16(reinterpret_cast<uint16_t*>(p), v);
}

/// Elements [0, n) of 8 (n < 8), the rest filled with `pad`: a row's tail.
ZTRAIN_AVX2 inline __m256 load_part(const float* p, int64_t n, float pad) {
  float v[8];
  std::fill(v, v + 8, pad);
  std::copy(p, p + n, v);
  return load8(v);
}

ZTRAIN_AVX2 inline __m256 load_part(const c10::BFloat16* p, int64_t n, float pad) {
  float v[8];
  std::fill(v, v + 8, pad);
  std::transform(p, p + n, v, [](c10::BFloat16 x) { return static_cast<float>(x); });
  return load8(v);
}

/// Stores elements [0, n) of x (n < 8).
template <class T>
ZTRAIN_AVX2 inline void store_part(T* p, int64_t n, __m256 x) {
  T v[8];
  store8(v, x);
  std::copy(v, v + n, p);
}

/// Elements [0, count) of 8 (count ≤ 8), loaded or stored whole where count is 8.
ZTRAIN_AVX2 inline __m256 load_upto(const float* p, int64_t count, float pad) {
  return count == 8 ? load8(p) : load_part(p, count, pad);
}

ZTRAIN_AVX2 inline void store_upto(float* p, int64_t count, __m256 x) {
  if (count == 8) {
    store8(p, x);
  } else {
    store_part(p, count, x);
  }
}

/// The largest and the sum of a register's 8 floats.
ZTRAIN_AVX2 inline float hmax(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_shuffle_ps(m, m, 1)));
}

ZTRAIN_AVX2 inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps(s, s, 1)));
}

/// exp8's and exp16's constants: the clamp, log2(e), Cody–Waite's split of ln 2 (its high part
/// exact in float) and Cephes' polynomial for e^r beyond 1 + r, highest degree first.
constexpr float kExpLimit = 87.0f, kLog2e = 1.44269504088896341f, kLn2High = 0.693359375f, kLn2Low = -2.12194440e-4f;
constexpr float kExpPolynomial[] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                                    4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};

/// e^z, within 2 ulps of std::exp where the result is a normal float (|z| ≤ 87): Cody–Waite
/// range reduction (z = n·ln 2 + r, |r| ≤ ln 2 / 2), Cephes' degree-6 polynomial for e^r, scaled
/// by 2^n through the exponent bits. Below −87 it is 0, above 87 infinity (−inf and +inf alike);
/// NaN stays NaN.
ZTRAIN_AVX2 inline __m256 exp8(__m256 z) {
  const __m256 lo = _mm256_set1_ps(-kExpLimit), hi = _mm256_set1_ps(kExpLimit);
  const __m256 c = _mm256_min_ps(hi, _mm256_max_ps(lo, z));  // NaN passes through
  const __m256 n =
      _mm256_round_ps(_mm256_mul_ps(c, _mm256_set1_ps(kLog2e)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2High), c);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Low), r);
  __m256 p = _mm256_set1_ps(kExpPolynomial[0]);
  for (int i = 1; i < 6; ++i) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kExpPolynomial[i]));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i scale = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  __m256 e = _mm256_mul_ps(p, _mm256_castsi256_ps(scale));
  e = _mm256_blendv_ps(e, _mm256_setzero_ps(), _mm256_cmp_ps(z, lo, _CMP_LT_OQ));
  return _mm256_blendv_ps(e, _mm256_set1_ps(INFINITY), _mm256_cmp_ps(z, hi, _CMP_GT_OQ));
}

/// exp8 on 16 floats: its operations, in its order.
ZTRAIN_AVX512 inline __m512 exp16(__m512 z) {
  const __m512 lo = _mm512_set1_ps(-kExpLimit), hi = _mm512_set1_ps(kExpLimit);
  const __m512 c = _mm512_min_ps(hi, _mm512_max_ps(lo, z));  // NaN passes through
  const __m512 n =
      _mm512_roundscale_ps(_mm512_mul_ps(c, _mm512_set1_ps(kLog2e)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2High), c);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Low), r);
  __m512 p = _mm512_set1_ps(kExpPolynomial[0]);
  for (int i = 1; i < 6; ++i) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kExpPolynomial[i]));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  const __m512 e = _mm512_scalef_ps(p, n);  // p · 2^n, exact for |c| ≤ 87
  const __m512 zero_below = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(z, lo, _CMP_LT_OQ), e, _mm512_setzero_ps());
  return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(z, hi, _CMP_GT_OQ), zero_below, _mm512_set1_ps(INFINITY));
}

/// The lanes of elements [0, n) of 16 (all 16 for n ≥ 16).
inline __mmask16 lanes(int64_t n) { return n >= 16 ? __mmask16(0xffff) : __mmask16((1u << n) - 1); }

/// Elements [0, n) of 16 (all 16 for n ≥ 16) as floats, the other lanes 0; bf16 widens exactly.
ZTRAIN_AVX512 inline __m512 load16(const float* p, int64_t n) { return _mm512_maskz_loadu_ps(lanes(n), p); }

ZTRAIN_AVX512 inline __m512 load16(const c10::BFloat16* p, int64_t n) {
  uint16_t part[16] = {};
  if (n < 16) std::copy(reinterpret_cast<const uint16_t*>(p), reinterpret_cast<const uint16_t*>(p) + n, part);
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(n < 16 ? part : static_cast<const void*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/// Stores lanes [0, n) of x (all 16 for n ≥ 16); bf16 rounds to nearest even as store8 does (NaN
/// becomes 0x7FC0), so both codes give the same bits.
ZTRAIN_AVX512 inline void store16(float* p, int64_t n, __m512 x) { _mm512_mask_storeu_ps(p, lanes(n), x); }

ZTRAIN_AVX512 inline void store16(c10::BFloat16* p, int64_t n, __m512 x) {
  const __m512i bits = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
  r = _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), r, _mm512_set1_epi32(0x7FC0));
  const __m256i h = _mm512_cvtepi32_epi16(r);
  if (n >= 16) return _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), h);
  uint16_t part[16];
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(part), h);
  std::copy(part, part + n, reinterpret_cast<uint16_t*>(p));
}

}  // namespace ztrain::models::detail::simd
