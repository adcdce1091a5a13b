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
/// The arithmetic is AdamW's, kernel for kernel: the results equal ztrain::optim::AdamW bit for
/// bit. The optimizer state and the fp32 masters live in host memory by construction (this
/// build's tensors are CPU tensors), so what it buys on CPU is the overlap: the update of
/// parameters used late in the forward proceeds on otherwise idle cores while the forward runs
/// (nothing when every core already runs a compute thread). On a GPU the same schedule would
/// keep state and masters in host memory, stream each block's gradient down and its new
/// weights up, and let the host update of block i overlap the device forward of blocks < i;
/// this build has no device code path, so that use is described, not provided.
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
  /// Waits for the updates in flight (errors are dropped; call wait() to see them).
  ~AdamOffload() override;

  /// Checks, updates the parameters outside sharded modules, queues the others' updates and
  /// returns. Waits first for the previous step's updates.
  torch::Tensor step(LossClosure closure = nullptr) override;
  /// Blocks until every queued update is done; rethrows the first error.
  void wait();
  /// Updates queued or running.
  bool busy() const;

 protected:
  void sync() const override { const_cast<AdamOffload*>(this)->wait(); }

 private:
  AdamOffload(const std::vector<RecordedParameter>& params, AdamOptions defaults, AdamEngineOptions engine);
  void start();
  void run();

  /// Param group 0's parameters as built from the model, with their fences (null: updated in
  /// step()); a position whose tensor was replaced since has none.
  std::vector<std::pair<torch::Tensor, std::shared_ptr<UpdateFence>>> fenced_;
  mutable std::mutex mutex_;
  std::condition_variable wake_;
  std::deque<std::function<void()>> queue_;
  std::vector<std::shared_future<void>> in_flight_;
  bool stop_ = false;
  std::thread worker_;
};

}  // namespace ztrain::optim
