// GCC 12 reports its own AVX-512 intrinsics as possibly uninitialised once inlined (see
// optim/adam_kernels.cpp); off before the first include, in a file compiled on its own.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif

#include <ztrain/cpu_matmul16.h>
#include <ztrain/error.h>
#include <ztrain/models/fused.h>

#include "bf16_gemm.h"
#include "simd.h"

#include <ATen/Parallel.h>
#include <ATen/ops/_scaled_dot_product_flash_attention_for_cpu_backward_cpu_dispatch.h>
#include <ATen/ops/_scaled_dot_product_flash_attention_for_cpu_cpu_dispatch.h>
#include <ATen/ops/addmm_cpu_dispatch.h>
#include <ATen/ops/mm_cpu_dispatch.h>
#include <ATen/record_function.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <cmath>
#include <limits>
#include <utility>
#include <vector>

// How it works
// ------------
// The queries go in blocks of kRows rows, each block of each (batch, head) a task. A block's
// scores S = Q kᵀ against the keys it may see (all of them, or under the causal mask those up to
// its last row) are one gemm into a buffer of kRows rows that stays in cache; a pass over each
// row turns it into exp(S · scale − the row's max) (scale 1 / √d unless given) with the
// positions the mask hides set to 0, times the dropout factors of their elements; a second gemm
// writes that times v into the output, laid out [b, t, h, d] so that the heads' outputs are
// already the rows the output projection reads, and each output row is divided by its row's sum
// of exponentials: softmax's normalisation on d elements a row instead of on the row's keys.
// Nothing of [t, t] size is kept: forward saves each row's log-sum-exp (lse = max + log Σ exp),
// and backward recomputes P from the scores and lse.
//
// Backward, per (batch, head), block by block: S = Q kᵀ again, P = exp(S · scale − lse),
// dP' = dO vᵀ, and with F the dropout factors and D = rowsum(P ∘ F ∘ dP') (which equals
// rowsum(dO ∘ O), the softmax's correction): dv += (P ∘ F)ᵀ dO, dS = P ∘ (dP' ∘ F − D) · scale,
// dq = dS k, dk += dSᵀ Q. D comes from the rows in cache rather than from O, whose rows lie
// h · d apart in memory: a pass more over the row, but no walk through O. It is
// rowsum(P ∘ F ∘ dP') / rowsum(P): the recomputed P carry lse's rounding, a factor common to the
// row (about 1 ± 2e-6 where lse is near 30), which would otherwise stay in dP' − D, small where
// a row is nearly one-hot (without the division dq was 1.5e-4 off the exact one at scale 2 on the
// shapes of fused_test.cpp, where libtorch's own float attention is 1.1e-5 off; with it, 0.9e-5).
//
// Five gemms a block, two of them accumulating into dk and dv. A task owns a (batch, key head)
// and runs the query heads that share it (one, without grouped-query heads; key head h / group
// serves query head h) one after the other, each from its last block to its first: the first
// head's last block, which sees the most keys, writes dk and dv, and everything after adds.
//
// bf16 operands, widened for the kernel where detail::attention_widened says so, keep their gemms
// in bf16 with float accumulation where the CPU has AVX-512 BF16 (bf16_gemm.h; libtorch's gemm of
// bf16 into float runs there at the speed of its float one): a task packs its key head's k and v
// as bf16 pairs once (forward kᵀ and v, backward kᵀ, vᵀ and k), and each block packs its rows of
// Q, dO, P and dS, so that P and dS are rounded to bf16 before their products, as in libtorch's
// bf16 flash attention. Forward's tasks are then whole heads, whose packing serves all their
// blocks. On a Zen 5 core this runs forward and backward of 2 × 12 heads of 1024 tokens 2.5× as
// fast as the gemms in float (bench/fused_bench.py: 66.9 against 163.9 ms). Where the CPU has AMX
// (Simd::kAmx) all seven run on its tiles, whose A is packed along its rows: for the two whose A
// is a transpose (Pᵀ·dO, dSᵀ·Q) a block's P and dS are packed down their columns.
//
// packed_attention runs the same kernel on views of one [b, t, 3, h, d] tensor and writes dq, dk
// and dv into one tensor of that layout.
//
// Dropout is the fused dropout's mask (dropout.cpp) over the [b, h, t_q, t_k] probabilities, drawn
// row by row: element ((b · h + head) · t_q + i) · t_k + j, under one seed from the default CPU
// generator. The probabilities after dropout are therefore exactly models::dropout of the
// materialised ones under the same generator state.
//
// Under the causal mask a block computes the scores up to its last row's diagonal, so on average
// kRows / 2 of each row's scores more than it needs: 1 + kRows / t_k times the work of the
// triangle (libtorch 2.11's CPU flash attention takes query blocks of 256 rows at t_q ≥ 768, of
// 64 from 192, of 32 below).
//
// The passes over a row run in the code models::detail::fused_simd() names: AVX-512 (16 floats a
// step, the tail under a mask), AVX2 (8) or scalar; exp16 is exp8's arithmetic on 16 lanes.

// The Fortran BLAS gemm, where the libraries loaded with libtorch define it (weak: null where not).
extern "C" void sgemm_(const char* transa, const char* transb, const int* m, const int* n, const int* k,
                       const float* alpha, const float* a, const int* lda, const float* b, const int* ldb,
                       const float* beta, float* c, const int* ldc) __attribute__((weak));

