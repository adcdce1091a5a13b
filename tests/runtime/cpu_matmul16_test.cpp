// 16-bit matmuls through fp32 (src/cpu_matmul16.cpp): each replaced operator in bf16 and fp16,
// forward and through autograd, against float64 on the same values, against the fp32 kernel rounded
// once, and against libtorch's own 16-bit kernels; other dtypes untouched; the environment's
// choice.
#include "test_util.h"

#include <ztrain/cpu_matmul16.h>

#include <array>
#include <cmath>
#include <cstdlib>

namespace cpu_matmul16_test {

using ztrain::detail::cpu_matmul_through_fp32;
using ztrain::detail::cpu_matmul_widened_calls;
using ztrain::detail::set_cpu_matmul_through_fp32;
using ztrain::test::error_message;

const std::vector<torch::ScalarType> k16Bit = {torch::kBFloat16, torch::kHalf};

// Restores the process's choice after a test that sets it.
struct Choice {
  explicit Choice(std::optional<bool> widen) { set_cpu_matmul_through_fp32(widen); }
  ~Choice() { set_cpu_matmul_through_fp32(std::nullopt); }
};

// Half a unit in the last place of the type, relative to the value at most: 2^-8 for bf16, 2^-11
// for fp16.
double half_unit(torch::ScalarType dtype) { return std::ldexp(1.0, dtype == torch::kBFloat16 ? -8 : -11); }

// Largest error over the reference's largest magnitude.
double error(const torch::Tensor& got, const torch::Tensor& want) {
  auto g = got.to(torch::kDouble), w = want.to(torch::kDouble);
  return ((g - w).abs().max() / w.abs().max()).item<double>();
}

using Op = std::function<torch::Tensor(const std::vector<torch::Tensor>&)>;

struct Case {
  const char* name;
  std::vector<std::vector<int64_t>> shapes;
  Op op;
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
       [](const auto& t) { return torch::nn::functional::linear(t[0], t[1], t[2]); }},
      {"matmul (4-d)", {{2, 3, 40, 64}, {2, 3, 64, 24}}, [](const auto& t) { return torch::matmul(t[0], t[1]); }},
      // Over 2^20 elements in an operand: in chunks along the largest dimension, n, m or k.
      {"mm in chunks of columns", {{40, 300}, {300, 4000}}, [](const auto& t) { return torch::mm(t[0], t[1]); }},
      {"addmm in chunks of columns", {{4000}, {40, 300}, {300, 4000}},
       [](const auto& t) { return torch::addmm(t[0], t[1], t[2], /*beta=*/0.5, /*alpha=*/2); }},
      {"addmm in chunks of rows", {{4000, 24}, {4000, 300}, {300, 24}},
       [](const auto& t) { return torch::addmm(t[0], t[1], t[2], /*beta=*/2, /*alpha=*/0.5); }},
      {"addmm in chunks of the inner dimension", {{100}, {200, 6000}, {6000, 100}},
       [](const auto& t) { return torch::addmm(t[0], t[1], t[2], /*beta=*/0.5, /*alpha=*/2); }},
      {"scaled_dot_product_attention", {{2, 3, 80, 32}, {2, 3, 80, 32}, {2, 3, 80, 32}},
       [](const auto& t) { return at::scaled_dot_product_attention(t[0], t[1], t[2], {}, 0.0, /*is_causal=*/true); }},
  };
}

// Values of the 16-bit type `kind`, held in `dtype` (the type itself, or float64 for the reference).
std::vector<torch::Tensor> inputs(const Case& c, torch::ScalarType kind, torch::ScalarType dtype) {
  torch::manual_seed(11);
  std::vector<torch::Tensor> t;
  for (const auto& shape : c.shapes) t.push_back(torch::randn(shape).to(kind).to(dtype).requires_grad_());
  return t;
}

struct Result {
  torch::Tensor out;
  std::vector<torch::Tensor> grads;
};

