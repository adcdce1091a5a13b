#pragma once
/// AdamOffload: AdamW whose update runs on a background thread, parameter by parameter, so it
/// overlaps with the next forward.
///
/// It is built on a model: it updates the model's parameters, and the ones whose owner waits for
/// asynchronous writes (their record carries a fence, runtime/parameter_record.h: the shards of
/// Blocks and DistributedParameters) are updated behind step(). step() checks everything (as
/// AdamW), then hands each such parameter's update to the optimizer's own update thread, in
/// parameter order, sets its fence and returns at once. A sharded module waits for the update
/// of its own shard only when it needs it — before gathering it (on the gather stream, so the
/// forward thread is not held) or before using its full buffer (levels 0 and 1) — so block 0's
/// forward starts as soon as block 0 is updated while the later blocks are still being updated.
/// Plain parameters are updated inside step(). Checkpoints, full_parameter() and the state
/// accessors wait for every update first.
///
/// The optimizer state lives in host memory (state_device() is the CPU) and the update runs on
/// the CPU's SIMD kernels, as ZeRO-Offload does:
/// - CPU parameters: the arithmetic is AdamW's, kernel for kernel (the results equal
///   ztrain::optim::AdamW bit for bit); what it buys is the overlap — the update of parameters
///   used late in the forward proceeds on otherwise idle cores while the forward runs (nothing
///   when every core already runs a compute thread).
/// - CUDA parameters: moments and an fp32 master of every parameter stay in pinned host memory,
///   off the GPU (12 bytes per parameter for fp32 and 16-bit alike). Each update copies the
///   gradient to the host, runs the SIMD kernel there and copies the new weights back, on the
///   update thread, so the host update of block i overlaps the device forward of blocks < i.
///   The results equal ztrain::optim::AdamW's on the CPU for the same values bit for bit; they
///   differ from AdamW on the device (libtorch's fused kernel) in the last bits.
///
/// step() takes the gradients: afterwards every parameter's grad is undefined (as after
/// zero_grad with set_to_none), so the next backward can never write into a gradient the
/// update is still reading. One thread calls step() at a time; wait() blocks until the updates
/// are done and rethrows an update's error (also rethrown by the module that waits for it).
///
///   ztrain::optim::AdamOffload opt(*model, ztrain::optim::AdamOptions(3e-4));
///   mgr.add_optimizer(opt);     // OptimManager as with AdamW
///   mgr.step();                 // returns while the update runs; the next forward waits per block

#include <ztrain/optim/adam.h>
#include <ztrain/runtime/parameter_record.h>

#include <condition_variable>
#include <deque>
#include <functional>
#include <future>
#include <mutex>
#include <thread>

namespace ztrain::optim {

class AdamOffload : public AdamW {
 public:
  /// Updates every parameter of `model` (one parameter group, in model->parameters() order).
  explicit AdamOffload(torch::nn::Module& model, AdamOptions defaults = {}, AdamEngineOptions engine = {});
  /// Updates the parameters of `model` in `groups` (for example weight_decay_groups(model,
  /// defaults)); every tensor in them must be a parameter of `model`.
  AdamOffload(torch::nn::Module& model, std::vector<torch::optim::OptimizerParamGroup> groups, AdamOptions defaults,
              AdamEngineOptions engine = {});
  /// Waits for the updates in flight (errors are dropped; call wait() to see them).
  ~AdamOffload() override;

  /// Checks, updates the parameters outside sharded modules, queues the others' updates and
  /// returns. Waits first for the previous step's updates.
  torch::Tensor step(LossClosure closure = nullptr) override;
  /// Blocks until every queued update is done; rethrows the first error.
  void wait();
  /// Updates queued or running.
  bool busy() const;
  /// The CPU, for every parameter.
  c10::Device state_device(const torch::Tensor& /*param*/) const override { return c10::Device(c10::kCPU); }

 protected:
  void sync() const override { const_cast<AdamOffload*>(this)->wait(); }

 private:
  void start();
  void run();

  /// Each group's parameters as built from the model, with their fences (null: updated in
  /// step()); a position whose tensor was replaced since has none.
  std::vector<std::vector<std::pair<torch::Tensor, std::shared_ptr<UpdateFence>>>> fenced_;
  mutable std::mutex mutex_;
  std::condition_variable wake_;
  std::deque<std::function<void()>> queue_;
  std::vector<std::shared_future<void>> in_flight_;
  bool stop_ = false;
  std::thread worker_;
};

}  // namespace ztrain::optim