namespace ztrain::models {

namespace {

using detail::Simd;
using detail::simd::exp16;
using detail::simd::exp8;
using detail::simd::hmax;
using detail::simd::hsum;
using detail::simd::kMinusInf;
using detail::simd::lanes;
using detail::simd::load8;
using detail::simd::load_part;
using detail::simd::load_upto;
using detail::simd::store8;
using detail::simd::store_part;
using detail::simd::store_upto;

constexpr int64_t kRows = 64;  // query rows a block

// ---- one row ---------------------------------------------------------------------------------
// Forward: s[0, n) holds a row's scores q · k; they become exp(s · scale − max) times the dropout
// factors f (null: none), s[n, width) zeros: the row's probabilities before dividing by their sum,
// which the row of the output takes instead (a d-long row rather than a width-long one). Returns
// the row's lse in units of s · scale and 1 / the sum.
// Backward: s[0, n) holds the scores and dp[0, n) dO · v; s becomes P ∘ F and dp the row of
// dS, both 0 on [n, width): one pass makes P and dP' ∘ F and sums D's two sums, a second dS.

struct Row {
  float lse, inverse_sum;
};

Row forward_row_scalar(float* s, int64_t n, int64_t width, float scale, const float* f) {
  float m = kMinusInf;
  for (int64_t j = 0; j < n; ++j) m = std::max(m, s[j]);
  double sum = 0;
  for (int64_t j = 0; j < n; ++j) {
    const float e = std::exp((s[j] - m) * scale);
    sum += e;
    s[j] = f ? e * f[j] : e;
  }
  std::fill(s + n, s + width, 0.0f);
  return {m * scale + static_cast<float>(std::log(sum)), static_cast<float>(1 / sum)};
}

void backward_row_scalar(float* s, float* dp, int64_t n, int64_t width, float scale, float lse, const float* f) {
  float weighted = 0, sum = 0;
  for (int64_t j = 0; j < n; ++j) {
    s[j] = std::exp(s[j] * scale - lse);
    if (f) dp[j] *= f[j];
    weighted += s[j] * dp[j];
    sum += s[j];
  }
  const float d = weighted / sum;
  for (int64_t j = 0; j < n; ++j) {
    dp[j] = s[j] * (dp[j] - d) * scale;
    if (f) s[j] *= f[j];
  }
  std::fill(s + n, s + width, 0.0f);
  std::fill(dp + n, dp + width, 0.0f);
}

ZTRAIN_AVX2 Row forward_row_avx2(float* s, int64_t n, int64_t width, float scale, const float* f) {
  const int64_t body = n / 8 * 8;
  __m256 vm = _mm256_set1_ps(kMinusInf);
  for (int64_t j = 0; j < body; j += 8) vm = _mm256_max_ps(vm, load8(s + j));
  if (body < n) vm = _mm256_max_ps(vm, load_part(s + body, n - body, kMinusInf));
  const float m = hmax(vm);
  const __m256 vs = _mm256_set1_ps(scale), shift = _mm256_set1_ps(-m * scale);
  __m256 sum = _mm256_setzero_ps();
  for (int64_t j = 0; j < body; j += 8) {
    const __m256 e = exp8(_mm256_fmadd_ps(load8(s + j), vs, shift));
    store8(s + j, f ? _mm256_mul_ps(e, load8(f + j)) : e);
    sum = _mm256_add_ps(sum, e);
  }
  if (body < n) {  // padding of −inf adds exp(−inf) = 0
    const __m256 e = exp8(_mm256_fmadd_ps(load_part(s + body, n - body, kMinusInf), vs, shift));
    store_part(s + body, n - body, f ? _mm256_mul_ps(e, load_part(f + body, n - body, 0.0f)) : e);
    sum = _mm256_add_ps(sum, e);
  }
  std::fill(s + n, s + width, 0.0f);
  const float total = hsum(sum);
  return {m * scale + std::log(total), 1.0f / total};
}

// Elements [j, j + count) of a backward row, count ≤ 8. The first pass stores P and dP' ∘ F
// and adds P ∘ dP' ∘ F to `weighted` and P to `sum`; the second makes dS and P ∘ F.
ZTRAIN_AVX2 inline void backward_first(float* s, float* dp, int64_t j, int64_t count, __m256 scale, __m256 shift,
                                       const float* f, __m256& weighted, __m256& sum) {
  __m256 g = load_upto(dp + j, count, 0.0f);
  if (f) g = _mm256_mul_ps(g, load_upto(f + j, count, 0.0f));
  const __m256 prob = exp8(_mm256_fmadd_ps(load_upto(s + j, count, kMinusInf), scale, shift));  // 0 in the padding
  weighted = _mm256_fmadd_ps(prob, g, weighted);
  sum = _mm256_add_ps(sum, prob);
  store_upto(s + j, count, prob);
  store_upto(dp + j, count, g);
}

ZTRAIN_AVX2 inline void backward_second(float* s, float* dp, int64_t j, int64_t count, __m256 scale, __m256 d,
                                        const float* f) {
  const __m256 prob = load_upto(s + j, count, 0.0f);
  const __m256 ds = _mm256_mul_ps(_mm256_mul_ps(prob, _mm256_sub_ps(load_upto(dp + j, count, 0.0f), d)), scale);
  store_upto(dp + j, count, ds);
  if (f) store_upto(s + j, count, _mm256_mul_ps(prob, load_upto(f + j, count, 0.0f)));
}

ZTRAIN_AVX2 void backward_row_avx2(float* s, float* dp, int64_t n, int64_t width, float scale, float lse,
                                   const float* f) {
  const __m256 vs = _mm256_set1_ps(scale), shift = _mm256_set1_ps(-lse);
  __m256 weighted = _mm256_setzero_ps(), sum = _mm256_setzero_ps();
  for (int64_t j = 0; j < n; j += 8) backward_first(s, dp, j, std::min<int64_t>(8, n - j), vs, shift, f, weighted, sum);
  const __m256 d = _mm256_set1_ps(hsum(weighted) / hsum(sum));
  for (int64_t j = 0; j < n; j += 8) backward_second(s, dp, j, std::min<int64_t>(8, n - j), vs, d, f);
  std::fill(s + n, s + width, 0.0f);
  std::fill(dp + n, dp + width, 0.0f);
}

// The same in AVX-512, 16 elements a step, a row's tail under a mask.
ZTRAIN_AVX512 Row forward_row_avx512(float* s, int64_t n, int64_t width, float scale, const float* f) {
  __m512 vm = _mm512_set1_ps(kMinusInf);
  for (int64_t j = 0; j < n; j += 16) vm = _mm512_max_ps(vm, _mm512_mask_loadu_ps(vm, lanes(n - j), s + j));
  const float m = _mm512_reduce_max_ps(vm);
  const __m512 vs = _mm512_set1_ps(scale), shift = _mm512_set1_ps(-m * scale);
  __m512 sum = _mm512_setzero_ps();
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 k = lanes(n - j);
    const __m512 e = exp16(_mm512_fmadd_ps(_mm512_maskz_loadu_ps(k, s + j), vs, shift));
    _mm512_mask_storeu_ps(s + j, k, f ? _mm512_mul_ps(e, _mm512_maskz_loadu_ps(k, f + j)) : e);
    sum = _mm512_mask_add_ps(sum, k, sum, e);
  }
  std::fill(s + n, s + width, 0.0f);
  const float total = _mm512_reduce_add_ps(sum);
  return {m * scale + std::log(total), 1.0f / total};
}

ZTRAIN_AVX512 void backward_row_avx512(float* s, float* dp, int64_t n, int64_t width, float scale, float lse,
                                       const float* f) {
  const __m512 vs = _mm512_set1_ps(scale), shift = _mm512_set1_ps(-lse);
  __m512 weighted = _mm512_setzero_ps(), sum = _mm512_setzero_ps();
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 k = lanes(n - j);
    const __m512 prob = exp16(_mm512_fmadd_ps(_mm512_maskz_loadu_ps(k, s + j), vs, shift));
    __m512 g = _mm512_maskz_loadu_ps(k, dp + j);
    if (f) g = _mm512_mul_ps(g, _mm512_maskz_loadu_ps(k, f + j));
    weighted = _mm512_mask3_fmadd_ps(prob, g, weighted, k);
    sum = _mm512_mask_add_ps(sum, k, sum, prob);
    _mm512_mask_storeu_ps(s + j, k, prob);
    _mm512_mask_storeu_ps(dp + j, k, g);
  }
  const __m512 d = _mm512_set1_ps(_mm512_reduce_add_ps(weighted) / _mm512_reduce_add_ps(sum));
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 k = lanes(n - j);
    const __m512 prob = _mm512_maskz_loadu_ps(k, s + j);
    const __m512 ds = _mm512_mul_ps(_mm512_mul_ps(prob, _mm512_sub_ps(_mm512_maskz_loadu_ps(k, dp + j), d)), vs);
    _mm512_mask_storeu_ps(dp + j, k, ds);
    if (f) _mm512_mask_storeu_ps(s + j, k, _mm512_mul_ps(prob, _mm512_maskz_loadu_ps(k, f + j)));
  }
  std::fill(s + n, s + width, 0.0f);
  std::fill(dp + n, dp + width, 0.0f);
}