// The op's output and, for a fixed output gradient, its inputs' gradients.
Result run(const Case& c, torch::ScalarType kind, torch::ScalarType dtype) {
  auto t = inputs(c, kind, dtype);
  auto out = c.op(t);
  torch::manual_seed(12);
  out.backward(torch::randn(out.sizes()).to(kind).to(dtype));
  Result r{out.detach(), {}};
  for (const auto& x : t) r.grads.push_back(x.grad());
  return r;
}

TEST(CpuMatmul16, EachOperatorForwardAndBackwardThroughFp32) {
  Choice widen(true);
  for (const auto kind : k16Bit) {
    for (const auto& c : cases()) {
      SCOPED_TRACE(std::string(c.name) + " in " + c10::toString(kind));
      const auto before = cpu_matmul_widened_calls();
      const auto got = run(c, kind, kind);
      EXPECT_GE(cpu_matmul_widened_calls() - before, 2u) << "the forward and the backward each widen";
      ASSERT_EQ(got.out.scalar_type(), kind);
      const auto want = run(c, kind, torch::kDouble);
      // One rounding of an fp32-accurate result: within half a unit of the largest value, and
      // fp32's accumulated error.
      EXPECT_LT(error(got.out, want.out), half_unit(kind) + 1e-4);
      for (size_t i = 0; i < got.grads.size(); ++i) {
        SCOPED_TRACE("gradient of input " + std::to_string(i));
        ASSERT_EQ(got.grads[i].scalar_type(), kind);
        // A gradient may sum several rounded products (a bias's, attention's chain).
        EXPECT_LT(error(got.grads[i], want.grads[i]), 8 * half_unit(kind) + 1e-3);
      }
    }
  }
}

TEST(CpuMatmul16, EqualsTheFp32KernelRoundedOnce) {
  Choice widen(true);
  for (const auto kind : k16Bit) {
    SCOPED_TRACE(c10::toString(kind));
    torch::manual_seed(3);
    const auto a = torch::randn({64, 256}).to(kind), b = torch::randn({256, 48}).to(kind),
               bias = torch::randn({48}).to(kind);
    const auto f = [](const torch::Tensor& t) { return t.to(torch::kFloat); };
    EXPECT_TRUE(torch::equal(torch::mm(a, b), torch::mm(f(a), f(b)).to(kind)));
    EXPECT_TRUE(torch::equal(torch::addmm(bias, a, b), torch::addmm(f(bias), f(a), f(b)).to(kind)));
  }
}

// The out= form writes the same widened product into the given tensor (whole, in chunks of rows,
// columns or the inner dimension, and into a strided slice), and an operand that cannot be
// multiplied is refused.
TEST(CpuMatmul16, MmOutWidensIntoItsOutput) {
  Choice widen(true);
  for (const auto kind : k16Bit) {
    for (const auto& [m, k, n] : std::vector<std::array<int64_t, 3>>{
             {64, 256, 48}, {4000, 300, 24}, {40, 300, 4000}, {24, 6000, 100}}) {
      SCOPED_TRACE(c10::str(c10::toString(kind), " ", m, "x", k, "x", n));
      torch::manual_seed(5);
      const auto a = torch::randn({m, k}).to(kind), b = torch::randn({k, n}).to(kind);
      const auto want = torch::mm(a.to(torch::kFloat), b.to(torch::kFloat)).to(kind);
      auto out = torch::empty({m, n}, kind);
      const auto before = cpu_matmul_widened_calls();
      const auto& returned = at::mm_out(out, a, b);
      EXPECT_EQ(cpu_matmul_widened_calls() - before, 1u);
      EXPECT_TRUE(returned.is_same(out));
      EXPECT_TRUE(torch::equal(out, want));
      auto wider = torch::zeros({m, n + 8}, kind);
      auto slice = wider.narrow(1, 4, n);
      at::mm_out(slice, a, b);
      EXPECT_TRUE(torch::equal(slice, want));
      EXPECT_EQ(wider.narrow(1, 0, 4).abs().sum().item<double>(), 0.0);
    }
    auto out = torch::empty({3, 3}, kind);
    try {  // libtorch's error type, as from its own kernel
      at::mm_out(out, torch::ones({3, 4}, kind), torch::ones({5, 3}, kind));
      ADD_FAILURE() << "mismatched operands were multiplied";
    } catch (const c10::Error& e) {
      EXPECT_NE(std::string(e.what()).find("cannot be multiplied (3x4 and 5x3)"), std::string::npos) << e.what();
    }
  }
}

