// The tensor-parallel RNG tracker: draws inside a TensorParallelRng scope differ across the tp
// group while draws outside stay equal across it; the scope leaves the default stream where it
// was; recomputation replays the tracker, so a recomputed Block's dropout equals the kept one's;
// GPT's attention dropout uses it on split heads.

#include "tp_environment.h"

#include <ztrain/runtime/tp_rng.h>

namespace ztrain::test {
namespace tp_rng_test {

[[maybe_unused]] const auto* const kEnvironment = ::testing::AddGlobalTestEnvironment(new TensorParallelEnvironment({"TensorParallelRng"}));

/// Whether `t` is the same on every rank of the tp group.
bool same_across_tp(const torch::Tensor& t) {
  auto& tp = runtime().tp();
  auto all = tp.all_gather(t.reshape(-1).contiguous()).view({tp.size(), -1});
  return all.eq(all[0]).all().item<bool>();
}

TEST(TensorParallelRng, DrawsDifferAcrossTheGroupInsideAndAgreeOutside) {
  ASSERT_GE(runtime().tp().size(), 2);
  const auto before = torch::rand({64});
  torch::Tensor inside, after;
  {
    TensorParallelRng split_rng;
    inside = torch::rand({64});
  }
  after = torch::rand({64});
  EXPECT_TRUE(same_across_tp(before));
  EXPECT_FALSE(same_across_tp(inside));
  EXPECT_TRUE(same_across_tp(after));
  // The default stream continues as if the scope had drawn nothing.
  torch::manual_seed(7);
  const auto a = torch::rand({8});
  const auto b = torch::rand({8});
  torch::manual_seed(7);
  const auto a2 = torch::rand({8});
  {
    TensorParallelRng split_rng;
    torch::rand({1000});
  }
  EXPECT_TRUE(torch::equal(a, a2));
  EXPECT_TRUE(torch::equal(torch::rand({8}), b));
  // Successive scopes continue the tracker's own stream.
  torch::Tensor first, second;
  {
    TensorParallelRng split_rng;
    first = torch::rand({8});
  }
  {
    TensorParallelRng split_rng;
    second = torch::rand({8});
  }
  EXPECT_FALSE(torch::equal(first, second));
}

/// Dropout on split activations (inside the tracker) and on replicated ones (outside).
struct DropsImpl : torch::nn::Module {
  DropsImpl() : fc(16, 16), drop(0.5) {
    register_module("fc", fc);
    register_module("drop", drop);
  }
  torch::Tensor forward(torch::Tensor x) {
    x = fc(x);
    {
      TensorParallelRng split_rng;
      x = drop(x);
    }
    return drop(x * 2);
  }
  torch::nn::Linear fc;
  torch::nn::Dropout drop;
};
TORCH_MODULE(Drops);

TEST(TensorParallelRng, RecomputationReplaysTheTracker) {
  std::vector<torch::Tensor> grads;
  for (bool recompute : {false, true}) {
    torch::manual_seed(3);
    rng::set_tensor_parallel_states(c10::Device(c10::kCPU), {});  // the tracker from its seed again
    Block<Drops> block(Drops(), {.zero_level = 0, .use_checkpoint = recompute});
    auto x = torch::ones({4, 16});
    block(x).sum().backward();
    grads.push_back(block->parameters().at(0).grad().clone());  // the flat gradient of fc
  }
  EXPECT_TRUE(torch::equal(grads[0], grads[1])) << "recomputation drew other dropout masks";
}

TEST(TensorParallelRng, GptAttentionDrawsItsDropoutFromTheTracker) {
  models::GptConfig c{.vocab_size = 32, .context = 16, .d_model = 16, .n_layer = 1, .n_head = 4, .dropout = 0.5};
  torch::manual_seed(1);
  models::GptAttention attn(c, &runtime().tp());
  attn->train();
  // The heads are split over the tp group, so the attention dropout advances the tracker.
  const auto before = rng::tensor_parallel_states(c10::Device(c10::kCPU));
  attn(torch::randn({2, 8, 16}));
  const auto after = rng::tensor_parallel_states(c10::Device(c10::kCPU));
  ASSERT_EQ(before.size(), after.size());
  EXPECT_FALSE(torch::equal(before[0], after[0])) << "attention dropout did not draw from the tracker";
}

}  // namespace tp_rng_test
}  // namespace ztrain::test
