// GCC 12 reports its own AVX-512 intrinsics (`__m512 __Y = __Y;` self-initialisations) as possibly
// uninitialised once they are inlined; the warning is about the header, not this code. It is
// decided by the state at the header's lines, and libtorch 2.x's headers include <immintrin.h>
// too, so it is off before the first include.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

#include "adam_kernels.h"
#include "../bf16_avx2.h"

#include <ztrain/error.h>

#include <cpuid.h>
#include <immintrin.h>

#include <cmath>
#include <cstring>

// How it works
// ------------
// One element's update is PyTorch's sequence of tensor ops, each rounded to float as libtorch's
// CPU kernels round it. Two of them fuse a multiply-add: add_ with alpha is an explicit FMA
// (vec::fmadd), and addcmul_'s `self + value * t1 * t2` is contracted to one by the compiler that
// built libtorch (checked against libtorch 1.13: the unfused form differs in the last bit for a
// fraction of the elements).
// mul_, sqrt, div, add_ and addcdiv_ round every operation:
//
//   w = w * decay                        AdamW: param.mul_(1 - lr*wd)
//   g = fma(w, wd, g)                    Adam:  grad.add(param, alpha=wd)
//   m = fma(g, 1-b1, m * b1)             exp_avg.mul_(b1).add_(grad, alpha=1-b1)
//   v = fma((1-b2) * g, g, v * b2)       exp_avg_sq.mul_(b2).addcmul_(grad, grad, value=1-b2)
//   d = sqrt(v) / sqrt(bc2) + eps        (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
//   w = w + (-step_size * m) / d         param.addcdiv_(exp_avg, denom, value=-step_size)
//
// The scalar kernel spells it out with std::fma; the SIMD kernels do the same operations in the
// same order, and IEEE rounds every one of them (fma, sqrt and division included) identically in
// every width, so the kernels agree bit for bit. This file is compiled with -ffp-contract=off, so
// that the compiler fuses no other multiply-add. The SIMD functions carry their instruction set in
// a target attribute (the library is built for baseline x86-64) and are only called after
// adam_kernel_supported() said yes.
//
// bf16/fp16 parameters: the gradient is widened to float exactly, `w` is the fp32 master, and the
// new master is rounded to nearest even into the parameter. bf16 rounding is integer arithmetic
// (add 0x7FFF plus the lowest kept bit, keep the top half; NaN becomes 0x7FC0, as c10::BFloat16
// does); fp16 uses F16C/AVX-512 conversions, which the scalar code reproduces exactly (NaN stays
// NaN with the quiet bit set and the top payload bits kept).
//
// Tails (the last n % width elements) go through the same vector code on a small stack buffer.

