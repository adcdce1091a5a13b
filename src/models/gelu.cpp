// GCC 12 reports its own AVX-512 intrinsics as possibly uninitialised once inlined (see
// attention.cpp); off before the first include, in a file compiled on its own.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif

#include <ztrain/models/fused.h>

#include "simd.h"

#include <ATen/Parallel.h>
#include <ATen/record_function.h>

#include <cmath>
#include <cstring>

// How it works
// ------------
// Both passes compute s = σ(2u) = 1 / (1 + exp(−2u)) per element, with u as in the header, then
//   forward:   y  = x · s
//   backward:  dx = dy · (s + 2x · s · (1 − s) · du/dx)
// The AVX2 kernel does 8 elements at a time, with simd.h's exp (on AVX-512 CPUs, 16 at a time
// through the same operations, so the same bits). Tails run through the same vector code on a
// small buffer, so every element of a tensor gets the same bits wherever it lies (a
// tensor-parallel slice equals the same features of the whole). The scalar kernel, for CPUs
// without AVX2 and FMA, uses std::exp. bf16 elements widen to float exactly and the result rounds
// to nearest even, as c10::BFloat16 rounds.

namespace ztrain::models {

namespace {

constexpr float kBeta = 0.7978845608028654f;  // √(2/π)
constexpr float kKappa = 0.044715f;
constexpr int64_t kGrain = 16384;  // elements per task of at::parallel_for

// ---- scalar ------------------------------------------------------------------------------------

using detail::simd::to_float;

template <class T>
T from_float(float v) {
  return static_cast<T>(v);  // c10::BFloat16: round to nearest even
}

float sigma_2u(float x) { return 1.0f / (1.0f + std::exp(-2.0f * kBeta * (x + kKappa * x * x * x))); }

template <class T>
void forward_scalar(const T* x, T* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float v = to_float(x[i]);
    y[i] = from_float<T>(v * sigma_2u(v));
  }
}

template <class T>
void backward_scalar(const T* dy, const T* x, T* dx, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float v = to_float(x[i]), s = sigma_2u(v);
    const float du = kBeta * (1.0f + 3.0f * kKappa * v * v);
    dx[i] = from_float<T>(to_float(dy[i]) * (s + 2.0f * v * s * (1.0f - s) * du));
  }
}

// ---- AVX2 --------------------------------------------------------------------------------------

using detail::simd::exp8;
using detail::simd::load8;
using detail::simd::store8;

// σ(2u) of x.
ZTRAIN_AVX2 inline __m256 sigma_2u8(__m256 x) {
  const __m256 x3 = _mm256_mul_ps(_mm256_mul_ps(x, x), x);
  const __m256 minus_2u = _mm256_mul_ps(_mm256_set1_ps(-2.0f * kBeta), _mm256_fmadd_ps(x3, _mm256_set1_ps(kKappa), x));
  const __m256 one = _mm256_set1_ps(1.0f);
  return _mm256_div_ps(one, _mm256_add_ps(one, exp8(minus_2u)));
}

ZTRAIN_AVX2 inline __m256 forward8(__m256 x) { return _mm256_mul_ps(x, sigma_2u8(x)); }

ZTRAIN_AVX2 inline __m256 backward8(__m256 dy, __m256 x) {
  const __m256 one = _mm256_set1_ps(1.0f), s = sigma_2u8(x);
  const __m256 du = _mm256_mul_ps(_mm256_set1_ps(kBeta),
                                  _mm256_fmadd_ps(_mm256_mul_ps(x, x), _mm256_set1_ps(3.0f * kKappa), one));
  const __m256 slope = _mm256_mul_ps(_mm256_mul_ps(_mm256_add_ps(x, x), _mm256_mul_ps(s, _mm256_sub_ps(one, s))), du);
  return _mm256_mul_ps(dy, _mm256_add_ps(s, slope));
}

template <class T>
ZTRAIN_AVX2 void forward_avx2(const T* x, T* y, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) store8(y + i, forward8(load8(x + i)));
  if (i == n) return;
  T in[8] = {}, out[8];
  std::memcpy(in, x + i, (n - i) * sizeof(T));
  store8(out, forward8(load8(in)));
  std::memcpy(y + i, out, (n - i) * sizeof(T));
}

template <class T>
ZTRAIN_AVX2 void backward_avx2(const T* dy, const T* x, T* dx, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) store8(dx + i, backward8(load8(dy + i), load8(x + i)));
  if (i == n) return;
  T g[8] = {}, in[8] = {}, out[8];
  std::memcpy(g, dy + i, (n - i) * sizeof(T));
  std::memcpy(in, x + i, (n - i) * sizeof(T));
  store8(out, backward8(load8(g), load8(in)));
  std::memcpy(dx + i, out, (n - i) * sizeof(T));
}

