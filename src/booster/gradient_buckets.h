#pragma once
// Gradients gathered into flat buckets while backward runs, each bucket's reduction started as
// soon as its last gradient has landed — the machinery under DataParallel and LowLevelZero.

#include <ztrain/booster/booster.h>
#include <ztrain/comm/work.h>

#include <torch/torch.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace ztrain::detail {

/// One bucket: a flat buffer of `numel` elements and the parameters whose gradients it holds.
struct BucketPlan {
  struct Member {
    std::string name;
    torch::Tensor param;
    int64_t offset = 0;  // elements into the buffer
  };
  std::vector<Member> members;
  int64_t numel = 0;
  torch::TensorOptions options;
};

/// The gradient buckets of one boosted model: which parameter lands where, which buckets are
/// complete in the running backward, and the reductions in flight. Buckets start in index
/// order, the same on every rank (plan them in the order backward produces their gradients).
class GradientBuckets : public std::enable_shared_from_this<GradientBuckets> {
 public:
  /// Starts the reduction of bucket `b`'s summed local gradient `flat`; returns its Work
  /// (undefined: nothing to wait for, and not counted as a reduction).
  using Start = std::function<Work(size_t b, torch::Tensor flat)>;
  enum class Keep {
    /// The buffers live from step to step and each parameter's .grad is a view into its bucket
    /// (DDP).
    kBuffers,
    /// A bucket's buffer is made when its first gradient lands and handed to `start`; the
    /// parameters' .grad are dropped as their gradients are copied in (ZeRO-2: only the
    /// reduced shards keep gradients).
    kNothing,
  };

  GradientBuckets(std::vector<BucketPlan> plans, Keep keep, Start start);
  /// Hooks the accumulators (after construction: the hooks hold weak references to this).
  void arm();
  void set_sync(bool on) { sync_ = on; }
  /// Drops the gradients (kBuffers: zeroes them, keeping them views of the buckets).
  void zero();
  BucketStats stats() const { return stats_; }

  /// A parameter's gradient has been accumulated (the hook, on the backward thread).
  void ready(size_t slot);

 private:
  struct Slot {
    std::string name;
    torch::Tensor param;
    size_t bucket = 0;
    int64_t offset = 0;
    std::shared_ptr<torch::autograd::Node> accumulator;
    bool ready = false;
  };
  struct Bucket {
    BucketPlan plan;
    torch::Tensor flat;
    std::vector<size_t> slots;
    size_t pending = 0;  // slots without a gradient yet in the running backward
    Work work;
  };

  void start(size_t bucket, bool during_backward);
  void finish();  // the end of a backward (a final callback of the autograd engine)
  /// Moves the slot's gradient into its bucket (kBuffers: makes .grad the view).
  void adopt(Slot& slot);
  torch::Tensor& buffer(Bucket& bucket);
  torch::Tensor view(Slot& slot);

  Keep keep_;
  Start start_;
  std::vector<Slot> slots_;
  std::vector<Bucket> buckets_;
  size_t next_ = 0;  // the next bucket to start, in order
  bool sync_ = true;
  bool in_backward_ = false;
  BucketStats stats_;
};

}  // namespace ztrain::detail