// The rows' code that `simd` picks.
Row forward_row(Simd simd, float* s, int64_t n, int64_t width, float scale, const float* f) {
  return simd >= Simd::kAvx512 ? forward_row_avx512(s, n, width, scale, f)
         : simd == Simd::kAvx2 ? forward_row_avx2(s, n, width, scale, f)
                               : forward_row_scalar(s, n, width, scale, f);
}

void backward_row(Simd simd, float* s, float* dp, int64_t n, int64_t width, float scale, float lse, const float* f) {
  if (simd >= Simd::kAvx512) {
    backward_row_avx512(s, dp, n, width, scale, lse, f);
  } else if (simd == Simd::kAvx2) {
    backward_row_avx2(s, dp, n, width, scale, lse, f);
  } else {
    backward_row_scalar(s, dp, n, width, scale, lse, f);
  }
}

// ---- blocks ----------------------------------------------------------------------------------
// The float gemms go to the BLAS that libtorch calls, directly (its sgemm_, where the libtorch
// build exports one: PyPI's x86 builds do, from MKL), else to libtorch's CPU kernel on from_blob
// views (at::cpu::…, not through the dispatcher). A block's gemms are small: at 64 tokens the
// operator's own work (views, checks, conjugation flags) cost GPT-2's fp32 attention 139 of its
// 2191 ms step on an AMX Xeon core, against 98 through sgemm_.

// A [b, h, t, d] tensor's heads as raw rows (unit stride along d).
struct Heads {
  float* data;
  int64_t heads, stride_b, stride_h, stride_t, d;

  static Heads of(const torch::Tensor& x) {
    TORCH_INTERNAL_ASSERT(x.stride(3) == 1);
    return {x.data_ptr<float>(), x.size(1), x.stride(0), x.stride(1), x.stride(2), x.size(3)};
  }
  float* row(int64_t bh, int64_t i) const {
    return data + bh / heads * stride_b + bh % heads * stride_h + i * stride_t;
  }
  // Rows [i0, i0 + n) of head bh as an [n, d] matrix.
  torch::Tensor rows(int64_t bh, int64_t i0, int64_t n) const { return view(row(bh, i0), {n, d}, {stride_t, 1}); }

  static torch::Tensor view(float* p, at::IntArrayRef sizes, at::IntArrayRef strides) {
    return torch::from_blob(p, sizes, strides, torch::TensorOptions().dtype(torch::kFloat));
  }
};

