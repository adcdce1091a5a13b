// The engine on the runtime's device (the CPU here; a CUDA device in the .cuda variants, run by
// scripts/gpu_check.sh): sharded modules move what they wrap onto it, Adam there agrees with the
// CPU kernels, AdamOffload (state in host memory) with AdamW, and a checkpoint saved on the
// device loads into a CPU context over the same ranks and back.
#include "test_util.h"
#include "zero_model.h"

#include <filesystem>

namespace ztrain::test {
namespace device_test {

namespace fs = std::filesystem;
namespace zo = ztrain::optim;

constexpr int64_t kBatch = 4;
constexpr int64_t kSeq = 8;

/// This rank's slice of batch `step`, on `device`.
torch::Tensor local_batch(int64_t step, c10::Device device) {
  const int dp = runtime().dp().size(), r = runtime().dp().rank();
  const int64_t local = kBatch / dp;
  return batch_tokens(step, kBatch, kSeq, ModelConfig{}.vocab).slice(0, r * local, (r + 1) * local).to(device);
}

TEST(Device, ShardedModulesMoveWhatTheyWrapOntoTheContextsDevice) {
  const auto device = runtime().device();
  for (int level = 0; level <= 3; ++level) {
    SCOPED_TRACE(c10::str("level ", level));
    torch::manual_seed(3);
    torch::nn::Linear built_on_cpu(8, 8);
    ASSERT_TRUE(built_on_cpu->weight.is_cpu());
    Block<torch::nn::Linear> block(built_on_cpu, {.zero_level = level});
    for (const auto& g : block->groups()) EXPECT_EQ(g.shard.device(), device);
    EXPECT_EQ(built_on_cpu->weight.device(), device) << "the wrapped module's own parameter objects moved";
    auto x = torch::randn({2, 8}).to(device).requires_grad_();
    block(x).square().sum().backward();
    EXPECT_EQ(x.grad().device(), device);
    for (const auto& g : block->groups()) {
      ASSERT_TRUE(g.shard.grad().defined());
      EXPECT_EQ(g.shard.grad().device(), device);
    }
  }
}

// The device side runs libtorch's fused kernel (what CUDA parameters always use), the CPU side
// ztrain's SIMD kernel, which equals PyTorch's AdamW to ~1e-6 (optim/adam_test.cpp). The CUDA
// fused kernel forms 1 - beta2 in float (1 - 0.999f = 0.00099998713), so its second moment is
// 1.3e-5 smaller, relatively, than torch.optim's and the CPU kernel's (1 - 0.999 in double, then
// rounded): 3e-5 for the moments, 1e-5 for what they move.
TEST(Device, AdamThereMatchesTheCpuKernel) {
  const auto device = runtime().device();
  for (auto dtype : {torch::kFloat32, torch::kBFloat16}) {
    SCOPED_TRACE(c10::str(dtype));
    torch::manual_seed(11);
    auto on_cpu = (torch::randn({4099}) * 0.5).to(dtype);
    auto on_device = on_cpu.to(device).clone();  // a copy also where the device is the CPU
    const auto options = zo::AdamOptions(1e-2).weight_decay(0.1);
    zo::AdamW cpu_opt({on_cpu}, options);
    zo::AdamW device_opt({on_device}, options, {.kernel = zo::AdamKernel::kTorchFused});
    for (int step = 0; step < 20; ++step) {
      const auto g = torch::randn({4099}).to(dtype);
      on_cpu.mutable_grad() = g;
      on_device.mutable_grad() = g.to(device);
      cpu_opt.step();
      device_opt.step();
    }
    const auto* s = device_opt.state_of(on_device);
    EXPECT_EQ(s->exp_avg.device(), device);
    EXPECT_EQ(s->master.defined(), dtype != torch::kFloat32);
    if (s->master.defined()) {
      EXPECT_EQ(s->master.device(), device);
      EXPECT_TRUE(tensors_equal(s->master, cpu_opt.state_of(on_cpu)->master, 1e-5, 1e-7));
    }
    EXPECT_TRUE(tensors_equal(s->exp_avg_sq, cpu_opt.state_of(on_cpu)->exp_avg_sq, 3e-5, 1e-12));
    // A 16-bit parameter is its master rounded: within one unit of the dtype where the masters differ.
    const double eps = dtype == torch::kFloat32 ? 1e-5 : std::ldexp(1.0, -7);
    EXPECT_TRUE(tensors_equal(on_device, on_cpu, eps, 1e-7));
  }
}

struct Trained {
  std::vector<double> losses;
  std::vector<std::pair<std::string, torch::Tensor>> params;
};

template <class Optimizer>
Trained train(int level, int steps) {
  const auto device = runtime().device();
  torch::manual_seed(7);
  ZeroModel model(ModelConfig{}, BlockOptions{.zero_level = level}, level);
  Optimizer opt(*model, zo::AdamOptions(1e-2));
  zo::OptimManager mgr(*model);
  mgr.add_optimizer(opt);
  Trained t;
  for (int step = 0; step < steps; ++step) {
    auto tokens = local_batch(step, device);
    auto loss = lm_loss(model->forward(tokens), tokens);
    mgr.zero_grad();
    mgr.backward(loss);
    mgr.step();
    t.losses.push_back(sum_loss(loss).item<double>());
  }
  t.params = gathered_parameters(*model);
  for (const auto& p : model->parameters()) {
    const auto* s = opt.state_of(p);
    if (s == nullptr) {
      ADD_FAILURE() << "a parameter without optimizer state";
      continue;
    }
    EXPECT_EQ(s->exp_avg.device(), opt.state_device(p));
    EXPECT_EQ(s->master.defined(), !p.is_cpu() && opt.state_device(p).is_cpu()) << "a master exactly when offloaded";
  }
  return t;
}

using Named = std::vector<std::pair<std::string, torch::Tensor>>;

/// Parameters of two runs whose kernels differ in rounding, equal to `rtol`/`atol`, except the
/// attention's key bias: its gradient is zero up to rounding (softmax ignores a shift shared by
/// all keys), and Adam turns rounding noise into steps of up to about lr each, in either
/// direction: it is held to `key_atol`.
void expect_near(const Named& a, const Named& b, double rtol, double atol, double key_atol) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    const auto &x = a[i].second, &y = b[i].second;
    if (!a[i].first.ends_with("qkv.bias")) {
      EXPECT_TRUE(tensors_equal(x, y, rtol, atol)) << a[i].first;
      continue;
    }
    const int64_t d = x.size(0) / 3;
    EXPECT_TRUE(tensors_equal(x.narrow(0, 0, d), y.narrow(0, 0, d), rtol, atol)) << a[i].first << " (query)";
    EXPECT_TRUE(tensors_equal(x.narrow(0, d, d), y.narrow(0, d, d), 0.0, key_atol)) << a[i].first << " (key)";
    EXPECT_TRUE(tensors_equal(x.narrow(0, 2 * d, d), y.narrow(0, 2 * d, d), rtol, atol)) << a[i].first << " (value)";
  }
}

