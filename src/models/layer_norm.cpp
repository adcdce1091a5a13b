#include <ztrain/models/fused.h>

#include "simd.h"

#include <ATen/Parallel.h>
#include <ATen/record_function.h>

#include <algorithm>
#include <cmath>
#include <vector>

// How it works
// ------------
// Each row of d elements (d the last dimension) is normalised on its own:
//   forward:   μ = Σx / d,  r = 1 / √(Σ(x − μ)² / d + ε),  x̂ = (x − μ) · r,  y = x̂ · w + b
//   backward:  g = dy · w,  dx = r · (g − Σg / d − x̂ · Σ(g · x̂) / d),  dw = Σrows dy · x̂,  db = Σrows dy
// μ and the variance come from two passes, the second correcting the first's mean μ₀ by the mean of
// x − μ₀ (Chan, Golub and LeVeque's corrected two-pass algorithm): a row of large offset and small
// spread loses nothing to μ₀'s rounding. The scalar code, for CPUs without AVX2, sums in double.
// μ and r stay in float for backward ([rows] each, 4 bytes a row; libtorch keeps them in the input's
// dtype, bf16 for bf16). A row (GPT-2's 768 elements, 1.5 KB in bf16) stays in L1 between its
// passes: forward reads it three times and writes it once, backward reads x and dy twice each and
// writes dx once. dw and db add rows in blocks of kRowsPerBlock in float, one partial sum per block,
// and the partials in block order: the same bits whatever the thread count.