// c[m, n] (rows ldc apart) = op(a) · op(b) (+ c if accumulate), row-major: op(a) [m, k] is a's rows
// lda apart, or where `ta` the transpose of a [k, m] (rows lda apart); op(b) [k, n] likewise.
void gemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, const float* a, int64_t lda, const float* b,
          int64_t ldb, float* c, int64_t ldc, bool accumulate) {
  // BLAS takes int sizes, and leading dimensions that cover their rows (a gradient broadcast over
  // the tokens, rows 0 apart, goes to libtorch's kernel, which copies it)
  constexpr int64_t kMax = std::numeric_limits<int>::max();
  const bool blas_fits = std::max({m, n, k, lda, ldb, ldc}) <= kMax && lda >= std::max<int64_t>(1, ta ? m : k) &&
                         ldb >= std::max<int64_t>(1, tb ? k : n) && ldc >= std::max<int64_t>(1, n);
  if (detail::attention_blas() && blas_fits) {
    // column-major, as BLAS reads it: cᵀ [n, m] = op(b)ᵀ · op(a)ᵀ
    const int im = static_cast<int>(m), in = static_cast<int>(n), ik = static_cast<int>(k);
    const int ila = static_cast<int>(lda), ilb = static_cast<int>(ldb), ilc = static_cast<int>(ldc);
    const float one = 1, beta = accumulate ? 1 : 0;
    return sgemm_(tb ? "T" : "N", ta ? "T" : "N", &in, &im, &ik, &one, b, &ilb, a, &ila, &beta, c, &ilc);
  }
  const auto operand = [](const float* x, bool t, int64_t rows, int64_t cols, int64_t ld) {
    return Heads::view(const_cast<float*>(x), {rows, cols}, t ? at::IntArrayRef{1, ld} : at::IntArrayRef{ld, 1});
  };
  auto out = Heads::view(c, {m, n}, {ldc, 1});
  if (accumulate) {
    at::cpu::addmm_(out, operand(a, ta, m, k, lda), operand(b, tb, k, n, ldb));
  } else {
    at::cpu::mm_out(out, operand(a, ta, m, k, lda), operand(b, tb, k, n, ldb));
  }
}

// One call's shapes and settings.
struct Problem {
  Heads q, k, v;
  int64_t batch, heads, tq, tk;
  int64_t group;  // query heads a key head serves
  float scale;
  bool causal;
  double p;       // dropout
  uint64_t seed;  // of its mask
  Simd simd;
  bool bf16_dot;  // q, k and v are bf16 widened, and the blocks' gemms run in bf16 (kAvx512Bf16, kAmx)

  int64_t keys_seen(int64_t row) const { return causal ? std::min(row + 1, tk) : tk; }
  // The key and value head (b · heads / group + h / group) of query head bh (b · heads + h).
  int64_t kv(int64_t bh) const { return bh / heads * (heads / group) + bh % heads / group; }
  // The dropout factors of row i of head bh (b · heads + h), keys [0, n); null without dropout.
  const float* factors(int64_t bh, int64_t i, int64_t n, float* f) const {
    if (p == 0) return nullptr;
    detail::dropout_factors(seed, p, (bh * tq + i) * tk, n, f);
    return f;
  }
};

// The operands of the blocks' gemms in bf16 (bf16_gemm.h), where Problem::bf16_dot: a key head's
// k and v packed once for all its blocks, and scratch for a block's.
struct Bf16Operands {
  bool amx;  // the products on AMX's tiles (Simd::kAmx)
  std::vector<uint32_t> k_t, v_t, k, v;  // kᵀ and vᵀ as B over the head size, k and v over the keys
  std::vector<uint32_t> a, b;

  void gemm(int64_t m, int64_t n, int64_t kp, int64_t lda, const uint32_t* b_words, int64_t ldb, float* c,
            int64_t ldc) const {
    if (amx) return detail::bf16_gemm_amx(m, n, kp, a.data(), lda, b_words, ldb, c, ldc, false);
    detail::bf16_gemm(m, n, kp, a.data(), lda, 1, b_words, ldb, c, ldc, false);
  }

  // Forward's kᵀ and v, or backward's kᵀ, vᵀ and k.
  void pack_head(const Problem& pr, int64_t kv, bool backward) {
    const int64_t keys = detail::padded16(pr.tk), pairs = (pr.tk + 1) / 2;
    const auto transposed = [&](const Heads& x, std::vector<uint32_t>& out) {
      out.resize((x.d + 1) / 2 * keys);
      detail::pack_transposed(x.row(kv, 0), pr.tk, x.d, x.stride_t, out.data(), keys);
    };
    const auto row_pairs = [&](const Heads& x, std::vector<uint32_t>& out) {
      out.resize(pairs * detail::padded16(x.d));
      detail::pack_row_pairs(x.row(kv, 0), pr.tk, x.d, x.stride_t, out.data(), detail::padded16(x.d));
    };
    transposed(pr.k, k_t);
    if (backward) {
      transposed(pr.v, v_t);
      row_pairs(pr.k, k);
    } else {
      row_pairs(pr.v, v);
    }
  }

  // c[rows, width] = x · yᵀ: x `rows` rows of n floats `stride` apart, y_t a key head's packed yᵀ.
  void times_transposed(const float* x, int64_t stride, int64_t n, int64_t rows, const std::vector<uint32_t>& y_t,
                        int64_t tk, int64_t width, float* c) {
    const int64_t kp = (n + 1) / 2;
    a.resize(rows * kp);
    detail::pack_rows(x, rows, n, stride, a.data(), kp);
    gemm(rows, width, kp, kp, y_t.data(), detail::padded16(tk), c, width);
  }

  // c[rows, n] (rows ldc apart) = s · y[0, width): s [rows, width], y a key head's packed rows of n.
  // An odd width's last key is added on its own: its pair's second half is the next key, which
  // these rows do not see and whose values may be anything (an infinity times 0 is NaN).
  void times(const float* s, int64_t rows, int64_t width, const std::vector<uint32_t>& y, int64_t n, float* c,
             int64_t ldc) {
    const int64_t kp = (width + 1) / 2, whole = width / 2, ldy = detail::padded16(n);
    a.resize(rows * kp);
    detail::pack_rows(s, rows, width, width, a.data(), kp);
    gemm(rows, n, whole, kp, y.data(), ldy, c, ldc);
    if (width % 2 == 0) return;
    const auto first_half = [](uint32_t pair) { return std::bit_cast<float>(pair << 16); };
    const uint32_t* last = y.data() + whole * ldy;
    for (int64_t i = 0; i < rows; ++i) {
      const float p = first_half(a[i * kp + whole]);
      for (int64_t j = 0; j < n; ++j) c[i * ldc + j] += p * first_half(last[j]);
    }
  }

