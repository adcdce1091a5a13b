// GCC 12 reports its own AVX-512 intrinsics as possibly uninitialised once inlined (see
// attention.cpp); off before the first include, in a file compiled on its own.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif

#include <ztrain/error.h>
#include <ztrain/models/fused.h>

#include "simd.h"

#include <ATen/Parallel.h>
#include <ATen/record_function.h>

#include <algorithm>
#include <cmath>
#include <limits>

// How it works
// ------------
// Forward: for each row of logits l (V elements), m = max(l) and lse = m + log Σ exp(l − m), in
// two passes over the row, which stays in cache between them; the loss is the mean of
// lse − l[target] over the rows whose target is not ignored, summed in double. lse ([N] floats)
// is all forward keeps besides its inputs.
// Backward: row i of the gradient is (exp(l − lse_i) − one-hot(target_i)) · g / count, written in
// one pass; rows whose target is ignored are zero.
// The AVX2 code sums 16 elements at a time in two accumulators and pads its tail with −inf, which
// adds exp(−inf) = 0; the AVX-512 code keeps the same 16 partial sums in one register, each lane
// adding the same elements in the same order, so both give the same bits. The scalar code, for
// CPUs without AVX2, uses std::exp.
// bf16 logits are read as the floats they widen to and every step runs in float; the loss is a
// float and the gradient is rounded to bf16 once, element by element. So both are exactly those of
// the float kernel on the widened logits, without a float copy of [N, V] (2 bytes an element kept
// from forward to backward instead of 4, and one conversion pass less each way).