/// AdamW over a model's parameters, as AdamOffload is constructed.
struct ModelAdamW : zo::AdamW {
  ModelAdamW(torch::nn::Module& model, zo::AdamOptions options) : zo::AdamW(model.parameters(), options) {}
};

// On the CPU AdamOffload runs AdamW's kernel: equal bit for bit. On a device its state is in host
// memory and its update is the CPU's SIMD kernel, AdamW's libtorch's fused one there: equal to the
// bounds of Device.AdamThereMatchesTheCpuKernel.
TEST(Device, AdamOffloadKeepsItsStateOnTheHostAndEqualsAdamW) {
  const bool cpu = runtime().device().is_cpu();
  for (int level : {0, 3}) {
    SCOPED_TRACE(c10::str("level ", level));
    const auto plain = train<ModelAdamW>(level, 5);
    const auto offload = train<zo::AdamOffload>(level, 5);
    for (size_t i = 0; i < plain.losses.size(); ++i) {
      EXPECT_NEAR(plain.losses[i], offload.losses[i], cpu ? 0.0 : 1e-5 * plain.losses[i]) << "step " << i;
    }
    expect_near(plain.params, offload.params, cpu ? 0.0 : 1e-5, cpu ? 0.0 : 1e-7, cpu ? 0.0 : 5 * 2 * 1e-2);
  }
}

/// A ZeroModel with AdamW and its manager on one context, for checkpoints.
struct Trainer {
  explicit Trainer(std::shared_ptr<ParallelContext> context)
      : model(ModelConfig{}, BlockOptions{.zero_level = 3, .context = context}, 3),
        opt(model->parameters(), zo::AdamOptions(1e-2)),
        mgr(*model) {
    mgr.add_optimizer(opt);
  }
  TrainingState state() { return {*model, opt, mgr}; }
  void train(int64_t first, int64_t steps) {
    const auto device = model->wte->context().device();
    for (int64_t step = first; step < first + steps; ++step) {
      auto tokens = local_batch(step, device);
      mgr.zero_grad();
      mgr.backward(lm_loss(model->forward(tokens), tokens));
      mgr.step();
    }
  }
  std::vector<std::pair<std::string, torch::Tensor>> params() { return gathered_parameters(*model); }

  ZeroModel model;
  zo::AdamW opt;
  zo::OptimManager mgr;
};

void expect_same_params(Trainer& a, Trainer& b) {
  const auto pa = a.params(), pb = b.params();
  ASSERT_EQ(pa.size(), pb.size());
  for (size_t i = 0; i < pa.size(); ++i) EXPECT_TRUE(tensors_equal(pa[i].second, pb[i].second)) << pa[i].first;
}

TEST(Device, CheckpointSavedOnTheDeviceLoadsOnTheCpuAndBack) {
  const auto root = shared_temp_dir("device_round_trip");
  auto cpu = default_context().split(0, {.name = "cpu", .device = c10::Device(c10::kCPU)});
  ASSERT_TRUE(cpu->device().is_cpu());

  torch::manual_seed(21);
  Trainer on_device(runtime().context_ptr());
  on_device.train(0, 3);
  const auto dir = save_checkpoint(root, 3, on_device.state());

  torch::manual_seed(22);  // other initial values: the load must replace all of them
  Trainer on_cpu(cpu);
  EXPECT_TRUE(on_cpu.model->wte->groups()[0].shard.is_cpu());
  EXPECT_EQ(load_checkpoint(dir, on_cpu.state()).step, 3);
  expect_same_params(on_device, on_cpu);
  // The optimizer state came along: one more step stays together (within the devices' kernels).
  on_device.train(3, 1);
  on_cpu.train(3, 1);
  expect_near(on_device.params(), on_cpu.params(), 1e-4, 1e-6, 2 * 1e-2);

  // And back: saved on the CPU, loaded on the device.
  const auto back = save_checkpoint(root, 4, on_cpu.state());
  torch::manual_seed(23);
  Trainer again(runtime().context_ptr());
  load_checkpoint(back, again.state());
  expect_same_params(on_cpu, again);
  if (runtime().rank() == 0) fs::remove_all(root);
}

}  // namespace device_test
}  // namespace ztrain::test