TEST(CpuMatmul16, LibtorchsOwnKernelsComputeTheSame) {
  for (const auto kind : k16Bit) {
    for (const auto& c : cases()) {
      SCOPED_TRACE(std::string(c.name) + " in " + c10::toString(kind));
      torch::Tensor native, widened;
      {
        Choice keep(false);
        const auto before = cpu_matmul_widened_calls();
        native = run(c, kind, kind).out;
        EXPECT_EQ(cpu_matmul_widened_calls(), before);
      }
      {
        Choice widen(true);
        widened = run(c, kind, kind).out;
      }
      // Both accumulate in fp32; they may round a sum differently (a unit or two).
      EXPECT_LT(error(widened, native), 8 * half_unit(kind));
    }
  }
}

TEST(CpuMatmul16, OtherDtypesAreLibtorchs) {
  Choice widen(true);
  torch::manual_seed(5);
  const auto before = cpu_matmul_widened_calls();
  for (auto dtype : {torch::kFloat, torch::kDouble}) {
    const auto a = torch::randn({32, 64}, dtype), b = torch::randn({64, 16}, dtype);
    EXPECT_EQ(torch::mm(a, b).scalar_type(), dtype);
    EXPECT_FALSE(cpu_matmul_through_fp32(dtype));
  }
  // Mixed dtypes keep libtorch's own error.
  EXPECT_THROW(torch::mm(torch::randn({4, 4}).to(torch::kBFloat16), torch::randn({4, 4})), c10::Error);
  EXPECT_THROW(torch::mm(torch::randn({4, 4}).to(torch::kBFloat16), torch::randn({4, 4}).to(torch::kHalf)),
               c10::Error);
  EXPECT_EQ(cpu_matmul_widened_calls(), before);
}

TEST(CpuMatmul16, TheEnvironmentChooses) {
  const auto choose = [](const char* mode, torch::ScalarType dtype) {
    setenv("ZTRAIN_CPU_MATMUL16", mode, 1);
    set_cpu_matmul_through_fp32(std::nullopt);
    return cpu_matmul_through_fp32(dtype);
  };
  for (const auto kind : k16Bit) {
    EXPECT_TRUE(choose("fp32", kind));
    EXPECT_FALSE(choose("native", kind));
  }
  EXPECT_EQ(error_message([&] { choose("bf16", torch::kBFloat16); }),
            "ZTRAIN_CPU_MATMUL16 must be auto, fp32 or native, got 'bf16'");
  // The bad value was not kept: a 16-bit matmul names it again.
  EXPECT_NE(error_message([] { torch::mm(torch::ones({2, 2}, torch::kHalf), torch::ones({2, 2}, torch::kHalf)); })
                .find("ZTRAIN_CPU_MATMUL16"),
            std::string::npos);
  unsetenv("ZTRAIN_CPU_MATMUL16");
  set_cpu_matmul_through_fp32(std::nullopt);
  // auto may time both ways (where libtorch has a kernel of its own); the random generator is left
  // as it was.
  torch::manual_seed(3);
  const auto expected = torch::randn({8});
  torch::manual_seed(3);
  for (const auto kind : k16Bit) EXPECT_NO_THROW(cpu_matmul_through_fp32(kind));
  EXPECT_TRUE(torch::equal(torch::randn({8}), expected));
}

}  // namespace cpu_matmul16_test