  // c[width, n] (rows ldc apart) = sᵀ · x (+ c if accumulate): s [rows, width], x `rows` rows of n
  // floats `stride` apart.
  void transposed_times(const float* s, int64_t rows, int64_t width, const float* x, int64_t stride, int64_t n,
                        float* c, int64_t ldc, bool accumulate) {
    const int64_t kp = (rows + 1) / 2, lda = detail::padded16(width), ldb = detail::padded16(n);
    b.resize(kp * ldb);
    detail::pack_row_pairs(x, rows, n, stride, b.data(), ldb);
    if (amx) {  // sᵀ's words along its rows
      a.resize(width * kp);
      detail::pack_columns(s, rows, width, width, a.data(), kp);
      return detail::bf16_gemm_amx(width, n, kp, a.data(), kp, b.data(), ldb, c, ldc, accumulate);
    }
    a.resize(kp * lda);
    detail::pack_row_pairs(s, rows, width, width, a.data(), lda);
    detail::bf16_gemm(width, n, kp, a.data(), 1, lda, b.data(), ldb, c, ldc, accumulate);
  }
};

// One block of queries of head bh; `bf16` null where the gemms run in float.
void forward_block(const Problem& pr, int64_t bh, int64_t i0, const Heads& out, float* lse, float* buffer, float* f,
                   Bf16Operands* bf16) {
  const int64_t rows = std::min(kRows, pr.tq - i0), width = pr.keys_seen(i0 + rows - 1);
  if (bf16) {
    bf16->times_transposed(pr.q.row(bh, i0), pr.q.stride_t, pr.q.d, rows, bf16->k_t, pr.tk, width, buffer);
  } else {
    gemm(false, true, rows, width, pr.q.d, pr.q.row(bh, i0), pr.q.stride_t, pr.k.row(pr.kv(bh), 0), pr.k.stride_t,
         buffer, width, false);
  }
  float inverse_sum[kRows];
  for (int64_t i = i0; i < i0 + rows; ++i) {
    const int64_t n = pr.keys_seen(i);
    const float* factors = pr.factors(bh, i, n, f);
    float* row = buffer + (i - i0) * width;
    const Row r = forward_row(pr.simd, row, n, width, pr.scale, factors);
    lse[i] = r.lse;
    inverse_sum[i - i0] = r.inverse_sum;
  }
  if (bf16) {
    bf16->times(buffer, rows, width, bf16->v, out.d, out.row(bh, i0), out.stride_t);
  } else {
    gemm(false, false, rows, out.d, width, buffer, width, pr.v.row(pr.kv(bh), 0), pr.v.stride_t, out.row(bh, i0),
         out.stride_t, false);
  }
  for (int64_t i = i0; i < i0 + rows; ++i) {
    float* y = out.row(bh, i);
    for (int64_t c = 0; c < out.d; ++c) y[c] *= inverse_sum[i - i0];
  }
}

struct Gradients {
  Heads grad_out, dq, dk, dv;
};

// Query head bh's share of dq, dk and dv; `first`: the first of its key head's query heads, which
// writes dk and dv where the others add to them; `bf16` (its key head packed) null where the gemms
// run in float.
void backward_head(const Problem& pr, int64_t bh, bool first, const Gradients& g, const float* lse, float* s_buffer,
                   float* dp_buffer, float* f, Bf16Operands* bf16) {
  const int64_t blocks = (pr.tq + kRows - 1) / kRows, kv = pr.kv(bh);
  for (int64_t blk = blocks - 1; blk >= 0; --blk) {
    const int64_t i0 = blk * kRows, rows = std::min(kRows, pr.tq - i0), width = pr.keys_seen(i0 + rows - 1);
    const float *q_rows = pr.q.row(bh, i0), *go_rows = g.grad_out.row(bh, i0);
    const int64_t go_stride = g.grad_out.stride_t;
    if (bf16) {
      bf16->times_transposed(q_rows, pr.q.stride_t, pr.q.d, rows, bf16->k_t, pr.tk, width, s_buffer);
      bf16->times_transposed(go_rows, go_stride, g.grad_out.d, rows, bf16->v_t, pr.tk, width, dp_buffer);
    } else {
      gemm(false, true, rows, width, pr.q.d, q_rows, pr.q.stride_t, pr.k.row(kv, 0), pr.k.stride_t, s_buffer, width,
           false);
      gemm(false, true, rows, width, pr.v.d, go_rows, go_stride, pr.v.row(kv, 0), pr.v.stride_t, dp_buffer, width,
           false);
    }
    for (int64_t i = i0; i < i0 + rows; ++i) {
      const int64_t n = pr.keys_seen(i);
      const float* factors = pr.factors(bh, i, n, f);
      float *srow = s_buffer + (i - i0) * width, *dprow = dp_buffer + (i - i0) * width;
      backward_row(pr.simd, srow, dprow, n, width, pr.scale, lse[i], factors);
    }
    // the block that sees the most keys writes dk and dv; the others' keys are a prefix of its
    const bool writes = first && blk == blocks - 1;
    if (bf16) {
      bf16->times(dp_buffer, rows, width, bf16->k, g.dq.d, g.dq.row(bh, i0), g.dq.stride_t);
      bf16->transposed_times(s_buffer, rows, width, go_rows, go_stride, g.dv.d, g.dv.row(kv, 0), g.dv.stride_t,
                             !writes);
      bf16->transposed_times(dp_buffer, rows, width, q_rows, pr.q.stride_t, g.dk.d, g.dk.row(kv, 0), g.dk.stride_t,
                             !writes);
    } else {
      gemm(false, false, rows, g.dq.d, width, dp_buffer, width, pr.k.row(kv, 0), pr.k.stride_t, g.dq.row(bh, i0),
           g.dq.stride_t, false);
      gemm(true, false, width, g.dv.d, rows, s_buffer, width, go_rows, go_stride, g.dv.row(kv, 0), g.dv.stride_t,
           !writes);
      gemm(true, false, width, g.dk.d, rows, dp_buffer, width, q_rows, pr.q.stride_t, g.dk.row(kv, 0), g.dk.stride_t,
           !writes);
    }
    if (writes && width < pr.tk) {  // keys no query sees (causal, t_q < t_k)
      g.dk.rows(kv, width, pr.tk - width).zero_();
      g.dv.rows(kv, width, pr.tk - width).zero_();
    }
  }
}