// ---- AVX-512 -----------------------------------------------------------------------------------
// backward8's and forward8's operations on 16 lanes, in their order, and bf16 rounded as store8
// rounds: the same bits per element. The tail runs on its lanes alone.

using detail::simd::exp16;
using detail::simd::load16;
using detail::simd::store16;

ZTRAIN_AVX512 inline __m512 sigma_2u16(__m512 x) {
  const __m512 x3 = _mm512_mul_ps(_mm512_mul_ps(x, x), x);
  const __m512 minus_2u = _mm512_mul_ps(_mm512_set1_ps(-2.0f * kBeta), _mm512_fmadd_ps(x3, _mm512_set1_ps(kKappa), x));
  const __m512 one = _mm512_set1_ps(1.0f);
  return _mm512_div_ps(one, _mm512_add_ps(one, exp16(minus_2u)));
}

template <class T>
ZTRAIN_AVX512 void forward_avx512(const T* x, T* y, int64_t n) {
  for (int64_t i = 0; i < n; i += 16) {
    const __m512 v = load16(x + i, n - i);
    store16(y + i, n - i, _mm512_mul_ps(v, sigma_2u16(v)));
  }
}

template <class T>
ZTRAIN_AVX512 void backward_avx512(const T* dy, const T* x, T* dx, int64_t n) {
  const __m512 one = _mm512_set1_ps(1.0f);
  for (int64_t i = 0; i < n; i += 16) {
    const __m512 v = load16(x + i, n - i), g = load16(dy + i, n - i), s = sigma_2u16(v);
    const __m512 du = _mm512_mul_ps(_mm512_set1_ps(kBeta),
                                    _mm512_fmadd_ps(_mm512_mul_ps(v, v), _mm512_set1_ps(3.0f * kKappa), one));
    const __m512 slope =
        _mm512_mul_ps(_mm512_mul_ps(_mm512_add_ps(v, v), _mm512_mul_ps(s, _mm512_sub_ps(one, s))), du);
    store16(dx + i, n - i, _mm512_mul_ps(g, _mm512_add_ps(s, slope)));
  }
}

// ---- dispatch ----------------------------------------------------------------------------------

torch::Tensor fused_forward(const torch::Tensor& input) {
  RECORD_FUNCTION("ztrain::gelu_tanh", std::vector<c10::IValue>({input}));
  const auto x = input.contiguous();
  auto y = torch::empty_like(x);
  const auto simd = detail::fused_simd();
  detail::simd::for_type(x.scalar_type(), [&]<class T>(T) {
    const T* px = x.data_ptr<T>();
    T* py = y.data_ptr<T>();
    at::parallel_for(0, x.numel(), kGrain, [&](int64_t begin, int64_t end) {
      if (simd >= detail::Simd::kAvx512) {
        forward_avx512(px + begin, py + begin, end - begin);
      } else if (simd != detail::Simd::kScalar) {
        forward_avx2(px + begin, py + begin, end - begin);
      } else {
        forward_scalar(px + begin, py + begin, end - begin);
      }
    });
  });
  return y;
}

torch::Tensor fused_backward(const torch::Tensor& grad, const torch::Tensor& input) {
  RECORD_FUNCTION("ztrain::gelu_tanh_backward", std::vector<c10::IValue>({grad, input}));
  const auto x = input.contiguous(), dy = grad.contiguous().to(x.scalar_type());
  auto dx = torch::empty_like(x);
  const auto simd = detail::fused_simd();
  detail::simd::for_type(x.scalar_type(), [&]<class T>(T) {
    const T *px = x.data_ptr<T>(), *pg = dy.data_ptr<T>();
    T* pdx = dx.data_ptr<T>();
    at::parallel_for(0, x.numel(), kGrain, [&](int64_t begin, int64_t end) {
      if (simd >= detail::Simd::kAvx512) {
        backward_avx512(pg + begin, px + begin, pdx + begin, end - begin);
      } else if (simd != detail::Simd::kScalar) {
        backward_avx2(pg + begin, px + begin, pdx + begin, end - begin);
      } else {
        backward_scalar(pg + begin, px + begin, pdx + begin, end - begin);
      }
    });
  });
  return dx;
}

struct GeluTanh : torch::autograd::Function<GeluTanh> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x) {
    ctx->save_for_backward({x});
    return fused_forward(x);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto x = ctx->get_saved_variables()[0];
    // A graph is being built (create_graph): libtorch's backward, which is itself differentiable.
    if (torch::GradMode::is_enabled()) return {at::gelu_backward(grads[0], x, "tanh")};
    return {fused_backward(grads[0], x)};
  }
};

}  // namespace

torch::Tensor gelu_tanh(const torch::Tensor& x) {
  if (!detail::simd::float_or_bf16_on_cpu(x)) return torch::gelu(x, "tanh");
  return GeluTanh::apply(x);
}

}  // namespace ztrain::models