namespace ztrain::optim {

namespace {

uint32_t bits_of(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}

float float_of(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

bool cpu_has_avx2() {
  // F16C from CPUID leaf 1 (ECX bit 29): Clang before 16 does not know the "f16c" feature name.
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  const bool f16c = __get_cpuid(1, &eax, &ebx, &ecx, &edx) && (ecx & bit_F16C);
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && f16c;
}

bool cpu_has_avx512() {
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && cpu_has_avx2();
}

}  // namespace

const char* to_string(AdamKernel kernel) {
  switch (kernel) {
    case AdamKernel::kScalar:
      return "scalar";
    case AdamKernel::kAvx2:
      return "avx2";
    case AdamKernel::kAvx512:
      return "avx512";
    case AdamKernel::kTorchFused:
      return "torch_fused";
  }
  return "unknown";
}

bool adam_kernel_supported(AdamKernel kernel) {
  switch (kernel) {
    case AdamKernel::kScalar:
      return true;
    case AdamKernel::kAvx2:
      return cpu_has_avx2();
    case AdamKernel::kAvx512:
      return cpu_has_avx512();
    case AdamKernel::kTorchFused:
      return true;
  }
  return false;
}

AdamKernel best_adam_kernel() {
  if (cpu_has_avx512()) return AdamKernel::kAvx512;
  if (cpu_has_avx2()) return AdamKernel::kAvx2;
  return AdamKernel::kScalar;
}

namespace detail {

AdamSpan AdamSpan::slice(int64_t begin, int64_t end, WeightType type) const {
  const int64_t grad_size = type == WeightType::kFloat ? 4 : 2;
  AdamSpan s = *this;
  s.weight = weight + begin;
  s.param16 = param16 ? param16 + begin : nullptr;
  s.grad = static_cast<const char*>(grad) + begin * grad_size;
  s.exp_avg = exp_avg + begin;
  s.exp_avg_sq = exp_avg_sq + begin;
  s.n = end - begin;
  return s;
}

namespace {

// ---- scalar reference ----------------------------------------------------------------------

float bf16_to_float(uint16_t h) { return float_of(uint32_t{h} << 16); }

uint16_t float_to_bf16(float f) {
  const uint32_t u = bits_of(f);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0;
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

float half_to_float(uint16_t h) {
  const uint32_t sign = uint32_t{h & 0x8000u} << 16;
  const uint32_t exponent = (h >> 10) & 0x1Fu, mantissa = h & 0x3FFu;
  if (exponent == 0x1F) return float_of(sign | 0x7F800000u | (mantissa << 13));  // inf, NaN (payload kept)
  if (exponent == 0) {  // zero or subnormal: mantissa * 2^-24, exact in float
    const float magnitude = static_cast<float>(mantissa) * 0x1p-24f;
    return float_of(sign | bits_of(magnitude));
  }
  return float_of(sign | ((exponent + 112) << 23) | (mantissa << 13));
}

uint16_t float_to_half(float f) {
  const uint32_t u = bits_of(f);
  const auto sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t a = u & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return sign | 0x7E00u | ((a >> 13) & 0x3FFu);  // NaN: quiet, top payload bits
  if (a >= 0x477FF000u) return sign | 0x7C00u;                       // 65520 and up round to inf
  if (a >= 0x38800000u) {                                             // normal half (>= 2^-14)
    const uint32_t r = a + 0xFFFu + ((a >> 13) & 1u);
    return sign | static_cast<uint16_t>((r - (112u << 23)) >> 13);
  }
  if (a <= 0x33000000u) return sign;  // <= 2^-25 rounds to zero (2^-25 is a tie, 0 is even)
  // Subnormal half, in units of 2^-24: the 24-bit mantissa shifted right, rounded to nearest even.
  const uint32_t mantissa = (a & 0x7FFFFFu) | 0x800000u;
  const uint32_t shift = 126 - (a >> 23);  // 14..24
  uint32_t r = mantissa >> shift;
  const uint32_t rest = mantissa & ((1u << shift) - 1), half = 1u << (shift - 1);
  if (rest > half || (rest == half && (r & 1u))) ++r;
  return sign | static_cast<uint16_t>(r);
}

template <WeightType T>
float load_grad(const void* grad, int64_t i) {
  if constexpr (T == WeightType::kFloat) return static_cast<const float*>(grad)[i];
  if constexpr (T == WeightType::kBFloat16) return bf16_to_float(static_cast<const uint16_t*>(grad)[i]);
  if constexpr (T == WeightType::kHalf) return half_to_float(static_cast<const uint16_t*>(grad)[i]);
}

template <WeightType T>
uint16_t round_weight(float w) {
  if constexpr (T == WeightType::kBFloat16) return float_to_bf16(w);
  return float_to_half(w);
}

template <WeightType T, Decay D>
void scalar_span(const AdamScalars& s, const AdamSpan& x) {
  for (int64_t i = 0; i < x.n; ++i) {
    float w = x.weight[i], g = load_grad<T>(x.grad, i), m = x.exp_avg[i], v = x.exp_avg_sq[i];
    if constexpr (D == Decay::kDecoupled) w = w * s.decay;
    if constexpr (D == Decay::kCoupled) g = std::fma(w, s.weight_decay, g);
    m = std::fma(g, s.one_minus_beta1, m * s.beta1);
    v = std::fma(s.one_minus_beta2 * g, g, v * s.beta2);
    const float denom = std::sqrt(v) / s.bias_correction2_sqrt + s.eps;
    w = w + (s.neg_step_size * m) / denom;
    x.weight[i] = w;
    x.exp_avg[i] = m;
    x.exp_avg_sq[i] = v;
    if constexpr (T != WeightType::kFloat) x.param16[i] = round_weight<T>(w);
  }
}

template <WeightType T>
constexpr int64_t kGradSize = T == WeightType::kFloat ? 4 : 2;

template <WeightType T>
const void* grad_at(const void* grad, int64_t i) {
  return static_cast<const char*>(grad) + i * kGradSize<T>;
}

// The last n % width elements of a span, copied to the stack and padded with zeros, so that the
// vector code runs over them too (the padding lanes are computed and dropped).
template <WeightType T, int width>
struct Tail {
  alignas(64) float w[width] = {};
  alignas(64) float m[width] = {};
  alignas(64) float v[width] = {};
  alignas(64) uint16_t p16[width] = {};
  alignas(64) char g[width * kGradSize<T>] = {};
  int64_t begin, rest;

  Tail(const AdamSpan& x, int64_t i) : begin(i), rest(x.n - i) {
    std::memcpy(w, x.weight + i, rest * sizeof(float));
    std::memcpy(m, x.exp_avg + i, rest * sizeof(float));
    std::memcpy(v, x.exp_avg_sq + i, rest * sizeof(float));
    std::memcpy(g, grad_at<T>(x.grad, i), rest * kGradSize<T>);
  }
  void store(const AdamSpan& x) const {
    std::memcpy(x.weight + begin, w, rest * sizeof(float));
    std::memcpy(x.exp_avg + begin, m, rest * sizeof(float));
    std::memcpy(x.exp_avg_sq + begin, v, rest * sizeof(float));
    if (x.param16) std::memcpy(x.param16 + begin, p16, rest * sizeof(uint16_t));
  }
};

// ---- AVX2 + FMA + F16C ---------------------------------------------------------------------

#define ZTRAIN_AVX2 __attribute__((target("avx2,fma,f16c")))

template <WeightType T>
ZTRAIN_AVX2 inline __m256 avx2_load_grad(const void* g) {
  if constexpr (T == WeightType::kFloat) return _mm256_loadu_ps(static_cast<const float*>(g));
  if constexpr (T == WeightType::kBFloat16) return ztrain::detail::avx2_load_bf16(static_cast<const uint16_t*>(g));
  return _mm256_cvtph_ps(_mm_loadu_si128(static_cast<const __m128i*>(g)));
}

template <WeightType T>
ZTRAIN_AVX2 inline void avx2_store_param16(uint16_t* p, __m256 w) {
  if constexpr (T == WeightType::kBFloat16) {
    ztrain::detail::avx2_store_bf16(p, w);
  } else {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(w, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
}

struct Avx2Scalars {
  __m256 beta1, one_minus_beta1, beta2, one_minus_beta2, bc2_sqrt, eps, neg_step, decay, weight_decay;
};

template <WeightType T, Decay D>
ZTRAIN_AVX2 inline void avx2_block(const Avx2Scalars& c, float* wp, uint16_t* p16, const void* gp, float* mp,
                                   float* vp) {
  __m256 w = _mm256_loadu_ps(wp), g = avx2_load_grad<T>(gp);
  __m256 m = _mm256_loadu_ps(mp), v = _mm256_loadu_ps(vp);
  if constexpr (D == Decay::kDecoupled) w = _mm256_mul_ps(w, c.decay);
  if constexpr (D == Decay::kCoupled) g = _mm256_fmadd_ps(w, c.weight_decay, g);
  m = _mm256_fmadd_ps(g, c.one_minus_beta1, _mm256_mul_ps(m, c.beta1));
  v = _mm256_fmadd_ps(_mm256_mul_ps(c.one_minus_beta2, g), g, _mm256_mul_ps(v, c.beta2));
  const __m256 denom = _mm256_add_ps(_mm256_div_ps(_mm256_sqrt_ps(v), c.bc2_sqrt), c.eps);
  w = _mm256_add_ps(w, _mm256_div_ps(_mm256_mul_ps(c.neg_step, m), denom));
  _mm256_storeu_ps(wp, w);
  _mm256_storeu_ps(mp, m);
  _mm256_storeu_ps(vp, v);
  if constexpr (T != WeightType::kFloat) avx2_store_param16<T>(p16, w);
}

template <WeightType T, Decay D>
ZTRAIN_AVX2 void avx2_span(const AdamScalars& s, const AdamSpan& x) {
  const Avx2Scalars c{_mm256_set1_ps(s.beta1),         _mm256_set1_ps(s.one_minus_beta1),
                      _mm256_set1_ps(s.beta2),         _mm256_set1_ps(s.one_minus_beta2),
                      _mm256_set1_ps(s.bias_correction2_sqrt), _mm256_set1_ps(s.eps),
                      _mm256_set1_ps(s.neg_step_size), _mm256_set1_ps(s.decay),
                      _mm256_set1_ps(s.weight_decay)};
  int64_t i = 0;
  for (; i + 8 <= x.n; i += 8) {
    avx2_block<T, D>(c, x.weight + i, x.param16 ? x.param16 + i : nullptr, grad_at<T>(x.grad, i), x.exp_avg + i,
                     x.exp_avg_sq + i);
  }
  if (i < x.n) {
    Tail<T, 8> t(x, i);
    avx2_block<T, D>(c, t.w, t.p16, t.g, t.m, t.v);
    t.store(x);
  }
}

// ---- AVX-512 -------------------------------------------------------------------------------

#define ZTRAIN_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")))

template <WeightType T>
ZTRAIN_AVX512 inline __m512 avx512_load_grad(const void* g) {
  if constexpr (T == WeightType::kFloat) return _mm512_loadu_ps(g);
  const __m256i h = _mm256_loadu_si256(static_cast<const __m256i*>(g));
  if constexpr (T == WeightType::kBFloat16) return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  return _mm512_cvtph_ps(h);
}

template <WeightType T>
ZTRAIN_AVX512 inline void avx512_store_param16(uint16_t* p, __m512 w) {
  __m256i h;
  if constexpr (T == WeightType::kBFloat16) {
    const __m512i b = _mm512_castps_si512(w);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(b, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(w, w, _CMP_UNORD_Q);
    r = _mm512_mask_blend_epi32(nan, r, _mm512_set1_epi32(0x7FC0));
    h = _mm512_cvtepi32_epi16(r);
  } else {
    h = _mm512_cvtps_ph(w, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  }
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), h);
}

struct Avx512Scalars {
  __m512 beta1, one_minus_beta1, beta2, one_minus_beta2, bc2_sqrt, eps, neg_step, decay, weight_decay;
};

template <WeightType T, Decay D>
ZTRAIN_AVX512 inline void avx512_block(const Avx512Scalars& c, float* wp, uint16_t* p16, const void* gp, float* mp,
                                       float* vp) {
  __m512 w = _mm512_loadu_ps(wp), g = avx512_load_grad<T>(gp);
  __m512 m = _mm512_loadu_ps(mp), v = _mm512_loadu_ps(vp);
  if constexpr (D == Decay::kDecoupled) w = _mm512_mul_ps(w, c.decay);
  if constexpr (D == Decay::kCoupled) g = _mm512_fmadd_ps(w, c.weight_decay, g);
  m = _mm512_fmadd_ps(g, c.one_minus_beta1, _mm512_mul_ps(m, c.beta1));
  v = _mm512_fmadd_ps(_mm512_mul_ps(c.one_minus_beta2, g), g, _mm512_mul_ps(v, c.beta2));
  const __m512 denom = _mm512_add_ps(_mm512_div_ps(_mm512_sqrt_ps(v), c.bc2_sqrt), c.eps);
  w = _mm512_add_ps(w, _mm512_div_ps(_mm512_mul_ps(c.neg_step, m), denom));
  _mm512_storeu_ps(wp, w);
  _mm512_storeu_ps(mp, m);
  _mm512_storeu_ps(vp, v);
  if constexpr (T != WeightType::kFloat) avx512_store_param16<T>(p16, w);
}

template <WeightType T, Decay D>
ZTRAIN_AVX512 void avx512_span(const AdamScalars& s, const AdamSpan& x) {
  const Avx512Scalars c{_mm512_set1_ps(s.beta1),         _mm512_set1_ps(s.one_minus_beta1),
                        _mm512_set1_ps(s.beta2),         _mm512_set1_ps(s.one_minus_beta2),
                        _mm512_set1_ps(s.bias_correction2_sqrt), _mm512_set1_ps(s.eps),
                        _mm512_set1_ps(s.neg_step_size), _mm512_set1_ps(s.decay),
                        _mm512_set1_ps(s.weight_decay)};
  int64_t i = 0;
  for (; i + 16 <= x.n; i += 16) {
    avx512_block<T, D>(c, x.weight + i, x.param16 ? x.param16 + i : nullptr, grad_at<T>(x.grad, i),
                       x.exp_avg + i, x.exp_avg_sq + i);
  }
  if (i < x.n) {
    Tail<T, 16> t(x, i);
    avx512_block<T, D>(c, t.w, t.p16, t.g, t.m, t.v);
    t.store(x);
  }
}

// ---- dispatch ------------------------------------------------------------------------------

template <WeightType T>
AdamSpanFn pick(AdamKernel kernel, Decay decay) {
  switch (kernel) {
    case AdamKernel::kScalar:
      return decay == Decay::kNone        ? scalar_span<T, Decay::kNone>
             : decay == Decay::kDecoupled ? scalar_span<T, Decay::kDecoupled>
                                          : scalar_span<T, Decay::kCoupled>;
    case AdamKernel::kAvx2:
      return decay == Decay::kNone        ? avx2_span<T, Decay::kNone>
             : decay == Decay::kDecoupled ? avx2_span<T, Decay::kDecoupled>
                                          : avx2_span<T, Decay::kCoupled>;
    case AdamKernel::kAvx512:
      return decay == Decay::kNone        ? avx512_span<T, Decay::kNone>
             : decay == Decay::kDecoupled ? avx512_span<T, Decay::kDecoupled>
                                          : avx512_span<T, Decay::kCoupled>;
    case AdamKernel::kTorchFused:
      break;  // not a span kernel: adam.cpp calls libtorch
  }
  return nullptr;
}

}  // namespace

AdamSpanFn adam_span_fn(AdamKernel kernel, WeightType type, Decay decay) {
  ZTRAIN_INTERNAL_ASSERT(adam_kernel_supported(kernel), "Adam kernel ", to_string(kernel),
                         " requested on a CPU that cannot run it");
  AdamSpanFn fn = nullptr;
  switch (type) {
    case WeightType::kFloat:
      fn = pick<WeightType::kFloat>(kernel, decay);
      break;
    case WeightType::kBFloat16:
      fn = pick<WeightType::kBFloat16>(kernel, decay);
      break;
    case WeightType::kHalf:
      fn = pick<WeightType::kHalf>(kernel, decay);
      break;
  }
  ZTRAIN_INTERNAL_ASSERT(fn != nullptr, "no Adam kernel for kernel ", static_cast<int>(kernel), " type ",
                         static_cast<int>(type));
  return fn;
}

}  // namespace detail
}  // namespace ztrain::optim