// x itself where its last dimension is unit-strided, else a contiguous copy.
torch::Tensor rows_contiguous(const torch::Tensor& x) { return x.stride(-1) == 1 ? x : x.contiguous(); }

// `from_bf16`: q, k and v are the widening of bf16 tensors (exact in bf16).
Problem problem_of(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, double p, uint64_t seed,
                   bool causal, double scale, bool from_bf16) {
  const Simd simd = detail::fused_simd();
  return {.q = Heads::of(q),
          .k = Heads::of(k),
          .v = Heads::of(v),
          .batch = q.size(0),
          .heads = q.size(1),
          .tq = q.size(2),
          .tk = k.size(2),
          .group = q.size(1) / k.size(1),
          .scale = static_cast<float>(scale),
          .causal = causal,
          .p = p,
          .seed = seed,
          .simd = simd,
          .bf16_dot = from_bf16 && simd >= Simd::kAvx512Bf16};
}

// The same in differentiable libtorch operations on the whole [b, h, t_q, t_k] matrices: the
// backward of a backward that builds a graph (create_graph).
std::vector<torch::Tensor> backward_differentiable(const Problem& pr, const torch::Tensor& q,
                                                   const torch::Tensor& key, const torch::Tensor& value,
                                                   const torch::Tensor& grad_out) {
  // each key head repeated for the query heads it serves, their gradients summed back below
  const auto k = key.repeat_interleave(pr.group, 1), v = value.repeat_interleave(pr.group, 1);
  auto scores = torch::matmul(q, k.transpose(-2, -1)) * pr.scale;
  if (pr.causal) {
    scores = scores.masked_fill(torch::ones({pr.tq, pr.tk}, q.options().dtype(torch::kBool)).triu(1), kMinusInf);
  }
  const auto prob = torch::softmax(scores, -1);
  auto factors = torch::ones_like(prob);
  if (pr.p > 0) {
    factors = torch::empty(prob.sizes(), q.options());
    detail::dropout_factors(pr.seed, pr.p, 0, factors.numel(), factors.data_ptr<float>());
  }
  const auto dropped = prob * factors;
  const auto d_dropped = torch::matmul(grad_out, v.transpose(-2, -1)) * factors;
  const auto ds = prob * (d_dropped - (d_dropped * prob).sum(-1, true)) * pr.scale;
  const auto per_key_head = [&](const torch::Tensor& x) { return x.unflatten(1, {-1, pr.group}).sum(2); };
  return {torch::matmul(ds, k), per_key_head(torch::matmul(ds.transpose(-2, -1), q)),
          per_key_head(torch::matmul(dropped.transpose(-2, -1), grad_out))};
}

// The kernel's forward: y, [b, h, t_q, d_v] as a view of [b, t_q, h, d_v], and each query's
// log-sum-exp, [b · h, t_q].
std::pair<torch::Tensor, torch::Tensor> fused_forward(const Problem& pr, const torch::Tensor& q,
                                                      const torch::Tensor& v) {
  const auto y = torch::empty({pr.batch, pr.tq, pr.heads, v.size(3)}, q.options()).transpose(1, 2);
  const auto lse = torch::empty({pr.batch * pr.heads, pr.tq}, q.options());
  const Heads out = Heads::of(y);
  const int64_t blocks = (pr.tq + kRows - 1) / kRows;
  // a task per block of each head, or in bf16 per head, whose key head is packed once for its blocks
  const int64_t per_task = pr.bf16_dot ? blocks : 1;
  at::parallel_for(0, pr.batch * pr.heads * blocks / per_task, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> buffer(kRows * pr.tk), f(pr.tk);
    Bf16Operands bf16{.amx = pr.simd == Simd::kAmx};
    for (int64_t task = begin; task < end; ++task) {
      const int64_t bh = task * per_task / blocks;
      if (pr.bf16_dot) bf16.pack_head(pr, pr.kv(bh), false);
      for (int64_t blk = task * per_task % blocks; blk < task * per_task % blocks + per_task; ++blk) {
        forward_block(pr, bh, blk * kRows, out, lse.data_ptr<float>() + bh * pr.tq, buffer.data(), f.data(),
                      pr.bf16_dot ? &bf16 : nullptr);
      }
    }
  });
  return {y, lse};
}

// The kernel's backward into dq, dk and dv ([b, h, t, d] views with unit stride along d).
void fused_backward(const Problem& pr, const torch::Tensor& grad, const torch::Tensor& lse, const torch::Tensor& dq,
                    const torch::Tensor& dk, const torch::Tensor& dv) {
  const auto grad_out = rows_contiguous(grad);
  const Gradients g{Heads::of(grad_out), Heads::of(dq), Heads::of(dk), Heads::of(dv)};
  // a task per key head, its query heads in turn: only it writes that head's dk and dv
  at::parallel_for(0, pr.batch * pr.heads / pr.group, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> s(kRows * pr.tk), dp(kRows * pr.tk), f(pr.tk);
    Bf16Operands bf16{.amx = pr.simd == Simd::kAmx};
    for (int64_t task = begin; task < end; ++task) {
      if (pr.bf16_dot) bf16.pack_head(pr, task, true);
      for (int64_t member = 0; member < pr.group; ++member) {
        const int64_t bh = task * pr.group + member;
        backward_head(pr, bh, member == 0, g, lse.data_ptr<float>() + bh * pr.tq, s.data(), dp.data(), f.data(),
                      pr.bf16_dot ? &bf16 : nullptr);
      }
    }
  });
}

// Both functions' forward: the kernel on q, k and v, saving `inputs` (what backward finds q, k and
// v in), lse and the settings.
torch::Tensor forward_saving(torch::autograd::AutogradContext* ctx, const torch::Tensor& q, const torch::Tensor& k,
                             const torch::Tensor& v, double p, bool causal, double scale, bool from_bf16,
                             std::vector<torch::Tensor> inputs) {
  const Problem pr = problem_of(q, k, v, p, p > 0 ? detail::dropout_seed() : 0, causal, scale, from_bf16);
  auto [y, lse] = fused_forward(pr, q, v);
  inputs.push_back(lse);
  ctx->save_for_backward(inputs);
  ctx->saved_data["seed"] = static_cast<int64_t>(pr.seed);
  ctx->saved_data["p"] = p;
  ctx->saved_data["causal"] = causal;
  ctx->saved_data["scale"] = scale;
  ctx->saved_data["from_bf16"] = from_bf16;
  return y;
}

