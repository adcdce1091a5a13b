// bf16 matmuls through fp32 (src/cpu_bf16_matmul.cpp): each replaced operator, forward and through
// autograd, against float64 on the same bf16 values, against the fp32 kernel rounded once, and
// against libtorch's own bf16 kernel; other dtypes untouched; the environment's choice.
#include "test_util.h"

#include <ztrain/cpu_bf16.h>

#include <cstdlib>

namespace cpu_bf16_matmul_test {

using ztrain::detail::cpu_bf16_matmul_through_fp32;
using ztrain::detail::cpu_bf16_widened_calls;
using ztrain::detail::set_cpu_bf16_matmul_through_fp32;
using ztrain::test::error_message;

// Restores the process's choice after a test that sets it.
struct Choice {
  explicit Choice(std::optional<bool> widen) { set_cpu_bf16_matmul_through_fp32(widen); }
  ~Choice() { set_cpu_bf16_matmul_through_fp32(std::nullopt); }
};

torch::Tensor bf16_randn(at::IntArrayRef shape) { return torch::randn(shape).to(torch::kBFloat16); }

// Largest error in units of the reference's magnitude (at least 1).
double error(const torch::Tensor& got, const torch::Tensor& want) {
  auto g = got.to(torch::kDouble), w = want.to(torch::kDouble);
  return ((g - w).abs() / w.abs().clamp_min(1)).max().item<double>();
}

using Op = std::function<torch::Tensor(const std::vector<torch::Tensor>&)>;

struct Case {
  const char* name;
  std::vector<std::vector<int64_t>> shapes;
  Op op;
  int roundings = 1;  // to bf16, on the way to the output
};

std::vector<Case> cases() {
  return {
      {"mm", {{96, 320}, {320, 72}}, [](const auto& t) { return torch::mm(t[0], t[1]); }},
      {"mm transposed", {{320, 96}, {72, 320}}, [](const auto& t) { return torch::mm(t[0].t(), t[1].t()); }},
      {"addmm", {{72}, {96, 320}, {320, 72}},
       [](const auto& t) { return torch::addmm(t[0], t[1], t[2], /*beta=*/0.5, /*alpha=*/2); }},
      {"bmm", {{3, 40, 64}, {3, 64, 24}}, [](const auto& t) { return torch::bmm(t[0], t[1]); }},
      {"baddbmm", {{3, 40, 24}, {3, 40, 64}, {3, 64, 24}},
       [](const auto& t) { return torch::baddbmm(t[0], t[1], t[2], /*beta=*/1, /*alpha=*/0.25); }},
      {"linear (3-d input)", {{2, 48, 320}, {72, 320}, {72}},
       // libtorch adds the bias to the rounded product
       [](const auto& t) { return torch::nn::functional::linear(t[0], t[1], t[2]); }, 2},
      {"matmul (4-d)", {{2, 3, 40, 64}, {2, 3, 64, 24}}, [](const auto& t) { return torch::matmul(t[0], t[1]); }},
      {"scaled_dot_product_attention", {{2, 3, 80, 32}, {2, 3, 80, 32}, {2, 3, 80, 32}},
       [](const auto& t) { return at::scaled_dot_product_attention(t[0], t[1], t[2], {}, 0.0, /*is_causal=*/true); }},
  };
}

std::vector<torch::Tensor> inputs(const Case& c, torch::ScalarType dtype) {
  torch::manual_seed(11);
  std::vector<torch::Tensor> t;
  for (const auto& shape : c.shapes) t.push_back(bf16_randn(shape).to(dtype).requires_grad_());
  return t;
}

struct Result {
  torch::Tensor out;
  std::vector<torch::Tensor> grads;
};

// The op's output and, for a fixed output gradient, its inputs' gradients.
Result run(const Case& c, torch::ScalarType dtype) {
  auto t = inputs(c, dtype);
  auto out = c.op(t);
  torch::manual_seed(12);
  out.backward(torch::randn(out.sizes()).to(torch::kBFloat16).to(dtype));
  Result r{out.detach(), {}};
  for (const auto& x : t) r.grads.push_back(x.grad());
  return r;
}

TEST(CpuBf16Matmul, EachOperatorForwardAndBackwardThroughFp32) {
  Choice widen(true);
  for (const auto& c : cases()) {
    SCOPED_TRACE(c.name);
    const auto before = cpu_bf16_widened_calls();
    const auto got = run(c, torch::kBFloat16);
    EXPECT_GE(cpu_bf16_widened_calls() - before, 2u) << "the forward and the backward each widen";
    ASSERT_EQ(got.out.scalar_type(), torch::kBFloat16);
    const auto want = run(c, torch::kDouble);
    // Each rounding to bf16 of an fp32-accurate result: within half a bf16 unit, 2^-8 of the value
    // at most, and fp32's accumulated error.
    EXPECT_LT(error(got.out, want.out), c.roundings / 256.0 + 1e-4);
    for (size_t i = 0; i < got.grads.size(); ++i) {
      SCOPED_TRACE("gradient of input " + std::to_string(i));
      ASSERT_EQ(got.grads[i].scalar_type(), torch::kBFloat16);
      // A gradient may sum several rounded products (a bias's, attention's chain).
      EXPECT_LT(error(got.grads[i], want.grads[i]), 4.0 / 256);
    }
  }
}

TEST(CpuBf16Matmul, EqualsTheFp32KernelRoundedOnce) {
  Choice widen(true);
  torch::manual_seed(3);
  const auto a = bf16_randn({64, 256}), b = bf16_randn({256, 48}), bias = bf16_randn({48});
  EXPECT_TRUE(torch::equal(torch::mm(a, b), torch::mm(a.to(torch::kFloat), b.to(torch::kFloat)).to(torch::kBFloat16)));
  EXPECT_TRUE(torch::equal(torch::addmm(bias, a, b), torch::addmm(bias.to(torch::kFloat), a.to(torch::kFloat),
                                                                   b.to(torch::kFloat))
                                                         .to(torch::kBFloat16)));
}

TEST(CpuBf16Matmul, LibtorchsOwnKernelComputesTheSame) {
  for (const auto& c : cases()) {
    SCOPED_TRACE(c.name);
    torch::Tensor native, widened;
    {
      Choice keep(false);
      const auto before = cpu_bf16_widened_calls();
      native = run(c, torch::kBFloat16).out;
      EXPECT_EQ(cpu_bf16_widened_calls(), before);
    }
    {
      Choice widen(true);
      widened = run(c, torch::kBFloat16).out;
    }
    // Both accumulate in fp32; they may round a sum differently (a unit or two).
    EXPECT_LT(error(widened, native), 4.0 / 256);
  }
}

TEST(CpuBf16Matmul, OtherDtypesAreLibtorchs) {
  Choice widen(true);
  torch::manual_seed(5);
  const auto before = cpu_bf16_widened_calls();
  for (auto dtype : {torch::kFloat, torch::kDouble}) {
    const auto a = torch::randn({32, 64}, dtype), b = torch::randn({64, 16}, dtype);
    EXPECT_EQ(torch::mm(a, b).scalar_type(), dtype);
  }
  // Mixed dtypes keep libtorch's own error.
  EXPECT_THROW(torch::mm(bf16_randn({4, 4}), torch::randn({4, 4})), c10::Error);
  EXPECT_EQ(cpu_bf16_widened_calls(), before);
}

TEST(CpuBf16Matmul, TheEnvironmentChooses) {
  const auto run_with = [](const char* mode) {
    setenv("ZTRAIN_CPU_BF16_MATMUL", mode, 1);
    set_cpu_bf16_matmul_through_fp32(std::nullopt);
    return cpu_bf16_matmul_through_fp32();
  };
  EXPECT_TRUE(run_with("fp32"));
  EXPECT_FALSE(run_with("native"));
  EXPECT_EQ(error_message([&] { run_with("bf16"); }),
            "ZTRAIN_CPU_BF16_MATMUL must be auto, fp32 or native, got 'bf16'");
  // The bad value was not kept: a bf16 matmul names it again.
  EXPECT_NE(error_message([] { torch::mm(bf16_randn({2, 2}), bf16_randn({2, 2})); }).find("ZTRAIN_CPU_BF16_MATMUL"),
            std::string::npos);
  unsetenv("ZTRAIN_CPU_BF16_MATMUL");
  set_cpu_bf16_matmul_through_fp32(std::nullopt);
  EXPECT_NO_THROW(cpu_bf16_matmul_through_fp32());
}

}  // namespace cpu_bf16_matmul_test