namespace ztrain::models {

namespace {

using detail::simd::exp8;
using detail::simd::hmax;
using detail::simd::hsum;
using detail::simd::kMinusInf;
using detail::simd::load8;
using detail::simd::load_part;
using detail::simd::store8;
using detail::simd::store_part;

// ---- scalar ------------------------------------------------------------------------------------

using detail::simd::to_float;

template <class T>
float row_lse_scalar(const T* l, int64_t v) {
  float m = kMinusInf;
  for (int64_t j = 0; j < v; ++j) m = std::max(m, to_float(l[j]));
  double sum = 0;  // one accumulator: in float, its rounding would grow with the row
  for (int64_t j = 0; j < v; ++j) sum += std::exp(to_float(l[j]) - m);
  return m + static_cast<float>(std::log(sum));
}

float grad_scalar(float l, float lse, float scale) { return std::exp(l - lse) * scale; }

template <class T>
void row_grad_scalar(const T* l, float lse, float scale, T* out, int64_t v) {
  for (int64_t j = 0; j < v; ++j) out[j] = static_cast<T>(grad_scalar(to_float(l[j]), lse, scale));
}

// ---- AVX2 --------------------------------------------------------------------------------------

template <class T>
ZTRAIN_AVX2 float row_lse_avx2(const T* l, int64_t v) {
  const int64_t body = v / 8 * 8;
  __m256 m0 = _mm256_set1_ps(kMinusInf), m1 = m0;
  int64_t j = 0;
  for (; j + 16 <= body; j += 16) {
    m0 = _mm256_max_ps(m0, load8(l + j));
    m1 = _mm256_max_ps(m1, load8(l + j + 8));
  }
  if (j < body) m0 = _mm256_max_ps(m0, load8(l + j));
  if (body < v) m1 = _mm256_max_ps(m1, load_part(l + body, v - body, kMinusInf));
  const float m = hmax(_mm256_max_ps(m0, m1));
  const __m256 mv = _mm256_set1_ps(m);
  __m256 s0 = _mm256_setzero_ps(), s1 = s0;
  for (j = 0; j + 16 <= body; j += 16) {
    s0 = _mm256_add_ps(s0, exp8(_mm256_sub_ps(load8(l + j), mv)));
    s1 = _mm256_add_ps(s1, exp8(_mm256_sub_ps(load8(l + j + 8), mv)));
  }
  if (j < body) s0 = _mm256_add_ps(s0, exp8(_mm256_sub_ps(load8(l + j), mv)));
  if (body < v) s1 = _mm256_add_ps(s1, exp8(_mm256_sub_ps(load_part(l + body, v - body, kMinusInf), mv)));
  return m + std::log(hsum(_mm256_add_ps(s0, s1)));
}

ZTRAIN_AVX2 __m256 grad8(__m256 l, __m256 lse, __m256 scale) {
  return _mm256_mul_ps(exp8(_mm256_sub_ps(l, lse)), scale);
}

// One element's, the same float as its lane of the row's.
ZTRAIN_AVX2 float grad_avx2(float l, float lse, float scale) {
  return _mm256_cvtss_f32(grad8(_mm256_set1_ps(l), _mm256_set1_ps(lse), _mm256_set1_ps(scale)));
}

template <class T>
ZTRAIN_AVX2 void row_grad_avx2(const T* l, float lse, float scale, T* out, int64_t v) {
  const __m256 lv = _mm256_set1_ps(lse), sv = _mm256_set1_ps(scale);
  const int64_t body = v / 8 * 8;
  for (int64_t j = 0; j < body; j += 8) store8(out + j, grad8(load8(l + j), lv, sv));
  if (body < v) store_part(out + body, v - body, grad8(load_part(l + body, v - body, kMinusInf), lv, sv));
}

// ---- AVX-512 -----------------------------------------------------------------------------------

using detail::simd::exp16;
using detail::simd::load16;
using detail::simd::store16;

// A row's last r = v mod 16 elements, from l, in the lanes where the AVX2 code adds them: 8 or
// more in lanes 0 to r − 1; fewer than 8 in lanes 8 to 8 + r − 1 (its second accumulator). The
// other lanes hold −inf.
template <class T>
ZTRAIN_AVX512 __m512 row_tail16(const T* l, int64_t r) {
  float lanes[16];
  std::fill(lanes, lanes + 16, kMinusInf);
  std::transform(l, l + r, lanes + (r < 8 ? 8 : 0), [](T x) { return to_float(x); });
  return _mm512_loadu_ps(lanes);
}

// The 16 lanes' partial results folded as the AVX2 code folds its two accumulators.
ZTRAIN_AVX512 __m256 halves_max(__m512 x) {
  return _mm256_max_ps(_mm512_castps512_ps256(x), _mm512_extractf32x8_ps(x, 1));
}

ZTRAIN_AVX512 __m256 halves_sum(__m512 x) {
  return _mm256_add_ps(_mm512_castps512_ps256(x), _mm512_extractf32x8_ps(x, 1));
}

template <class T>
ZTRAIN_AVX512 float row_lse_avx512(const T* l, int64_t v) {
  const int64_t body = v / 16 * 16, r = v - body;
  __m512 mx = _mm512_set1_ps(kMinusInf);
  for (int64_t j = 0; j < body; j += 16) mx = _mm512_max_ps(mx, load16(l + j, 16));
  const __m512 tail = r ? row_tail16(l + body, r) : _mm512_set1_ps(kMinusInf);
  const float m = hmax(halves_max(_mm512_max_ps(mx, tail)));
  const __m512 mv = _mm512_set1_ps(m);
  __m512 sum = _mm512_setzero_ps();
  for (int64_t j = 0; j < body; j += 16) sum = _mm512_add_ps(sum, exp16(_mm512_sub_ps(load16(l + j, 16), mv)));
  if (r) sum = _mm512_add_ps(sum, exp16(_mm512_sub_ps(tail, mv)));
  return m + std::log(hsum(halves_sum(sum)));
}

template <class T>
ZTRAIN_AVX512 void row_grad_avx512(const T* l, float lse, float scale, T* out, int64_t v) {
  const __m512 lv = _mm512_set1_ps(lse), sv = _mm512_set1_ps(scale);
  for (int64_t j = 0; j < v; j += 16) {
    store16(out + j, v - j, _mm512_mul_ps(exp16(_mm512_sub_ps(load16(l + j, v - j), lv)), sv));
  }
}

// ---- the function ------------------------------------------------------------------------------

int64_t rows_per_task(int64_t v) { return std::max<int64_t>(1, 65536 / std::max<int64_t>(v, 1)); }

struct CrossEntropy : torch::autograd::Function<CrossEntropy> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& input,
                               const torch::Tensor& target, int64_t ignore_index) {
    RECORD_FUNCTION("ztrain::cross_entropy", std::vector<c10::IValue>({input, target}));
    const auto logits = input.contiguous();
    const auto targets = target.contiguous();
    const int64_t n = logits.size(0), v = logits.size(1);
    const int64_t* t = targets.data_ptr<int64_t>();
    int64_t count = 0;
    for (int64_t i = 0; i < n; ++i) {
      if (t[i] == ignore_index) continue;
      ZTRAIN_CHECK(t[i] >= 0 && t[i] < v, "cross_entropy: target ", t[i], " of row ", i, " is outside the ", v,
                   " classes [0, ", v, ")");
      ++count;
    }
    auto lse = torch::empty({n}, logits.options().dtype(torch::kFloat));
    float* out = lse.data_ptr<float>();
    const auto simd = detail::fused_simd();
    double total = 0;
    detail::simd::for_type(logits.scalar_type(), [&]<class T>(T) {
      const T* l = logits.data_ptr<T>();
      at::parallel_for(0, n, rows_per_task(v), [&](int64_t begin, int64_t end) {
        for (int64_t i = begin; i < end; ++i) {
          out[i] = simd >= detail::Simd::kAvx512  ? row_lse_avx512(l + i * v, v)
                   : simd != detail::Simd::kScalar ? row_lse_avx2(l + i * v, v)
                                                   : row_lse_scalar(l + i * v, v);
        }
      });
      for (int64_t i = 0; i < n; ++i) {
        if (t[i] != ignore_index) total += static_cast<double>(out[i]) - to_float(l[i * v + t[i]]);
      }
    });
    ctx->save_for_backward({input, target, lse});
    ctx->saved_data["ignore_index"] = ignore_index;
    ctx->saved_data["count"] = count;
    return torch::tensor(static_cast<float>(total / static_cast<double>(count)), lse.options());
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const int64_t ignore_index = ctx->saved_data["ignore_index"].toInt();
    const auto count = static_cast<double>(ctx->saved_data["count"].toInt());
    const auto& target = saved[1];
    if (torch::GradMode::is_enabled()) {  // building a graph (create_graph): in libtorch's ops
      const auto logits = saved[0].to(torch::kFloat);
      const auto valid = target.ne(ignore_index);
      const auto one_hot = torch::zeros_like(logits).scatter_(1, target.masked_fill(~valid, 0).unsqueeze(1), 1.0);
      const auto grad = (torch::softmax(logits, 1) - one_hot) * valid.unsqueeze(1) * grads[0] / count;
      return {grad.to(saved[0].scalar_type()), {}, {}};
    }
    RECORD_FUNCTION("ztrain::cross_entropy_backward", std::vector<c10::IValue>({saved[0], target}));
    const auto logits = saved[0].contiguous();
    const auto targets = target.contiguous();
    const auto lse = saved[2];
    const int64_t n = logits.size(0), v = logits.size(1);
    const auto scale = static_cast<float>(grads[0].item<double>() / count);
    auto grad = torch::empty_like(logits);
    const float* row_lse = lse.data_ptr<float>();
    const int64_t* t = targets.data_ptr<int64_t>();
    const auto simd = detail::fused_simd();
    const bool vector = simd != detail::Simd::kScalar;
    detail::simd::for_type(logits.scalar_type(), [&]<class T>(T) {
      const T* l = logits.data_ptr<T>();
      T* out = grad.data_ptr<T>();
      at::parallel_for(0, n, rows_per_task(v), [&](int64_t begin, int64_t end) {
        for (int64_t i = begin; i < end; ++i) {
          T* row = out + i * v;
          if (t[i] == ignore_index) {
            std::fill(row, row + v, T(0));
            continue;
          }
          if (simd >= detail::Simd::kAvx512) {
            row_grad_avx512(l + i * v, row_lse[i], scale, row, v);
          } else if (vector) {
            row_grad_avx2(l + i * v, row_lse[i], scale, row, v);
          } else {
            row_grad_scalar(l + i * v, row_lse[i], scale, row, v);
          }
          // the target's element minus the one-hot, in float before any rounding to T
          const float at_target = to_float(l[i * v + t[i]]);
          row[t[i]] = static_cast<T>((vector ? grad_avx2(at_target, row_lse[i], scale)
                                             : grad_scalar(at_target, row_lse[i], scale)) - scale);
        }
      });
    });
    return {grad, {}, {}};
  }
};

}  // namespace

torch::Tensor cross_entropy(const torch::Tensor& logits, const torch::Tensor& targets, int64_t ignore_index) {
  const bool fused = detail::simd::float_or_bf16_on_cpu(logits) && logits.dim() == 2 && targets.dim() == 1 &&
                     targets.scalar_type() == torch::kLong && targets.device().is_cpu() && logits.size(1) > 0;
  if (!fused) {
    const auto options = torch::nn::functional::CrossEntropyFuncOptions().ignore_index(ignore_index);
    if (logits.scalar_type() == torch::kBFloat16 || logits.scalar_type() == torch::kHalf) {
      return torch::nn::functional::cross_entropy(logits.to(torch::kFloat), targets, options);
    }
    return torch::nn::functional::cross_entropy(logits, targets, options);
  }
  ZTRAIN_CHECK(targets.size(0) == logits.size(0), "cross_entropy: ", targets.size(0), " targets for ", logits.size(0),
               " rows of logits");
  return CrossEntropy::apply(logits, targets, ignore_index);
}

}  // namespace ztrain::models
