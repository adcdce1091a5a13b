// Autograd collectives against the single-process computation they distribute: every rank
// builds the full inputs, computes a distributed loss whose sum over ranks equals a reference
// loss, and compares its gradient slice with the reference gradient.
#include "test_util.h"

#include <ztrain/comm/functional.h>

namespace functional_test {

namespace F = ztrain::functional;
using ztrain::test::tensors_equal;

namespace {
ztrain::Communicator& world() { return ztrain::runtime().world(); }

// Inputs every rank can rebuild: full tensors from a shared seed.
torch::Tensor full_input(int64_t rows, int64_t cols, uint64_t seed) {
  auto g = at::detail::createCPUGenerator(seed);
  return torch::randn({rows, cols}, g, torch::kFloat64);
}
torch::Tensor weights_like(const torch::Tensor& t, uint64_t seed) {
  auto g = at::detail::createCPUGenerator(seed);
  return torch::randn(t.sizes(), g, torch::kFloat64);
}
}  // namespace

TEST(Functional, AllGatherBackwardIsReduceScatter) {
  auto& c = world();
  const int64_t n = 17;
  auto full = full_input(c.size(), n, 1);  // row r is rank r's shard
  auto w = weights_like(full, 2);          // each rank weighs the gathered tensor differently
  auto wr = w * (c.rank() + 1);
  auto x = full[c.rank()].clone().requires_grad_(true);
  auto loss = (F::all_gather(x, c).view({c.size(), n}) * wr).sum();
  loss.backward();
  // Reference: total loss = Σ_r Σ (full * w * (r+1)); its gradient wrt row r.
  double factor = c.size() * (c.size() + 1) / 2.0;
  EXPECT_TRUE(tensors_equal(x.grad(), w[c.rank()] * factor, 1e-12));
}

TEST(Functional, ReduceScatterBackwardIsAllGather) {
  auto& c = world();
  const int64_t n = 5;
  auto x = (full_input(c.size(), n, 3) * (c.rank() + 1)).reshape(-1).requires_grad_(true);
  auto w = weights_like(torch::zeros({n}, torch::kFloat64), 4 + c.rank());
  auto y = F::reduce_scatter(x, c);
  double factor = c.size() * (c.size() + 1) / 2.0;
  EXPECT_TRUE(tensors_equal(y, full_input(c.size(), n, 3)[c.rank()] * factor, 1e-12));
  (y * w).sum().backward();
  std::vector<torch::Tensor> ws;
  for (int r = 0; r < c.size(); ++r) ws.push_back(weights_like(torch::zeros({n}, torch::kFloat64), 4 + r));
  EXPECT_TRUE(tensors_equal(x.grad(), torch::cat(ws), 1e-12));
}

TEST(Functional, AllReduceBackwardSumsGradients) {
  auto& c = world();
  auto x = full_input(3, 4, 10 + c.rank()).requires_grad_(true);
  auto w = weights_like(x, 20 + c.rank());
  auto y = F::all_reduce(x, c);
  (y * w).sum().backward();
  auto wsum = torch::zeros_like(w);
  for (int r = 0; r < c.size(); ++r) wsum += weights_like(x, 20 + r);
  EXPECT_TRUE(tensors_equal(x.grad(), wsum, 1e-12));
}

TEST(Functional, MegatronPairGivesTheDenseGradients) {
  // y = relu(x A) B with A split by columns and B by rows over the group; the loss is taken
  // once (every rank holds the same y), so the reference is the dense single-process graph.
  auto& c = world();
  const int64_t d = 6, h = 4 * c.size(), batch = 3;
  auto x0 = full_input(batch, d, 30), a0 = full_input(d, h, 31), b0 = full_input(h, d, 32);
  auto x = x0.clone().requires_grad_(true), a = a0.clone().requires_grad_(true), b = b0.clone().requires_grad_(true);
  auto ref = torch::matmul(torch::relu(torch::matmul(x, a)), b);
  (ref * ref).sum().backward();

  auto xs = x0.clone().requires_grad_(true);
  auto as = a0.chunk(c.size(), 1)[c.rank()].clone().requires_grad_(true);
  auto bs = b0.chunk(c.size(), 0)[c.rank()].clone().requires_grad_(true);
  auto hidden = torch::relu(torch::matmul(F::copy_to_group(xs, c), as));
  auto y = F::reduce_from_group(torch::matmul(hidden, bs), c);
  EXPECT_TRUE(tensors_equal(y, ref.detach(), 1e-12));
  // Every rank computes the same (replicated) loss, as in Megatron's tensor-parallel regions.
  (y * y).sum().backward();
  EXPECT_TRUE(tensors_equal(xs.grad(), x.grad(), 1e-10));
  EXPECT_TRUE(tensors_equal(as.grad(), a.grad().chunk(c.size(), 1)[c.rank()], 1e-10));
  EXPECT_TRUE(tensors_equal(bs.grad(), b.grad().chunk(c.size(), 0)[c.rank()], 1e-10));
}

TEST(Functional, ScatterAndGatherAlongADimension) {
  auto& c = world();
  auto full = full_input(3, 2 * c.size(), 40);
  auto x = full.clone().requires_grad_(true);
  auto part = F::scatter_to_group(x, c, 1);
  EXPECT_TRUE(tensors_equal(part, full.chunk(c.size(), 1)[c.rank()]));
  auto back = F::gather_from_group(part * (c.rank() + 1), c, -1);
  std::vector<torch::Tensor> scaled;
  for (int r = 0; r < c.size(); ++r) scaled.push_back(full.chunk(c.size(), 1)[r] * (r + 1));
  EXPECT_TRUE(tensors_equal(back, torch::cat(scaled, 1), 1e-12));
  back.sum().backward();
  // d/dx of own slice * (rank+1): gather's backward keeps this rank's slice, scatter's backward
  // gathers the slices back into the full shape.
  std::vector<torch::Tensor> grads;
  for (int r = 0; r < c.size(); ++r) grads.push_back(torch::full({3, 2}, double(r + 1), torch::kFloat64));
  EXPECT_TRUE(tensors_equal(x.grad(), torch::cat(grads, 1)));
  if (c.size() > 1) {
    auto msg = ztrain::test::error_message([&] { F::scatter_to_group(full_input(3, 2 * c.size() + 1, 1), c, 1); });
    EXPECT_NE(msg.find("does not divide"), std::string::npos) << msg;
  }
}

}  // namespace functional_test
