// The fused kernels against libtorch: GELU (tanh) against torch::gelu(x, "tanh") and
// cross-entropy against torch::nn::functional::cross_entropy — values, gradients (first and
// second order), bf16, the scalar and AVX2 code, tails, and the fallbacks.

#include "test_util.h"

#include <ztrain/models/fused.h>

#include <cmath>
#include <limits>

namespace ztrain::test {
namespace {

using models::cross_entropy;
using models::gelu_tanh;
namespace F = torch::nn::functional;

// Inputs covering GELU's regions: the wide negative tail (σ underflows), the curved middle, the
// nearly linear positive side, and exact zeros.
torch::Tensor inputs(int64_t n, torch::ScalarType dtype = torch::kFloat) {
  torch::manual_seed(7);
  auto x = torch::randn({n}) * 4;
  if (n > 4) {
    x[0] = 0;
    x[1] = -40;
    x[2] = 30;
    x[3] = 1e-4;
  }
  return x.to(dtype);
}

// Largest difference in units of the reference's magnitude (at least 1, so values near zero are
// held to an absolute bound).
double max_error(const torch::Tensor& got, const torch::Tensor& want) {
  auto g = got.to(torch::kDouble), w = want.to(torch::kDouble);
  return ((g - w).abs() / w.abs().clamp_min(1)).max().item<double>();
}

// Runs `fn` with the scalar code, then with the AVX2 code where this CPU has it.
template <class Fn>
void in_every_kernel(Fn&& fn) {
  const bool before = models::detail::fused_simd();
  for (bool simd : {false, true}) {
    if (simd && !(__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))) continue;
    SCOPED_TRACE(simd ? "avx2" : "scalar");
    models::detail::set_fused_simd(simd);
    fn();
  }
  models::detail::set_fused_simd(before);
}

// y = gelu_tanh(x) and dx for dy, through autograd.
std::pair<torch::Tensor, torch::Tensor> gelu_and_grad(const torch::Tensor& x, const torch::Tensor& dy) {
  auto leaf = x.detach().clone().requires_grad_();
  auto y = gelu_tanh(leaf);
  y.backward(dy);
  return {y.detach(), leaf.grad()};
}

TEST(GeluTanh, MatchesLibtorchInEveryKernel) {
  in_every_kernel([] {
    for (int64_t n : {1, 7, 8, 9, 17, 100003}) {
      const auto x = inputs(n), dy = torch::randn({n});
      const auto [y, dx] = gelu_and_grad(x, dy);
      const auto xd = x.to(torch::kDouble), dyd = dy.to(torch::kDouble);  // the exact values
      const auto y_exact = torch::gelu(xd, "tanh"), dx_exact = at::gelu_backward(dyd, xd, "tanh");
      // libtorch's own float results are 1.5e-7 and 2.6e-6 off at worst here (the backward's
      // difference of two terms cancels for negative x).
      EXPECT_LT(max_error(y, y_exact), 3e-7) << n;
      EXPECT_LT(max_error(dx, dx_exact), 4e-6) << n;
    }
  });
}

TEST(GeluTanh, EveryElementGetsTheSameBitsWhereverItLies) {
  in_every_kernel([] {
    const auto x = inputs(1000);
    const auto whole = gelu_tanh(x);
    for (int64_t begin : {0, 1, 5, 13}) {  // slices whose tails and vectors fall elsewhere
      EXPECT_TRUE(torch::equal(gelu_tanh(x.slice(0, begin, begin + 37)), whole.slice(0, begin, begin + 37))) << begin;
    }
  });
}

TEST(GeluTanh, Bf16RoundsOnceFromFloat) {
  in_every_kernel([] {
    const auto x = inputs(4099, torch::kBFloat16), dy = torch::randn({4099}).to(torch::kBFloat16);
    const auto [y, dx] = gelu_and_grad(x, dy);
    ASSERT_EQ(y.scalar_type(), torch::kBFloat16);
    ASSERT_EQ(dx.scalar_type(), torch::kBFloat16);
    // Within one bf16 rounding (2^-8 relative) of the float result, as libtorch's bf16 GELU is.
    const auto xf = x.to(torch::kFloat);
    EXPECT_LE(max_error(y, torch::gelu(xf, "tanh")), std::ldexp(1.0, -8) + 1e-6);
    EXPECT_LE(max_error(y, torch::gelu(x, "tanh")), std::ldexp(1.0, -7));
    EXPECT_LE(max_error(dx, at::gelu_backward(dy.to(torch::kFloat), xf, "tanh")), std::ldexp(1.0, -8) + 1e-6);
  });
}

TEST(GeluTanh, NonFiniteValuesPropagate) {
  in_every_kernel([] {
    const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
    for (auto dtype : {torch::kFloat, torch::kBFloat16}) {
      const auto y = gelu_tanh(torch::tensor({nan, inf, 1.0f}).to(dtype)).to(torch::kFloat);
      EXPECT_TRUE(std::isnan(y[0].item<float>())) << dtype;
      EXPECT_EQ(y[1].item<float>(), inf) << dtype;
    }
  });
}

TEST(GeluTanh, NonContiguousInputs) {
  auto x = torch::randn({64, 48}).t().requires_grad_();  // [48, 64], column-major
  auto y = gelu_tanh(x);
  EXPECT_EQ(y.sizes(), x.sizes());
  const auto xd = x.detach().to(torch::kDouble);
  EXPECT_LT(max_error(y.detach(), torch::gelu(xd, "tanh")), 3e-7);
  y.sum().backward();
  EXPECT_LT(max_error(x.grad(), at::gelu_backward(torch::ones_like(xd), xd, "tanh")), 4e-6);
}

TEST(GeluTanh, SecondDerivativeThroughLibtorchsBackward) {
  auto x = torch::randn({257}).mul_(2).requires_grad_();
  auto x_ref = x.detach().clone().requires_grad_();
  auto g = torch::autograd::grad({gelu_tanh(x).sum()}, {x}, {}, true, true)[0];
  auto g_ref = torch::autograd::grad({torch::gelu(x_ref, "tanh").sum()}, {x_ref}, {}, true, true)[0];
  ASSERT_TRUE(g.requires_grad());
  EXPECT_TRUE(torch::equal(g, g_ref));  // create_graph: libtorch's own backward
  g.sum().backward();
  g_ref.sum().backward();
  EXPECT_TRUE(torch::equal(x.grad(), x_ref.grad()));
}

TEST(GeluTanh, OtherDtypesAreLibtorchs) {
  const auto x = inputs(100, torch::kDouble);
  EXPECT_TRUE(torch::equal(gelu_tanh(x), torch::gelu(x, "tanh")));
}

// Logits [n, v] over a wide range, and targets with some rows ignored.
std::pair<torch::Tensor, torch::Tensor> logits_and_targets(int64_t n, int64_t v) {
  torch::manual_seed(11);
  auto logits = torch::randn({n, v}) * 5;
  auto targets = torch::randint(v, {n}, torch::kLong);
  if (n > 2) targets[1] = -100;
  return {logits, targets};
}

TEST(CrossEntropy, MatchesLibtorchInEveryKernel) {
  in_every_kernel([] {
    for (int64_t v : {1, 7, 8, 9, 33, 50257}) {
      auto [logits, targets] = logits_and_targets(v > 1000 ? 16 : 37, v);
      auto a = logits.clone().requires_grad_(), c = logits.to(torch::kDouble).requires_grad_();
      auto loss = cross_entropy(a, targets), exact = F::cross_entropy(c, targets);  // in double: the exact values
      (loss * 3).backward();
      (exact * 3).backward();
      // libtorch's float results are 2.9e-7 and 1.5e-6 off at worst here.
      EXPECT_LT(max_error(loss.detach(), exact.detach()), 1e-6) << v;
      EXPECT_LT(max_error(a.grad(), c.grad()), 3e-6) << v;
      EXPECT_TRUE(torch::equal(a.grad()[1], torch::zeros({v}))) << v;  // the ignored row
    }
  });
}

TEST(CrossEntropy, MaskedClassesGetNoGradient) {
  in_every_kernel([] {  // -inf logits (a padded vocabulary's rows): exactly zero, as in libtorch
    auto [logits, targets] = logits_and_targets(5, 20);
    logits.slice(1, 17).fill_(-std::numeric_limits<float>::infinity());
    targets.clamp_max_(16);
    auto a = logits.clone().requires_grad_();
    cross_entropy(a, targets).backward();
    EXPECT_TRUE(torch::equal(a.grad().slice(1, 17), torch::zeros({5, 3})));
    EXPECT_LT(max_error(cross_entropy(logits, targets), F::cross_entropy(logits, targets)), 1e-6);
  });
}

TEST(CrossEntropy, SecondDerivativeThroughLibtorchsOps) {
  auto [logits, targets] = logits_and_targets(6, 10);
  auto a = logits.clone().requires_grad_(), b = logits.clone().requires_grad_();
  auto ga = torch::autograd::grad({cross_entropy(a, targets)}, {a}, {}, true, true)[0];
  auto gb = torch::autograd::grad({F::cross_entropy(b, targets)}, {b}, {}, true, true)[0];
  EXPECT_LT((ga - gb).abs().max().item<double>(), 1e-7);
  (ga * ga).sum().backward();
  (gb * gb).sum().backward();
  EXPECT_LT((a.grad() - b.grad()).abs().max().item<double>(), 1e-6);
}

TEST(CrossEntropy, BadTargetsAreRefusedByName) {
  auto [logits, targets] = logits_and_targets(4, 10);
  targets[2] = 10;
  EXPECT_NE(error_message([&] { cross_entropy(logits, targets); }).find("target 10 of row 2 is outside the 10 classes"),
            std::string::npos);
  EXPECT_THROW(cross_entropy(logits, targets.slice(0, 0, 3)), ztrain::Error);
}

TEST(CrossEntropy, OtherDtypesAreLibtorchs) {
  auto [logits, targets] = logits_and_targets(4, 10);
  const auto d = logits.to(torch::kDouble);
  EXPECT_TRUE(torch::equal(cross_entropy(d, targets), F::cross_entropy(d, targets)));
}

}  // namespace
}  // namespace ztrain::test