// Both functions' backward: dq, dk and dv of q, k and v (lse the last of `saved`),
// written into the [b, h, t, d] views that `destinations` makes, or in libtorch's operators when
// a graph is being built.
template <class Destinations>
std::vector<torch::Tensor> backward_of(torch::autograd::AutogradContext* ctx,
                                       const torch::autograd::variable_list& saved, const torch::Tensor& q,
                                       const torch::Tensor& k, const torch::Tensor& v, const torch::Tensor& grad,
                                       Destinations&& destinations) {
  RECORD_FUNCTION("ztrain::attention_backward", std::vector<c10::IValue>({grad}));
  const Problem pr = problem_of(q, k, v, ctx->saved_data["p"].toDouble(),
                                static_cast<uint64_t>(ctx->saved_data["seed"].toInt()),
                                ctx->saved_data["causal"].toBool(), ctx->saved_data["scale"].toDouble(),
                                ctx->saved_data["from_bf16"].toBool());
  if (torch::GradMode::is_enabled()) return backward_differentiable(pr, q, k, v, grad);
  std::vector<torch::Tensor> d = destinations(pr);
  fused_backward(pr, grad, saved.back(), d[0], d[1], d[2]);
  return d;
}

struct FusedAttention : torch::autograd::Function<FusedAttention> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& query,
                               const torch::Tensor& key, const torch::Tensor& value, double p, bool causal,
                               double scale, bool from_bf16) {
    RECORD_FUNCTION("ztrain::attention", std::vector<c10::IValue>({query, key, value}));
    const auto q = rows_contiguous(query), k = rows_contiguous(key), v = rows_contiguous(value);
    return forward_saving(ctx, q, k, v, p, causal, scale, from_bf16, {q, k, v});
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto &q = saved[0], &k = saved[1], &v = saved[2];
    auto d = backward_of(ctx, saved, q, k, v, grads[0], [&](const Problem& pr) {
      // each [b, t, h, d], returned as its [b, h, t, d] view
      return std::vector<torch::Tensor>{
          torch::empty({pr.batch, pr.tq, pr.heads, q.size(3)}, q.options()).transpose(1, 2),
          torch::empty({pr.batch, pr.tk, k.size(1), k.size(3)}, k.options()).transpose(1, 2),
          torch::empty({pr.batch, pr.tk, v.size(1), v.size(3)}, v.options()).transpose(1, 2)};
    });
    return {d[0], d[1], d[2], {}, {}, {}, {}};
  }
};

// Query, key or value (i = 0, 1, 2) of a packed [b, t, 3, h, d] tensor, as a [b, h, t, d] view.
torch::Tensor part(const torch::Tensor& qkv, int64_t i) { return qkv.select(2, i).transpose(1, 2); }

// The same on q, k and v packed in one [b, t, 3, h, d] tensor, whose gradient is one such tensor.
struct PackedAttention : torch::autograd::Function<PackedAttention> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& packed, double p,
                               bool causal, double scale, bool from_bf16) {
    RECORD_FUNCTION("ztrain::attention", std::vector<c10::IValue>({packed}));
    const auto qkv = rows_contiguous(packed);
    return forward_saving(ctx, part(qkv, 0), part(qkv, 1), part(qkv, 2), p, causal, scale, from_bf16, {qkv});
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto& qkv = saved[0];
    torch::Tensor dqkv;
    auto d = backward_of(ctx, saved, part(qkv, 0), part(qkv, 1), part(qkv, 2), grads[0], [&](const Problem&) {
      dqkv = torch::empty_like(qkv, at::MemoryFormat::Contiguous);
      return std::vector<torch::Tensor>{part(dqkv, 0), part(dqkv, 1), part(dqkv, 2)};
    });
    if (!dqkv.defined()) dqkv = torch::stack({d[0].transpose(1, 2), d[1].transpose(1, 2), d[2].transpose(1, 2)}, 2);
    return {dqkv, {}, {}, {}, {}};
  }
};

// Whether the fused kernel on widened operands, the widening and the rounding included, runs a
// causal attention's forward and backward at least 1.1 times as fast as libtorch's own kernel in
// this 16-bit type, each way at its best of five: 1 × 4 heads × 256 tokens × 64, about 40 ms on a
// Zen 4 core. The operands are constants: the random generator is left as it was.
bool widening_is_faster(at::ScalarType dtype) {
  constexpr int64_t b = 1, t = 256, h = 4, d = 64;
  const auto packed = (torch::arange(b * t * 3 * h * d, torch::kFloat) * 0.37).sin().view({b, t, 3, h, d}).to(dtype);
  const auto grad = (torch::arange(b * h * t * d, torch::kFloat) * 0.53).cos().view({b, h, t, d}).to(dtype);
  const auto q = part(packed, 0), k = part(packed, 1), v = part(packed, 2);
  const double scale = 1 / std::sqrt(static_cast<double>(d));
  const auto native = [&] {
    const auto [y, lse] = at::cpu::_scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, true);
    at::cpu::_scaled_dot_product_flash_attention_for_cpu_backward(grad, q, k, v, y, lse, 0.0, true);
  };
  const auto widened = [&] {
    const auto x = packed.to(torch::kFloat);
    const Problem pr = problem_of(part(x, 0), part(x, 1), part(x, 2), 0.0, 0, true, scale, dtype == at::kBFloat16);
    const auto [y, lse] = fused_forward(pr, part(x, 0), part(x, 2));
    y.to(dtype);
    const auto dx = torch::empty_like(x);
    fused_backward(pr, grad.to(torch::kFloat), lse, part(dx, 0), part(dx, 1), part(dx, 2));
    dx.to(dtype);
  };
  return ztrain::detail::widening_pays(native, widened, 1.1, 5);
}