namespace ztrain::models {

namespace {

constexpr int64_t kRowsPerBlock = 64;

using detail::simd::to_float;

template <class T>
T from_float(float v) {
  return static_cast<T>(v);  // c10::BFloat16: round to nearest even
}

// The rows [begin, end) of x [rows, d] into y, their μ and r into mean and rstd.
struct Rows {
  int64_t begin, end, d;
};

// ---- scalar ------------------------------------------------------------------------------------

template <class T>
void forward_scalar(const T* x, const float* w, const float* b, T* y, float* mean, float* rstd, Rows rows, float eps) {
  const int64_t d = rows.d;
  for (int64_t row = rows.begin; row < rows.end; ++row) {
    const T* xr = x + row * d;
    double sum = 0, deviations = 0, squares = 0;  // the row's sums in double, on one accumulator each
    for (int64_t i = 0; i < d; ++i) sum += to_float(xr[i]);
    const float mu0 = static_cast<float>(sum / static_cast<double>(d));
    for (int64_t i = 0; i < d; ++i) {
      const float c = to_float(xr[i]) - mu0;
      deviations += c;
      squares += c * c;
    }
    const double shift = deviations / static_cast<double>(d);
    const float mu = static_cast<float>(mu0 + shift);
    const double variance = std::max(0.0, squares / static_cast<double>(d) - shift * shift);
    const auto r = static_cast<float>(1.0 / std::sqrt(variance + eps));
    for (int64_t i = 0; i < d; ++i) y[row * d + i] = from_float<T>((to_float(xr[i]) - mu) * r * w[i] + b[i]);
    mean[row] = mu;
    rstd[row] = r;
  }
}

// dx of the rows, and their dy · x̂ and dy added into dw and db.
template <class T>
void backward_scalar(const T* dy, const T* x, const float* w, const float* mean, const float* rstd, T* dx, float* dw,
                     float* db, Rows rows) {
  const int64_t d = rows.d;
  for (int64_t row = rows.begin; row < rows.end; ++row) {
    const T *xr = x + row * d, *gr = dy + row * d;
    const float mu = mean[row], r = rstd[row];
    double sum_g = 0, sum_gx = 0;
    for (int64_t i = 0; i < d; ++i) {
      const float g = to_float(gr[i]) * w[i], xhat = (to_float(xr[i]) - mu) * r;
      sum_g += g;
      sum_gx += g * xhat;
    }
    const auto a = static_cast<float>(sum_g / static_cast<double>(d));
    const auto c = static_cast<float>(sum_gx / static_cast<double>(d));
    for (int64_t i = 0; i < d; ++i) {
      const float g = to_float(gr[i]), xhat = (to_float(xr[i]) - mu) * r;
      dx[row * d + i] = from_float<T>(r * (g * w[i] - a - xhat * c));
      dw[i] += g * xhat;
      db[i] += g;
    }
  }
}

// ---- AVX2 --------------------------------------------------------------------------------------
// 8 elements at a time; a row's tail of d mod 8 is padded so that it adds nothing to the sums: x
// with μ (x − μ = 0), dy and the sums' inputs with 0.

using detail::simd::hsum;
using detail::simd::load8;
using detail::simd::load_part;
using detail::simd::store8;
using detail::simd::store_part;

// Elements [i, i + 8) of a row whose first `full` elements fill whole vectors: loaded whole, or the
// row's tail padded with `pad`.
template <class T>
ZTRAIN_AVX2 inline __m256 load_at(const T* row, int64_t i, int64_t full, int64_t tail, float pad) {
  return i < full ? load8(row + i) : load_part(row + i, tail, pad);
}

template <class T>
ZTRAIN_AVX2 inline void store_at(T* row, int64_t i, int64_t full, int64_t tail, __m256 v) {
  if (i < full) {
    store8(row + i, v);
  } else {
    store_part(row + i, tail, v);
  }
}

template <class T>
ZTRAIN_AVX2 void forward_avx2(const T* x, const float* w, const float* b, T* y, float* mean, float* rstd, Rows rows,
                              float eps) {
  const int64_t d = rows.d, full = d / 8 * 8, tail = d - full;
  for (int64_t row = rows.begin; row < rows.end; ++row) {
    const T* xr = x + row * d;
    __m256 sum = _mm256_setzero_ps();
    for (int64_t i = 0; i < d; i += 8) sum = _mm256_add_ps(sum, load_at(xr, i, full, tail, 0.0f));
    const float mu0 = hsum(sum) / static_cast<float>(d);
    const __m256 m0 = _mm256_set1_ps(mu0);
    __m256 deviations = _mm256_setzero_ps(), squares = _mm256_setzero_ps();
    for (int64_t i = 0; i < d; i += 8) {
      const __m256 c = _mm256_sub_ps(load_at(xr, i, full, tail, mu0), m0);
      deviations = _mm256_add_ps(deviations, c);
      squares = _mm256_fmadd_ps(c, c, squares);
    }
    const float shift = hsum(deviations) / static_cast<float>(d), mu = mu0 + shift;
    const float r = 1.0f / std::sqrt(std::max(0.0f, hsum(squares) / static_cast<float>(d) - shift * shift) + eps);
    const __m256 m = _mm256_set1_ps(mu);
    const __m256 rv = _mm256_set1_ps(r);
    for (int64_t i = 0; i < d; i += 8) {
      const __m256 xhat = _mm256_mul_ps(_mm256_sub_ps(load_at(xr, i, full, tail, mu), m), rv);
      const __m256 out = _mm256_fmadd_ps(xhat, load_at(w, i, full, tail, 0.0f), load_at(b, i, full, tail, 0.0f));
      store_at(y + row * d, i, full, tail, out);
    }
    mean[row] = mu;
    rstd[row] = r;
  }
}

template <class T>
ZTRAIN_AVX2 void backward_avx2(const T* dy, const T* x, const float* w, const float* mean, const float* rstd, T* dx,
                               float* dw, float* db, Rows rows) {
  const int64_t d = rows.d, full = d / 8 * 8, tail = d - full;
  for (int64_t row = rows.begin; row < rows.end; ++row) {
    const T *xr = x + row * d, *gr = dy + row * d;
    const float mu = mean[row];
    const __m256 m = _mm256_set1_ps(mu), r = _mm256_set1_ps(rstd[row]);
    __m256 sum_g = _mm256_setzero_ps(), sum_gx = _mm256_setzero_ps();
    for (int64_t i = 0; i < d; i += 8) {
      const __m256 xhat = _mm256_mul_ps(_mm256_sub_ps(load_at(xr, i, full, tail, mu), m), r);
      const __m256 g = _mm256_mul_ps(load_at(gr, i, full, tail, 0.0f), load_at(w, i, full, tail, 0.0f));
      sum_g = _mm256_add_ps(sum_g, g);
      sum_gx = _mm256_fmadd_ps(g, xhat, sum_gx);
    }
    const __m256 a = _mm256_set1_ps(hsum(sum_g) / static_cast<float>(d));
    const __m256 c = _mm256_set1_ps(hsum(sum_gx) / static_cast<float>(d));
    for (int64_t i = 0; i < d; i += 8) {
      const __m256 xhat = _mm256_mul_ps(_mm256_sub_ps(load_at(xr, i, full, tail, mu), m), r);
      const __m256 g = load_at(gr, i, full, tail, 0.0f), w8 = load_at(w, i, full, tail, 0.0f);
      const __m256 out = _mm256_mul_ps(r, _mm256_sub_ps(_mm256_fmsub_ps(g, w8, a), _mm256_mul_ps(xhat, c)));
      store_at(dx + row * d, i, full, tail, out);
      store_at(dw, i, full, tail, _mm256_fmadd_ps(g, xhat, load_at(dw, i, full, tail, 0.0f)));
      store_at(db, i, full, tail, _mm256_add_ps(load_at(db, i, full, tail, 0.0f), g));
    }
  }
}

// ---- dispatch ----------------------------------------------------------------------------------

// A parameter [d] as floats (bf16 widens exactly).
torch::Tensor floats(const torch::Tensor& p) { return p.to(torch::kFloat).contiguous(); }

struct Forward {
  torch::Tensor y, mean, rstd;
};

Forward fused_forward(const torch::Tensor& input, const torch::Tensor& weight, const torch::Tensor& bias, double eps) {
  RECORD_FUNCTION("ztrain::layer_norm", std::vector<c10::IValue>({input}));
  const auto x = input.contiguous();
  const int64_t d = x.size(-1), n = x.numel() / d;
  const auto w = floats(weight), b = floats(bias);
  Forward out{torch::empty_like(x), torch::empty({n}, x.options().dtype(torch::kFloat)),
              torch::empty({n}, x.options().dtype(torch::kFloat))};
  const bool vector = detail::fused_simd() != detail::Simd::kScalar;
  detail::simd::for_type(x.scalar_type(), [&]<class T>(T) {
    const T* px = x.data_ptr<T>();
    T* py = out.y.data_ptr<T>();
    const float *pw = w.data_ptr<float>(), *pb = b.data_ptr<float>();
    float *mean = out.mean.data_ptr<float>(), *rstd = out.rstd.data_ptr<float>();
    at::parallel_for(0, n, kRowsPerBlock, [&](int64_t begin, int64_t end) {
      const Rows rows{begin, end, d};
      if (vector) {
        forward_avx2(px, pw, pb, py, mean, rstd, rows, static_cast<float>(eps));
      } else {
        forward_scalar(px, pw, pb, py, mean, rstd, rows, static_cast<float>(eps));
      }
    });
  });
  return out;
}

// dx, dw and db (dw and db in the parameters' dtype).
torch::autograd::variable_list fused_backward(const torch::Tensor& grad, const torch::Tensor& input,
                                              const torch::Tensor& weight, const torch::Tensor& mean,
                                              const torch::Tensor& rstd) {
  RECORD_FUNCTION("ztrain::layer_norm_backward", std::vector<c10::IValue>({grad, input}));
  const auto x = input.contiguous(), dy = grad.contiguous().to(x.scalar_type());
  const int64_t d = x.size(-1), n = x.numel() / d, blocks = (n + kRowsPerBlock - 1) / kRowsPerBlock;
  const auto w = floats(weight);
  auto dx = torch::empty_like(x);
  auto partial_w = torch::zeros({blocks, d}, x.options().dtype(torch::kFloat));
  auto partial_b = torch::zeros_like(partial_w);
  const bool vector = detail::fused_simd() != detail::Simd::kScalar;
  detail::simd::for_type(x.scalar_type(), [&]<class T>(T) {
    const T *px = x.data_ptr<T>(), *pg = dy.data_ptr<T>();
    T* pdx = dx.data_ptr<T>();
    const float *pw = w.data_ptr<float>(), *pm = mean.data_ptr<float>(), *pr = rstd.data_ptr<float>();
    float *dw = partial_w.data_ptr<float>(), *db = partial_b.data_ptr<float>();
    at::parallel_for(0, blocks, 1, [&](int64_t first, int64_t last) {
      for (int64_t block = first; block < last; ++block) {
        const Rows rows{block * kRowsPerBlock, std::min(n, (block + 1) * kRowsPerBlock), d};
        if (vector) {
          backward_avx2(pg, px, pw, pm, pr, pdx, dw + block * d, db + block * d, rows);
        } else {
          backward_scalar(pg, px, pw, pm, pr, pdx, dw + block * d, db + block * d, rows);
        }
      }
    });
  });
  // The blocks' partial sums, in block order.
  auto dw = partial_w[0].clone(), db = partial_b[0].clone();
  for (int64_t block = 1; block < blocks; ++block) {
    dw.add_(partial_w[block]);
    db.add_(partial_b[block]);
  }
  return {dx, dw.to(weight.scalar_type()), db.to(weight.scalar_type())};
}

struct LayerNorm : torch::autograd::Function<LayerNorm> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x,
                               const torch::Tensor& weight, const torch::Tensor& bias, double eps) {
    auto out = fused_forward(x, weight, bias, eps);
    ctx->save_for_backward({x, weight, bias, out.mean, out.rstd});
    ctx->saved_data["eps"] = eps;
    return out.y;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto &x = saved[0], &weight = saved[1], &bias = saved[2];
    if (torch::GradMode::is_enabled()) {
      // A graph is being built (create_graph): libtorch's backward, which is itself differentiable.
      const double eps = ctx->saved_data["eps"].toDouble();
      const auto [y, mean, rstd] = at::native_layer_norm(x, {x.size(-1)}, weight, bias, eps);
      const auto [dx, dw, db] =
          at::native_layer_norm_backward(grads[0], x, {x.size(-1)}, mean, rstd, weight, bias, {true, true, true});
      return {dx, dw, db, torch::Tensor()};
    }
    auto out = fused_backward(grads[0], x, weight, saved[3], saved[4]);
    out.emplace_back();  // eps
    return out;
  }
};

}  // namespace

torch::Tensor layer_norm(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& bias, double eps) {
  const bool fused = detail::simd::float_or_bf16_on_cpu(x) && x.dim() >= 1 && x.numel() > 0 && weight.defined() &&
                     bias.defined() && weight.dim() == 1 && weight.size(0) == x.size(-1) &&
                     bias.sizes() == weight.sizes() && weight.device().is_cpu() && bias.device().is_cpu();
  if (!fused) return torch::layer_norm(x, {x.size(-1)}, weight, bias, eps);
  return LayerNorm::apply(x, weight, bias, eps);
}

}  // namespace ztrain::models
