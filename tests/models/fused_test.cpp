// The fused kernels against libtorch: GELU (tanh) against torch::gelu(x, "tanh"), LayerNorm
// against torch::layer_norm and cross-entropy against torch::nn::functional::cross_entropy —
// values, gradients (first and second order), bf16, the scalar, AVX2 and AVX-512 code, tails, and
// the fallbacks; dropout against Philox4x32-10's published answers, the mask its header describes,
// and the statistics of a Bernoulli mask; attention against libtorch's in double and the
// materialised attention with the fused dropout.

#include "test_util.h"

#include <ztrain/cpu_matmul16.h>
#include <ztrain/models/fused.h>

#include <ATen/CPUGeneratorImpl.h>

#include <cmath>
#include <limits>
#include <optional>

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

// Runs `fn` with the scalar code, then with the AVX2, the AVX-512, the AVX-512 BF16 and the AMX code where
// this CPU has them.
template <class Fn>
void in_every_kernel(Fn&& fn) {
  using models::detail::Simd;
  const Simd before = models::detail::fused_simd();
  for (Simd simd : {Simd::kScalar, Simd::kAvx2, Simd::kAvx512, Simd::kAvx512Bf16, Simd::kAmx}) {
    if (!models::detail::cpu_runs(simd)) continue;
    SCOPED_TRACE(models::detail::simd_name(simd));
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

// The vector codes compute the same operations per element: AVX2 and AVX-512 agree bit for bit,
// forward and backward, over whole vectors and every tail length, in float and in bf16.
TEST(GeluTanh, VectorCodesAgreeBitForBit) {
  using models::detail::Simd;
  if (!models::detail::cpu_runs(Simd::kAvx512)) GTEST_SKIP() << "no AVX-512 here";
  const Simd before = models::detail::fused_simd();
  for (auto dtype : {torch::kFloat, torch::kBFloat16}) {
    for (int64_t n : {1, 15, 16, 17, 31, 4099}) {
      const auto x = (inputs(n) * 4).to(dtype), dy = torch::randn({n}).to(dtype);
      models::detail::set_fused_simd(Simd::kAvx2);
      const auto [y2, dx2] = gelu_and_grad(x, dy);
      models::detail::set_fused_simd(Simd::kAvx512);
      const auto [y16, dx16] = gelu_and_grad(x, dy);
      EXPECT_TRUE(torch::equal(y2, y16)) << n << " " << dtype;
      EXPECT_TRUE(torch::equal(dx2, dx16)) << n << " " << dtype;
    }
  }
  models::detail::set_fused_simd(before);
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

// y = layer_norm(x, w, b) and the gradients of x, w and b for dy, through autograd.
std::vector<torch::Tensor> layer_norm_and_grads(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& b,
                                                const torch::Tensor& dy) {
  auto xl = x.detach().clone().requires_grad_(), wl = w.detach().clone().requires_grad_(),
       bl = b.detach().clone().requires_grad_();
  auto y = models::layer_norm(xl, wl, bl, 1e-5);
  y.backward(dy);
  return {y.detach(), xl.grad(), wl.grad(), bl.grad()};
}

// The same through libtorch's LayerNorm.
std::vector<torch::Tensor> libtorch_layer_norm(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& b,
                                               const torch::Tensor& dy) {
  auto xl = x.detach().clone().requires_grad_(), wl = w.detach().clone().requires_grad_(),
       bl = b.detach().clone().requires_grad_();
  auto y = torch::layer_norm(xl, {x.size(-1)}, wl, bl, 1e-5);
  y.backward(dy);
  return {y.detach(), xl.grad(), wl.grad(), bl.grad()};
}

// The exact values: libtorch's in double.
std::vector<torch::Tensor> exact_layer_norm(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& b,
                                            const torch::Tensor& dy) {
  return libtorch_layer_norm(x.to(torch::kDouble), w.to(torch::kDouble), b.to(torch::kDouble), dy.to(torch::kDouble));
}

// Rows of varied offsets and scales (one constant row, whose variance is 0), a weight and a bias.
std::vector<torch::Tensor> layer_norm_inputs(int64_t rows, int64_t d, torch::ScalarType dtype = torch::kFloat) {
  torch::manual_seed(5);
  auto x = torch::randn({rows, d}) * torch::rand({rows, 1}).mul(8).add(0.1) + torch::randn({rows, 1}) * 3;
  if (rows > 2) x[1].fill_(2.5);
  return {x.to(dtype), torch::randn({d}).to(dtype), torch::randn({d}).to(dtype), torch::randn({rows, d}).to(dtype)};
}

TEST(LayerNorm, MatchesLibtorchInEveryKernel) {
  in_every_kernel([] {
    for (int64_t d : {1, 7, 8, 9, 768, 771}) {
      for (int64_t rows : {1, 3, 130}) {  // 130: three blocks of rows for the weight's gradient
        SCOPED_TRACE(::testing::Message() << rows << " x " << d);
        const auto in = layer_norm_inputs(rows, d);
        const auto got = layer_norm_and_grads(in[0], in[1], in[2], in[3]);
        const auto want = exact_layer_norm(in[0], in[1], in[2], in[3]);
        const auto theirs = libtorch_layer_norm(in[0], in[1], in[2], in[3]);
        for (size_t i = 0; i < got.size(); ++i) {  // y, dx, dw, db: as close as libtorch's float ones
          EXPECT_LE(max_error(got[i], want[i]), 2 * max_error(theirs[i], want[i]) + 1e-6) << i;
        }
        if (rows > 2) {
          EXPECT_TRUE(torch::equal(got[0][1], in[2]));  // a constant row: x̂ = 0, y = b
        }
      }
    }
  });
}

TEST(LayerNorm, Bf16RoundsOnceFromFloat) {
  in_every_kernel([] {
    const auto in = layer_norm_inputs(130, 771, torch::kBFloat16);
    const auto got = layer_norm_and_grads(in[0], in[1], in[2], in[3]);
    for (const auto& g : got) ASSERT_EQ(g.scalar_type(), torch::kBFloat16);
    const auto want = exact_layer_norm(in[0], in[1], in[2], in[3]);
    // Within one bf16 rounding (2^-8 relative) of the exact values of the same bf16 inputs, and
    // at least as close as libtorch's bf16 LayerNorm.
    const auto theirs = libtorch_layer_norm(in[0], in[1], in[2], in[3]);
    for (size_t i = 0; i < got.size(); ++i) {
      SCOPED_TRACE(i);
      EXPECT_LE(max_error(got[i], want[i]), std::ldexp(1.0, -8) + 1e-5);
      EXPECT_LE(max_error(got[i], want[i]), max_error(theirs[i], want[i]) + 1e-6);
    }
  });
}

TEST(LayerNorm, NonContiguousAndBatchedInputs) {
  const auto in = layer_norm_inputs(96, 40);
  auto x = in[0].view({4, 24, 40}).transpose(0, 1).requires_grad_();  // [24, 4, 40], not contiguous
  auto y = models::layer_norm(x, in[1], in[2], 1e-5);
  EXPECT_EQ(y.sizes(), x.sizes());
  const auto xd = x.detach().to(torch::kDouble);
  const auto exact = torch::layer_norm(xd, {40}, in[1].to(torch::kDouble), in[2].to(torch::kDouble));
  const auto theirs = torch::layer_norm(x.detach(), {40}, in[1], in[2]);
  EXPECT_LE(max_error(y.detach(), exact), 2 * max_error(theirs, exact) + 1e-6);
}

TEST(LayerNorm, SecondDerivativeThroughLibtorchsBackward) {
  const auto in = layer_norm_inputs(5, 24);
  auto x = in[0].clone().requires_grad_(), w = in[1].clone().requires_grad_();
  auto x_ref = in[0].clone().requires_grad_(), w_ref = in[1].clone().requires_grad_();
  const auto loss = [&](const torch::Tensor& y) { return (y * y * in[3]).sum(); };
  auto g = torch::autograd::grad({loss(models::layer_norm(x, w, in[2], 1e-5))}, {x}, {}, true, true)[0];
  auto g_ref = torch::autograd::grad({loss(torch::layer_norm(x_ref, {24}, w_ref, in[2], 1e-5))}, {x_ref}, {}, true,
                                     true)[0];
  ASSERT_TRUE(g.requires_grad());
  EXPECT_TRUE(torch::allclose(g, g_ref, 1e-5, 1e-5));
  g.sum().backward();
  g_ref.sum().backward();
  EXPECT_TRUE(torch::allclose(x.grad(), x_ref.grad(), 1e-4, 1e-4));
  EXPECT_TRUE(torch::allclose(w.grad(), w_ref.grad(), 1e-4, 1e-4));
}

TEST(LayerNorm, OtherDtypesAndShapesAreLibtorchs) {
  const auto in = layer_norm_inputs(6, 10, torch::kDouble);
  EXPECT_TRUE(
      torch::equal(models::layer_norm(in[0], in[1], in[2], 1e-5), torch::layer_norm(in[0], {10}, in[1], in[2])));
  const auto f = layer_norm_inputs(6, 10);
  EXPECT_TRUE(torch::equal(models::layer_norm(f[0], f[1], torch::Tensor(), 1e-5),
                           torch::layer_norm(f[0], {10}, f[1], torch::Tensor())));
  EXPECT_THROW(models::layer_norm(f[0], torch::randn({9}), f[2], 1e-5), c10::Error);  // weight of the wrong size
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

// The AVX-512 code adds each row's elements into the AVX2 code's 16 partial sums, in its order:
// the same loss and gradient bits for every tail length, in float and in bf16.
TEST(CrossEntropy, VectorCodesAgreeBitForBit) {
  using models::detail::Simd;
  if (!models::detail::cpu_runs(Simd::kAvx512)) GTEST_SKIP() << "no AVX-512 here";
  const Simd before = models::detail::fused_simd();
  for (auto dtype : {torch::kFloat, torch::kBFloat16}) {
    for (int64_t v : {1, 7, 8, 9, 15, 16, 17, 23, 24, 25, 40, 50257}) {
      auto [logits, targets] = logits_and_targets(v > 1000 ? 8 : 64, v);
      logits.slice(0, 0, logits.size(0) / 2).mul_(0.01);  // near-equal logits: every term of the sum counts
      std::vector<torch::Tensor> results;
      for (Simd simd : {Simd::kAvx2, Simd::kAvx512}) {
        models::detail::set_fused_simd(simd);
        auto a = logits.to(dtype).requires_grad_();
        auto loss = cross_entropy(a, targets);
        loss.backward();
        results.push_back(loss.detach());
        results.push_back(a.grad());
      }
      EXPECT_TRUE(torch::equal(results[0], results[2])) << v << " " << dtype;
      EXPECT_TRUE(torch::equal(results[1], results[3])) << v << " " << dtype;
    }
  }
  models::detail::set_fused_simd(before);
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

// bf16 logits: exactly the float kernel on their widening, the loss a float, the gradient
// rounded once; fp16 (no kernel of its own) libtorch's on the widening.
TEST(CrossEntropy, SixteenBitIsTheFloatLossOfTheWidenedLogits) {
  in_every_kernel([] {
    for (int64_t v : {7, 9, 33, 50257}) {
      auto [logits, targets] = logits_and_targets(v > 1000 ? 16 : 37, v);
      const auto bf16 = logits.to(torch::kBFloat16);
      auto a = bf16.clone().requires_grad_(), b = bf16.to(torch::kFloat).requires_grad_();
      auto loss = cross_entropy(a, targets), widened = cross_entropy(b, targets);
      EXPECT_EQ(loss.scalar_type(), torch::kFloat);
      EXPECT_TRUE(torch::equal(loss, widened)) << v;
      (loss * 3).backward();
      (widened * 3).backward();
      EXPECT_EQ(a.grad().scalar_type(), torch::kBFloat16);
      EXPECT_TRUE(torch::equal(a.grad(), b.grad().to(torch::kBFloat16))) << v;
    }
  });
  auto [logits, targets] = logits_and_targets(6, 10);
  auto h = logits.to(torch::kHalf).requires_grad_(), f = logits.to(torch::kHalf).to(torch::kFloat).requires_grad_();
  auto loss = cross_entropy(h, targets), widened = F::cross_entropy(f, targets);
  EXPECT_TRUE(torch::equal(loss, widened));
  loss.backward();
  widened.backward();
  EXPECT_TRUE(torch::equal(h.grad(), f.grad().to(torch::kHalf)));
  // building a graph: the gradient keeps the logits' type
  auto c = logits.to(torch::kBFloat16).requires_grad_();
  auto gc = torch::autograd::grad({cross_entropy(c, targets)}, {c}, {}, true, true)[0];
  EXPECT_EQ(gc.scalar_type(), torch::kBFloat16);
  EXPECT_LT(max_error(gc, torch::autograd::grad({F::cross_entropy(c.to(torch::kFloat), targets)}, {c})[0]), 1e-2);
}

TEST(CrossEntropy, OtherDtypesAreLibtorchs) {
  auto [logits, targets] = logits_and_targets(4, 10);
  const auto d = logits.to(torch::kDouble);
  EXPECT_TRUE(torch::equal(cross_entropy(d, targets), F::cross_entropy(d, targets)));
}

// ---- dropout -------------------------------------------------------------------------------------

// Random123's known answers for Philox4x32-10 (its kat_vectors): counter, key, result.
TEST(Dropout, PhiloxGivesThePublishedAnswers) {
  using models::detail::philox4x32_10;
  using W = std::array<uint32_t, 4>;
  EXPECT_EQ(philox4x32_10({0, 0, 0, 0}, {0, 0}), (W{0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8}));
  EXPECT_EQ(philox4x32_10({~0u, ~0u, ~0u, ~0u}, {~0u, ~0u}), (W{0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd}));
  EXPECT_EQ(philox4x32_10({0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344}, {0xa4093822, 0x299f31d0}),
            (W{0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1}));
}

// The mask fused.h describes, from the seed the default generator gives after manual_seed(seed):
// element e is dropped when word e % 32 / 8 of counter 8 · (e / 32) + e % 8 is below round(p · 2³²).
torch::Tensor expected_keep(uint64_t seed, int64_t n, double p) {
  const uint64_t key = at::detail::createCPUGenerator(seed).get<at::CPUGeneratorImpl>()->random64();
  const auto threshold = static_cast<uint32_t>(std::round(std::ldexp(p, 32)));
  auto keep = torch::empty({n}, torch::kBool);
  for (int64_t e = 0; e < n; ++e) {
    const uint64_t counter = 8 * static_cast<uint64_t>(e / 32) + e % 8;
    const auto words = models::detail::philox4x32_10(
        {static_cast<uint32_t>(counter), static_cast<uint32_t>(counter >> 32), 0, 0},
        {static_cast<uint32_t>(key), static_cast<uint32_t>(key >> 32)});
    keep[e] = words[e % 32 / 8] >= threshold;
  }
  return keep;
}

TEST(Dropout, TheMaskIsTheDocumentedOneInEveryKernel) {
  in_every_kernel([] {
    for (int64_t n : {1, 7, 31, 32, 33, 1000}) {
      torch::manual_seed(42);
      const auto y = models::dropout(torch::ones({n}), 0.3, true);
      const auto keep = expected_keep(42, n, 0.3);
      const float scale = static_cast<float>(1.0 / 0.7);
      EXPECT_TRUE(torch::equal(y, torch::where(keep, torch::full({n}, scale), torch::zeros({n})))) << n;
    }
  });
}

TEST(Dropout, KeptElementsEqualLibtorchsAndTheRateIsP) {
  in_every_kernel([] {
    const int64_t n = 1 << 20;
    for (double p : {0.1, 0.5, 0.9}) {
      for (auto dtype : {torch::kFloat, torch::kBFloat16}) {
        torch::manual_seed(3);
        const auto x = torch::randn({n}).to(dtype);
        const auto y = models::dropout(x, p, true);
        ASSERT_EQ(y.scalar_type(), dtype);
        const auto kept = y != 0;  // randn has no exact zeros here
        // The same product libtorch's dropout takes: x times 1 / (1 − p) as a float, rounded once.
        const auto want = (x.to(torch::kFloat) * static_cast<float>(1.0 / (1.0 - p))).to(dtype);
        EXPECT_TRUE(torch::equal(y.masked_select(kept), want.masked_select(kept))) << p << " " << dtype;
        // The dropped fraction within 5 standard deviations of p, overall and in each pair of
        // neighbours (a mask repeated across lanes or words would skew the pairs).
        const double sd = std::sqrt(p * (1 - p) / n);
        EXPECT_NEAR(1.0 - kept.to(torch::kDouble).mean().item<double>(), p, 5 * sd) << p << " " << dtype;
        const auto a = kept.slice(0, 0, n, 2).to(torch::kLong), b = kept.slice(0, 1, n, 2).to(torch::kLong);
        const auto pairs = torch::bincount(a * 2 + b, {}, 4).to(torch::kDouble) / (n / 2);
        const double q = 1 - p;
        const double want_pairs[4] = {p * p, p * q, q * p, q * q};
        for (int c = 0; c < 4; ++c) {
          const double sd_pair = std::sqrt(want_pairs[c] * (1 - want_pairs[c]) / (n / 2));
          EXPECT_NEAR(pairs[c].item<double>(), want_pairs[c], 5 * sd_pair) << p << " pair " << c;
        }
      }
    }
  });
}

TEST(Dropout, EveryElementGetsTheSameMaskWhateverTheSplit) {
  const auto x = torch::randn({100003});
  std::vector<torch::Tensor> outs;
  in_every_kernel([&] {
    for (int threads : {1, 2}) {
      at::set_num_threads(threads);
      torch::manual_seed(5);
      outs.push_back(models::dropout(x, 0.25, true));
    }
  });
  at::set_num_threads(1);
  for (size_t i = 1; i < outs.size(); ++i) EXPECT_TRUE(torch::equal(outs[i], outs[0])) << i;
  torch::manual_seed(5);
  EXPECT_TRUE(torch::equal(models::dropout(x.slice(0, 0, 77), 0.25, true), outs[0].slice(0, 0, 77)));  // a prefix
}

TEST(Dropout, BackwardAppliesTheForwardsMask) {
  in_every_kernel([] {
    for (auto dtype : {torch::kFloat, torch::kBFloat16}) {
      auto x = torch::ones({4099}).to(dtype).requires_grad_();
      torch::manual_seed(8);
      const auto y = models::dropout(x, 0.4, true);
      const auto dy = torch::randn({4099}).to(dtype);
      y.backward(dy);
      const auto scaled = (dy.to(torch::kFloat) * static_cast<float>(1.0 / 0.6)).to(dtype);
      EXPECT_TRUE(torch::equal(x.grad(), torch::where(y.detach() != 0, scaled, torch::zeros_like(scaled)))) << dtype;
    }
  });
}

TEST(Dropout, SeedsComeFromTheDefaultGenerator) {
  const auto x = torch::randn({1000});
  torch::manual_seed(9);
  const auto a = models::dropout(x, 0.5, true), b = models::dropout(x, 0.5, true);
  EXPECT_FALSE(torch::equal(a, b)) << "two calls drew the same mask";
  torch::manual_seed(9);
  EXPECT_TRUE(torch::equal(models::dropout(x, 0.5, true), a));
}

TEST(Dropout, SecondDerivativeThroughTheMask) {
  auto x = torch::randn({300}).requires_grad_();
  auto dy = torch::randn({300}).requires_grad_();
  torch::manual_seed(4);
  const auto y = models::dropout(x, 0.5, true);
  const auto g = torch::autograd::grad({y}, {x}, {dy}, true, true)[0];
  ASSERT_TRUE(g.requires_grad());
  g.sum().backward();
  EXPECT_TRUE(torch::equal(dy.grad(), torch::where(y != 0, torch::full({300}, 2.0f), torch::zeros({300}))));
}

TEST(Dropout, NaNStaysNaNWhereDropped) {
  const auto y = models::dropout(torch::full({64}, std::numeric_limits<float>::quiet_NaN()), 0.5, true);
  EXPECT_TRUE(y.isnan().all().item<bool>());
}

TEST(Dropout, IdentityOutsideTrainingAndLibtorchsElsewhere) {
  const auto x = torch::randn({8, 16}).t();  // non-contiguous
  EXPECT_TRUE(models::dropout(x, 0.5, false).is_same(x));
  EXPECT_TRUE(models::dropout(x, 0.0, true).is_same(x));
  EXPECT_TRUE(torch::equal(models::dropout(x, 1.0, true), torch::zeros_like(x)));
  torch::manual_seed(1);
  const auto y = models::dropout(x, 0.5, true);
  EXPECT_EQ(y.sizes(), x.sizes());
  EXPECT_TRUE(torch::equal(y.masked_select(y != 0), (x * 2.0f).masked_select(y != 0)));
  const auto d = torch::randn({1000}, torch::kDouble);  // another dtype: libtorch's dropout
  torch::manual_seed(1);
  const auto yd = models::dropout(d, 0.5, true);
  torch::manual_seed(1);
  EXPECT_TRUE(torch::equal(yd, torch::dropout(d, 0.5, true)));
  EXPECT_NE(error_message([&] { models::dropout(x, 1.5, true); }).find("probability must be in [0, 1], got 1.5"),
            std::string::npos);
}


// ---- attention -----------------------------------------------------------------------------------

const char* const kOutputs[] = {"output", "dq", "dk", "dv"};

// q, k, v of [b, h, t, d] as GPT makes them: views of one [b, t, 3, h, d] leaf.
std::pair<torch::Tensor, std::vector<torch::Tensor>> packed_qkv(int64_t b, int64_t h, int64_t t, int64_t d) {
  auto qkv = torch::randn({b, t, 3, h, d}).requires_grad_();
  return {qkv, qkv.permute({2, 0, 3, 1, 4}).unbind(0)};
}

// softmax(q kᵀ / √d, masked) v with the probabilities dropped by models::dropout: the
// materialised attention the fused one must equal.
torch::Tensor eager_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, double p,
                              bool causal) {
  auto scores = torch::matmul(q, k.transpose(-2, -1)) / std::sqrt(static_cast<double>(q.size(-1)));
  if (causal) {
    const auto hidden = torch::ones({q.size(2), k.size(2)}, torch::kBool).triu(1);
    scores = scores.masked_fill(hidden, -std::numeric_limits<double>::infinity());
  }
  return torch::matmul(models::dropout(torch::softmax(scores, -1), p, true), v);
}

// The output and the gradients of the inputs for the output gradient dy.
std::vector<torch::Tensor> with_grads(const torch::Tensor& y, const std::vector<torch::Tensor>& inputs,
                                      const torch::Tensor& dy) {
  auto g = torch::autograd::grad({y}, inputs, {dy});
  g.insert(g.begin(), y.detach());
  return g;
}

TEST(Attention, MatchesTheExactAttentionInEveryKernel) {
  struct Case {
    int64_t tq, tk;
    bool causal;
    int64_t dv = 8;  // the value heads' size: the output rows' length, which forward divides by the sums
  };
  const bool blas = models::detail::attention_blas();
  // the float gemms through the BLAS directly where libtorch exports it, and through libtorch
  for (bool direct : {true, false}) {
    if (direct && !blas) continue;
    SCOPED_TRACE(direct ? "sgemm_" : "libtorch's gemm");
    models::detail::set_attention_blas(direct);
    in_every_kernel([] {
      // (up to 64 keys without dropout, libtorch's kernel runs; the other cases are the fused one's)
      for (auto c : {Case{1, 1, true}, Case{5, 5, true}, Case{64, 64, true}, Case{65, 65, true}, Case{130, 130, true},
                     Case{130, 130, false}, Case{1, 130, false}, Case{7, 130, false}, Case{5, 70, true},
                     Case{130, 70, true}, Case{20, 130, true}, Case{130, 130, true, 64}, Case{70, 70, false, 43}}) {
        SCOPED_TRACE(std::to_string(c.tq) + " × " + std::to_string(c.tk) + (c.causal ? ", causal" : "") + ", d_v " +
                     std::to_string(c.dv));
        torch::manual_seed(11);
        const auto q = torch::randn({2, 3, c.tq, 16}).requires_grad_();
        const auto k = torch::randn({2, 3, c.tk, 16}).requires_grad_();
        const auto v = torch::randn({2, 3, c.tk, c.dv}).requires_grad_();
        const auto dy = torch::randn({2, 3, c.tq, c.dv});
        const auto got = with_grads(models::attention(q, k, v, 0.0, c.causal), {q, k, v}, dy);
        // The exact values: libtorch's attention in double, which also fixes where the causal mask
        // falls when t_q ≠ t_k (query i sees keys 0 … i).
        std::vector<torch::Tensor> in;
        for (const auto& x : {q, k, v}) in.push_back(x.detach().to(torch::kDouble).requires_grad_());
        const auto exact = with_grads(at::scaled_dot_product_attention(in[0], in[1], in[2], {}, 0.0, c.causal), in,
                                      dy.to(torch::kDouble));
        for (size_t i = 0; i < got.size(); ++i) EXPECT_LT(max_error(got[i], exact[i]), 2e-5) << kOutputs[i];
      }
    });
  }
  models::detail::set_attention_blas(blas);
}

TEST(Attention, TakesAGradientBroadcastOverTheTokens) {
  // rows 0 apart, as the gradient of a sum against a per-feature weight arrives
  const bool blas = models::detail::attention_blas();
  for (bool direct : {true, false}) {
    if (direct && !blas) continue;
    SCOPED_TRACE(direct ? "sgemm_" : "libtorch's gemm");
    models::detail::set_attention_blas(direct);
    torch::manual_seed(12);
    const auto q = torch::randn({2, 3, 130, 16}).requires_grad_();
    const auto k = torch::randn({2, 3, 130, 16}).requires_grad_();
    const auto v = torch::randn({2, 3, 130, 16}).requires_grad_();
    const auto dy = torch::randn({1, 1, 1, 16}).expand({2, 3, 130, 16});
    ASSERT_EQ(dy.stride(2), 0);
    const auto got = with_grads(models::attention(q, k, v, 0.0, true), {q, k, v}, dy);
    std::vector<torch::Tensor> in;
    for (const auto& x : {q, k, v}) in.push_back(x.detach().to(torch::kDouble).requires_grad_());
    const auto exact = with_grads(at::scaled_dot_product_attention(in[0], in[1], in[2], {}, 0.0, true), in,
                                  dy.to(torch::kDouble));
    for (size_t i = 0; i < got.size(); ++i) EXPECT_LT(max_error(got[i], exact[i]), 2e-5) << kOutputs[i];
  }
  models::detail::set_attention_blas(blas);
}

TEST(Attention, DropoutIsTheFusedDropoutOfTheProbabilities) {
  in_every_kernel([] {
    for (int64_t t : {37, 130}) {
      torch::manual_seed(12);
      auto [leaf, qkv] = packed_qkv(2, 3, t, 16);
      const auto dy = torch::randn({2, 3, t, 16});
      torch::manual_seed(13);
      const auto got = with_grads(models::attention(qkv[0], qkv[1], qkv[2], 0.3, true), {leaf}, dy);
      torch::manual_seed(13);
      const auto want = with_grads(eager_attention(qkv[0], qkv[1], qkv[2], 0.3, true), {leaf}, dy);
      EXPECT_LT(max_error(got[0], want[0]), 2e-5) << t;
      EXPECT_LT(max_error(got[1], want[1]), 2e-5) << t;
      // and the mask is a real one: the result differs from attention without dropout
      EXPECT_GT(max_error(got[0], models::attention(qkv[0], qkv[1], qkv[2], 0.0, true)), 1e-2) << t;
    }
  });
}

TEST(Attention, TheSameBitsWhateverTheThreads) {
  torch::manual_seed(14);
  auto [leaf, qkv] = packed_qkv(2, 3, 150, 16);
  const auto dy = torch::randn({2, 3, 150, 16});
  std::vector<std::vector<torch::Tensor>> runs;
  for (int threads : {1, 2}) {
    at::set_num_threads(threads);
    torch::manual_seed(15);
    runs.push_back(with_grads(models::attention(qkv[0], qkv[1], qkv[2], 0.2, true), {leaf}, dy));
  }
  at::set_num_threads(1);
  for (size_t i = 0; i < runs[0].size(); ++i) EXPECT_TRUE(torch::equal(runs[0][i], runs[1][i])) << i;
}

TEST(Attention, SecondDerivativeMatchesTheEagerOnes) {
  torch::manual_seed(16);
  auto [leaf, qkv] = packed_qkv(1, 2, 40, 8);
  const auto dy = torch::randn({1, 2, 40, 8}).requires_grad_();
  std::vector<std::vector<torch::Tensor>> results;
  for (bool fused : {true, false}) {
    torch::manual_seed(17);
    const auto y = fused ? models::attention(qkv[0], qkv[1], qkv[2], 0.25, true)
                         : eager_attention(qkv[0], qkv[1], qkv[2], 0.25, true);
    const auto g = torch::autograd::grad({y}, {leaf}, {dy}, true, true)[0];
    // d/d(qkv, dy) of Σ g², which runs through the backward's own derivative
    results.push_back(torch::autograd::grad({g.pow(2).sum()}, {leaf, dy}));
  }
  EXPECT_LT(max_error(results[0][0], results[1][0]), 1e-4);
  EXPECT_LT(max_error(results[0][1], results[1][1]), 1e-4);
}

TEST(Attention, ScaleAndSharedKeyHeadsMatchTheExactAttention) {
  struct Case {
    int64_t tq, tk, heads, kv_heads;
    bool causal;
    std::optional<double> scale;
  };
  in_every_kernel([] {
    for (auto c : {Case{130, 130, 6, 2, true, 0.3}, Case{70, 130, 4, 1, false, std::nullopt},
                   Case{130, 70, 3, 3, true, 0.05}, Case{65, 65, 4, 4, true, 2.0}}) {
      SCOPED_TRACE(std::to_string(c.tq) + " × " + std::to_string(c.tk) + ", heads " + std::to_string(c.heads) + "/" +
                   std::to_string(c.kv_heads));
      torch::manual_seed(19);
      const auto q = torch::randn({2, c.heads, c.tq, 16}).requires_grad_();
      const auto k = torch::randn({2, c.kv_heads, c.tk, 16}).requires_grad_();
      const auto v = torch::randn({2, c.kv_heads, c.tk, 8}).requires_grad_();
      const auto dy = torch::randn({2, c.heads, c.tq, 8});
      const auto got = with_grads(models::attention(q, k, v, 0.0, c.causal, c.scale, true), {q, k, v}, dy);
      std::vector<torch::Tensor> in;
      for (const auto& x : {q, k, v}) in.push_back(x.detach().to(torch::kDouble).requires_grad_());
      const auto exact = with_grads(
          at::scaled_dot_product_attention(in[0], in[1], in[2], {}, 0.0, c.causal, c.scale, true), in,
          dy.to(torch::kDouble));
      for (size_t i = 0; i < got.size(); ++i) EXPECT_LT(max_error(got[i], exact[i]), 2e-5) << kOutputs[i];
    }
  });
}

TEST(Attention, SharpRowsKeepGradientsAsExactAsLibtorchs) {
  // Large scales make rows nearly one-hot, where dS = P ∘ (dP' − D) · scale is a small difference:
  // D has to carry the rounding the recomputed P share (rowsum(P ∘ dP') / rowsum(P)); without the
  // division dq is more than 10 times further from the exact one at scale 2 than libtorch's float
  // attention.
  in_every_kernel([] {
    for (double scale : {2.0, 4.0, 8.0}) {
      std::vector<double> ours(3), libtorchs(3);
      for (int seed = 0; seed < 8; ++seed) {
        torch::manual_seed(100 + seed);
        const auto q = torch::randn({2, 4, 65, 16}).requires_grad_();
        const auto k = torch::randn({2, 4, 65, 16}).requires_grad_();
        const auto v = torch::randn({2, 4, 65, 8}).requires_grad_();
        const auto dy = torch::randn({2, 4, 65, 8});
        const auto got = with_grads(models::attention(q, k, v, 0.0, true, scale), {q, k, v}, dy);
        const auto theirs = with_grads(at::scaled_dot_product_attention(q, k, v, {}, 0.0, true, scale), {q, k, v}, dy);
        std::vector<torch::Tensor> in;
        for (const auto& x : {q, k, v}) in.push_back(x.detach().to(torch::kDouble).requires_grad_());
        const auto exact = with_grads(at::scaled_dot_product_attention(in[0], in[1], in[2], {}, 0.0, true, scale), in,
                                      dy.to(torch::kDouble));
        for (size_t i = 0; i < 3; ++i) {
          ours[i] = std::max(ours[i], max_error(got[i + 1], exact[i + 1]));
          libtorchs[i] = std::max(libtorchs[i], max_error(theirs[i + 1], exact[i + 1]));
        }
      }
      for (size_t i = 0; i < 3; ++i) {
        EXPECT_LT(ours[i], 3 * libtorchs[i] + 1e-6) << "scale " << scale << ", " << kOutputs[i + 1];
      }
    }
  });
}

TEST(Attention, SharedKeyHeadsWithDropoutInAnyThreadsAndTwiceDifferentiated) {
  // 6 query heads on 2 key heads: against the materialised attention on the repeated key heads
  torch::manual_seed(20);
  const auto q = torch::randn({2, 6, 100, 16}).requires_grad_();
  const auto k = torch::randn({2, 2, 100, 16}).requires_grad_();
  const auto v = torch::randn({2, 2, 100, 16}).requires_grad_();
  const auto dy = torch::randn({2, 6, 100, 16});
  std::vector<std::vector<torch::Tensor>> runs;
  for (int threads : {1, 2}) {
    at::set_num_threads(threads);
    torch::manual_seed(21);
    runs.push_back(with_grads(models::attention(q, k, v, 0.3, true, std::nullopt, true), {q, k, v}, dy));
  }
  at::set_num_threads(1);
  torch::manual_seed(21);
  const auto want = with_grads(eager_attention(q, k.repeat_interleave(3, 1), v.repeat_interleave(3, 1), 0.3, true),
                               {q, k, v}, dy);
  for (size_t i = 0; i < want.size(); ++i) {
    EXPECT_TRUE(torch::equal(runs[0][i], runs[1][i])) << kOutputs[i];
    EXPECT_LT(max_error(runs[0][i], want[i]), 2e-5) << kOutputs[i];
  }
  // second derivatives, through the differentiable backward's sum over each key head's queries
  std::vector<std::vector<torch::Tensor>> results;
  for (bool fused : {true, false}) {
    torch::manual_seed(22);
    const auto y = fused ? models::attention(q, k, v, 0.3, true, std::nullopt, true)
                         : eager_attention(q, k.repeat_interleave(3, 1), v.repeat_interleave(3, 1), 0.3, true);
    const auto g = torch::autograd::grad({y}, {q, k, v}, {dy}, true, true);
    results.push_back(torch::autograd::grad({g[1].pow(2).sum() + g[2].pow(2).sum()}, {q, k, v}));
  }
  for (size_t i = 0; i < 3; ++i) EXPECT_LT(max_error(results[0][i], results[1][i]), 1e-3) << kOutputs[i + 1];
}

TEST(Attention, SixteenBitWidenedWhereChosen) {
  // the blocks' gemms in float (bf16 ones: Bf16GemmsWhereTheCpuHasThem)
  const auto simd = models::detail::fused_simd();
  models::detail::set_fused_simd(std::min(simd, models::detail::Simd::kAvx512));
  for (const auto dtype : {torch::kBFloat16, torch::kHalf}) {
    SCOPED_TRACE(c10::toString(dtype));
    torch::manual_seed(23);
    const auto leaf = torch::randn({2, 100, 3, 3, 16}).to(dtype).requires_grad_();
    const auto wide = leaf.detach().to(torch::kFloat).requires_grad_();
    const auto qkv = leaf.permute({2, 0, 3, 1, 4}).unbind(0), qkv_wide = wide.permute({2, 0, 3, 1, 4}).unbind(0);
    const auto dy = torch::randn({2, 3, 100, 16}).to(dtype);
    // Widened: the fused kernel on the widened operands, dropout included, and the output and the
    // gradient rounded once.
    models::detail::set_attention_widened(true);
    torch::manual_seed(24);
    const auto got = with_grads(models::attention(qkv[0], qkv[1], qkv[2], 0.2, true), {leaf}, dy);
    torch::manual_seed(24);
    const auto want =
        with_grads(models::attention(qkv_wide[0], qkv_wide[1], qkv_wide[2], 0.2, true), {wide}, dy.to(torch::kFloat));
    for (size_t i = 0; i < 2; ++i) {
      EXPECT_EQ(got[i].scalar_type(), dtype);
      EXPECT_TRUE(torch::equal(got[i], want[i].to(dtype))) << i;
    }
    // Not widened: libtorch's attention in that dtype.
    models::detail::set_attention_widened(false);
    EXPECT_TRUE(torch::equal(models::attention(qkv[0], qkv[1], qkv[2], 0.0, true),
                             at::scaled_dot_product_attention(qkv[0], qkv[1], qkv[2], {}, 0.0, true)));
    models::detail::set_attention_widened(std::nullopt);
  }
  models::detail::set_fused_simd(simd);
}

// Where the CPU has AVX-512 BF16, widened bf16 attention runs its blocks' gemms in bf16 with float
// accumulation, as libtorch's bf16 flash attention does: the probabilities and dS rounded to bf16
// before their products. Against the kernel in float on the same operands (the output and the
// gradients not rounded): within 2^-5, relative to the magnitude or 1 (0.018 at most here; against
// float64 at 1024 tokens libtorch 2.11's bf16 kernel is 0.031 off, these gemms 0.014), on shapes
// that cover odd key counts, row blocks shorter than a tile, a partial last block, key heads shared
// by query heads, a value head size of its own, dropout, and the packed layout; and equal to the
// float gemms for fp16. The same where the CPU has AMX, whose tiles then run the gemms (with
// partial tiles at every edge: rows, columns and pairs that are not multiples of 16).
TEST(Attention, Bf16GemmsWhereTheCpuHasThem) {
  using models::detail::Simd;
  if (!models::detail::cpu_runs(Simd::kAvx512Bf16)) GTEST_SKIP() << "no AVX-512 BF16 here";
  std::vector<Simd> codes{Simd::kAvx512Bf16};
  if (models::detail::cpu_runs(Simd::kAmx)) codes.push_back(Simd::kAmx);
  struct Case {
    int64_t tq, tk, heads, kv_heads, dk, dv;
    bool causal;
    double p;
  };
  const Simd simd = models::detail::fused_simd();
  models::detail::set_attention_widened(true);
  // the operands drawn in `dtype`, then run in `run_in`
  const auto run = [](Simd code, const Case& c, torch::ScalarType dtype, torch::ScalarType run_in) {
    models::detail::set_fused_simd(code);
    torch::manual_seed(41);
    const auto draw = [&](const torch::Tensor& x) { return x.to(dtype).to(run_in).requires_grad_(); };
    const auto q = draw(torch::randn({2, c.heads, c.tq, c.dk}));
    const auto k = draw(torch::randn({2, c.kv_heads, c.tk, c.dk}) * 2);
    const auto v = draw(torch::randn({2, c.kv_heads, c.tk, c.dv}));
    const auto dy = draw(torch::randn({2, c.heads, c.tq, c.dv}));
    torch::manual_seed(42);
    return with_grads(models::attention(q, k, v, c.p, c.causal, std::nullopt, c.kv_heads < c.heads), {q, k, v},
                      dy.detach());
  };
  for (const auto& c : {Case{257, 257, 2, 2, 64, 64, true, 0.0}, Case{100, 77, 3, 3, 16, 8, false, 0.0},
                        Case{130, 131, 6, 2, 18, 10, true, 0.2}, Case{65, 65, 4, 1, 64, 32, true, 0.0}}) {
    SCOPED_TRACE(c10::str(c.tq, " × ", c.tk, ", heads ", c.heads, "/", c.kv_heads, ", d ", c.dk, "/", c.dv));
    const auto gemms_in_float = run(Simd::kAvx512, c, torch::kBFloat16, torch::kBFloat16);
    const auto want = run(Simd::kAvx512, c, torch::kBFloat16, torch::kFloat);
    const auto half_float = run(Simd::kAvx512, c, torch::kHalf, torch::kHalf);
    for (const Simd code : codes) {
      SCOPED_TRACE(models::detail::simd_name(code));
      const auto got = run(code, c, torch::kBFloat16, torch::kBFloat16);
      for (size_t i = 0; i < got.size(); ++i) {
        EXPECT_EQ(got[i].scalar_type(), torch::kBFloat16);
        EXPECT_LE(max_error(got[i], want[i]), std::ldexp(1.0, -5)) << kOutputs[i];
        EXPECT_FALSE(torch::equal(got[i], gemms_in_float[i])) << kOutputs[i] << ": the bf16 gemms did not run";
      }
      const auto half = run(code, c, torch::kHalf, torch::kHalf);
      for (size_t i = 0; i < half.size(); ++i) EXPECT_TRUE(torch::equal(half[i], half_float[i])) << kOutputs[i];
    }
  }
  // keys that no query sees (causal, t_q < t_k) read nowhere, whatever they hold: infinities there
  // give the same bits as zeros (an odd block width pairs its last key with the first unseen one)
  for (const Simd code : codes) {
    models::detail::set_fused_simd(code);
    for (const int64_t tq : {99, 65, 1}) {
      SCOPED_TRACE(c10::str(tq, " queries on 131 keys, ", models::detail::simd_name(code)));
      torch::manual_seed(44);
      const auto q = torch::randn({1, 2, tq, 16}).to(torch::kBFloat16);
      const auto k = torch::randn({1, 2, 131, 16}).to(torch::kBFloat16);
      const auto v = torch::randn({1, 2, 131, 16}).to(torch::kBFloat16);
      const auto dy = torch::randn({1, 2, tq, 16}).to(torch::kBFloat16);
      const auto unseen = torch::indexing::Slice(tq, torch::indexing::None);
      const auto with = [&](double fill) {
        const auto filled = [&](const torch::Tensor& x, double value) {
          auto out = x.clone();
          out.index_put_({torch::indexing::Slice(), torch::indexing::Slice(), unseen}, value);
          return out.requires_grad_();
        };
        const auto q_leaf = q.clone().requires_grad_(), k_leaf = filled(k, fill), v_leaf = filled(v, -fill);
        return with_grads(models::attention(q_leaf, k_leaf, v_leaf, 0.0, true), {q_leaf, k_leaf, v_leaf}, dy);
      };
      const auto zeros = with(0.0), infinities = with(std::numeric_limits<double>::infinity());
      for (size_t i = 0; i < zeros.size(); ++i) EXPECT_TRUE(torch::equal(zeros[i], infinities[i])) << kOutputs[i];
    }
  }
  // the packed layout: the same bits as the unbound views
  torch::manual_seed(43);
  const auto leaf = torch::randn({2, 150, 3, 4, 32}).to(torch::kBFloat16).requires_grad_();
  const auto views = leaf.permute({2, 0, 3, 1, 4}).unbind(0);
  const auto dy = torch::randn({2, 4, 150, 32}).to(torch::kBFloat16);
  const auto packed = with_grads(models::packed_attention(leaf, 0.0, true), {leaf}, dy);
  const auto unbound = with_grads(models::attention(views[0], views[1], views[2], 0.0, true), {leaf}, dy);
  for (size_t i = 0; i < 2; ++i) EXPECT_TRUE(torch::equal(packed[i], unbound[i])) << i;
  models::detail::set_fused_simd(simd);
  models::detail::set_attention_widened(std::nullopt);
}

// The choice: widened wherever the process's 16-bit matmuls are, never under
// ZTRAIN_CPU_MATMUL16=native, and timed under auto where the matmuls are libtorch's; never for
// other dtypes. Timing leaves the random generator as it was.
TEST(Attention, WideningFollowsTheMatmulsOrIsTimed) {
  const auto choose = [](std::optional<bool> matmuls, torch::ScalarType dtype) {
    ztrain::detail::set_cpu_matmul_through_fp32(matmuls);
    models::detail::set_attention_widened(std::nullopt);
    return models::detail::attention_widened(dtype);
  };
  for (const auto dtype : {torch::kBFloat16, torch::kHalf}) {
    SCOPED_TRACE(c10::toString(dtype));
    EXPECT_TRUE(choose(true, dtype));
    setenv("ZTRAIN_CPU_MATMUL16", "native", 1);
    EXPECT_FALSE(choose(std::nullopt, dtype));
    unsetenv("ZTRAIN_CPU_MATMUL16");
    torch::manual_seed(3);
    const auto expected = torch::randn({8});
    torch::manual_seed(3);
    EXPECT_NO_THROW(choose(false, dtype));
    EXPECT_TRUE(torch::equal(torch::randn({8}), expected));
  }
  EXPECT_FALSE(choose(true, torch::kFloat));
  EXPECT_FALSE(choose(true, torch::kDouble));
  ztrain::detail::set_cpu_matmul_through_fp32(std::nullopt);
  models::detail::set_attention_widened(std::nullopt);
}

// packed_attention: the bits of attention() on the unbound views, output and gradient, with and
// without dropout, above and below one block of keys (libtorch's kernel there), in float and in
// widened bf16, and twice differentiated; its gradient in the packed layout.
TEST(Attention, PackedIsAttentionOfTheViews) {
  for (const auto dtype : {torch::kFloat, torch::kBFloat16}) {
    for (int64_t t : {40, 100}) {
      for (double p : {0.0, 0.2}) {
        SCOPED_TRACE(c10::str(dtype, " t=", t, " p=", p));
        torch::manual_seed(31);
        const auto leaf = torch::randn({2, t, 3, 3, 16}).to(dtype).requires_grad_();
        const auto views = leaf.permute({2, 0, 3, 1, 4}).unbind(0);
        const auto dy = torch::randn({2, 3, t, 16}).to(dtype);
        torch::manual_seed(32);
        const auto got = with_grads(models::packed_attention(leaf, p, true), {leaf}, dy);
        torch::manual_seed(32);
        const auto want = with_grads(models::attention(views[0], views[1], views[2], p, true), {leaf}, dy);
        EXPECT_TRUE(torch::equal(got[0], want[0]));
        EXPECT_TRUE(torch::equal(got[1], want[1]));
        if (t > 64 || p > 0) {
          EXPECT_TRUE(got[1].is_contiguous());  // the kernel's, not libtorch's via unbind
        }
      }
    }
  }
  torch::manual_seed(33);
  const auto leaf = torch::randn({1, 100, 3, 2, 8}).requires_grad_();
  const auto views = leaf.permute({2, 0, 3, 1, 4}).unbind(0);
  const auto dy = torch::randn({1, 2, 100, 8}).requires_grad_();
  std::vector<std::vector<torch::Tensor>> second;
  for (bool packed : {true, false}) {
    torch::manual_seed(34);
    const auto y = packed ? models::packed_attention(leaf, 0.25, true)
                          : models::attention(views[0], views[1], views[2], 0.25, true);
    const auto g = torch::autograd::grad({y}, {leaf}, {dy}, true, true)[0];
    second.push_back(torch::autograd::grad({g.pow(2).sum()}, {leaf, dy}));
  }
  EXPECT_TRUE(torch::equal(second[0][0], second[1][0]));
  EXPECT_TRUE(torch::equal(second[0][1], second[1][1]));
  EXPECT_NE(error_message([&] { models::packed_attention(leaf.narrow(2, 0, 2), 0.0, true); })
                .find("qkv must be [batch, tokens, 3, heads, head size]"),
            std::string::npos);
}

TEST(Attention, LibtorchsOutsideFloatOnTheCpuAndErrorsNamed) {
  torch::manual_seed(18);
  const auto q = torch::randn({1, 2, 9, 8}, torch::kDouble), k = torch::randn({1, 2, 9, 8}, torch::kDouble);
  EXPECT_TRUE(torch::equal(models::attention(q, k, k, 0.0, true),
                           at::scaled_dot_product_attention(q, k, k, {}, 0.0, true)));
  const auto f = q.to(torch::kFloat);
  EXPECT_NE(error_message([&] { models::attention(f, f, f, 1.5, true); }).find("must be in [0, 1], got 1.5"),
            std::string::npos);
  EXPECT_NE(error_message([&] { models::attention(f, f.narrow(3, 0, 4), f, 0.0, true); }).find("do not match"),
            std::string::npos);
  EXPECT_NE(error_message([&] { models::attention(f[0], f[0], f[0], 0.0, true); }).find("[batch, heads, tokens"),
            std::string::npos);
  // a scale the kernel does not take (not positive and finite): libtorch's
  const auto g = torch::randn({1, 2, 80, 8});
  EXPECT_TRUE(torch::equal(models::attention(g, g, g, 0.0, false, -0.5),
                           at::scaled_dot_product_attention(g, g, g, {}, 0.0, false, -0.5)));
  const auto one_head = g.narrow(1, 0, 1), three = torch::randn({1, 3, 80, 8});
  EXPECT_NE(error_message([&] { models::attention(g, one_head, one_head, 0.0, true); })
                .find("q has 2 heads and k and v 1 (sharing key heads needs enable_gqa)"),
            std::string::npos);
  EXPECT_NE(error_message([&] { models::attention(three, g, g, 0.0, true, std::nullopt, true); })
                .find("q has 3 heads and k and v 2, which does not divide them"),
            std::string::npos);
}

}  // namespace
}  // namespace ztrain::test