// Per 16-bit type (0: bf16, 1: fp16): -1 not yet chosen, else 0 or 1.
std::atomic<int> widen_16bit[2] = {-1, -1};

// Whether this process runs the fused kernel on the widening of the 16-bit x.
bool widened(const torch::Tensor& x) {
  const auto dtype = x.scalar_type();
  return x.device().is_cpu() && detail::attention_widened(dtype);
}

// Whether the fused kernel takes the call: float on the CPU, a positive finite scale, and more
// than one block of keys or dropout (up to one block of keys without dropout, libtorch's CPU flash
// attention costs less per call: docs/benchmarks.md, 5.5 against 6.5 ms forward and backward at
// 2 × 12 × 64 × 64).
bool fused(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, double dropout_p, double scale) {
  return q.device().is_cpu() && q.scalar_type() == torch::kFloat && k.scalar_type() == torch::kFloat &&
         v.scalar_type() == torch::kFloat && q.layout() == torch::kStrided && q.numel() > 0 && k.numel() > 0 &&
         dropout_p < 1 && scale > 0 && std::isfinite(scale) && (dropout_p > 0 || k.size(2) > kRows);
}

// attention() after its checks; `from_bf16`: q, k and v are the widening of bf16 tensors.
torch::Tensor checked_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                double dropout_p, bool causal, std::optional<double> scale, bool enable_gqa,
                                bool from_bf16) {
  const double scale_or_default = scale.value_or(1.0 / std::sqrt(static_cast<double>(q.size(3))));
  if (!fused(q, k, v, dropout_p, scale_or_default)) {
    return at::scaled_dot_product_attention(q, k, v, {}, dropout_p, causal, scale, enable_gqa);
  }
  return FusedAttention::apply(q, k, v, dropout_p, causal, scale_or_default, from_bf16);
}

void check_dropout(double p) {
  ZTRAIN_CHECK(p >= 0 && p <= 1, "attention: the dropout probability must be in [0, 1], got ", p);
}

}  // namespace

namespace detail {

bool attention_widened(at::ScalarType dtype) {
  if (dtype != at::kBFloat16 && dtype != at::kHalf) return false;
  auto& slot = widen_16bit[dtype == at::kHalf];
  int widen = slot.load(std::memory_order_relaxed);
  if (widen < 0) {
    widen = ztrain::detail::cpu_matmul_through_fp32(dtype) ||
            (ztrain::detail::cpu_matmul16_mode() == ztrain::detail::Matmul16Mode::kAuto &&
             widening_is_faster(dtype));
    slot.store(widen, std::memory_order_relaxed);
  }
  return widen != 0;
}

void set_attention_widened(std::optional<bool> widen) {
  for (auto& slot : widen_16bit) slot.store(widen ? int{*widen} : -1, std::memory_order_relaxed);
}

namespace {
std::atomic<bool> direct_blas{sgemm_ != nullptr};
}  // namespace

bool attention_blas() { return direct_blas.load(std::memory_order_relaxed); }

void set_attention_blas(bool direct) {
  ZTRAIN_CHECK(!direct || sgemm_ != nullptr,
               "set_attention_blas: libtorch's libraries export no sgemm_ here; attention takes libtorch's gemm");
  direct_blas.store(direct, std::memory_order_relaxed);
}

}  // namespace detail

torch::Tensor attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, double dropout_p,
                        bool causal, std::optional<double> scale, bool enable_gqa) {
  check_dropout(dropout_p);
  ZTRAIN_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4,
               "attention: q, k and v must be [batch, heads, tokens, head size], got ", q.sizes(), ", ", k.sizes(),
               " and ", v.sizes());
  ZTRAIN_CHECK(q.size(0) == k.size(0) && q.size(3) == k.size(3) && v.size(0) == k.size(0) &&
                   v.size(1) == k.size(1) && v.size(2) == k.size(2),
               "attention: q ", q.sizes(), ", k ", k.sizes(), " and v ", v.sizes(),
               " do not match: they need the same batch, q and k the same head size, k and v the same heads and "
               "tokens");
  ZTRAIN_CHECK(q.size(1) == k.size(1) || (enable_gqa && k.size(1) > 0 && q.size(1) % k.size(1) == 0),
               "attention: q has ", q.size(1), " heads and k and v ", k.size(1),
               enable_gqa ? ", which does not divide them" : " (sharing key heads needs enable_gqa)");
  if (widened(q) && k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type()) {
    return checked_attention(q.to(torch::kFloat), k.to(torch::kFloat), v.to(torch::kFloat), dropout_p, causal, scale,
                             enable_gqa, q.scalar_type() == torch::kBFloat16)
        .to(q.scalar_type());
  }
  return checked_attention(q, k, v, dropout_p, causal, scale, enable_gqa, false);
}

torch::Tensor packed_attention(const torch::Tensor& qkv, double dropout_p, bool causal, std::optional<double> scale) {
  check_dropout(dropout_p);
  ZTRAIN_CHECK(qkv.dim() == 5 && qkv.size(2) == 3,
               "packed_attention: qkv must be [batch, tokens, 3, heads, head size], got ", qkv.sizes());
  const auto x = widened(qkv) ? qkv.to(torch::kFloat) : qkv;
  const double scale_or_default = scale.value_or(1.0 / std::sqrt(static_cast<double>(x.size(4))));
  torch::Tensor y;
  if (fused(part(x, 0), part(x, 1), part(x, 2), dropout_p, scale_or_default)) {
    y = PackedAttention::apply(x, dropout_p, causal, scale_or_default, qkv.scalar_type() == torch::kBFloat16);
  } else {
    const auto parts = x.permute({2, 0, 3, 1, 4}).unbind(0);
    y = at::scaled_dot_product_attention(parts[0], parts[1], parts[2], {}, dropout_p, causal, scale);
  }
  return y.to(qkv.scalar_type());
}

}  // namespace ztrain::models
