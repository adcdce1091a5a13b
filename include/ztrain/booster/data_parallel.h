#pragma once
/// DataParallel: the plugin with DDP's semantics, for any plain libtorch model.
///
/// boost() checks that every rank of the data-parallel group holds the same parameters (names,
/// dtypes, shapes), broadcasts parameters and buffers from dp rank 0, and hooks each
/// parameter's gradient accumulator. Gradients are gathered into buckets (consecutive
/// parameters in reverse registration order, roughly the order backward produces them, up to
/// `bucket_bytes` each, one dtype per bucket); as soon as a bucket's last gradient has been
/// accumulated, its mean over the dp group starts on the context's reduction stream while
/// backward goes on, buckets always in the same order on every rank. When backward ends —
/// through Booster::backward or a plain `loss.backward()` — the reductions still missing are
/// started and all of them have landed. Each parameter's `.grad` is then a view into its
/// bucket; a parameter that got no gradient on some rank counts as zero there, so every rank
/// ends with the same gradients. Under Booster::no_sync the gradients accumulate locally and
/// the next synchronised backward reduces the sum.
///
/// The model is replicated over the dp group of the default context (init_distributed), on its
/// device: boost() moves a model built elsewhere there (the parameter objects stay, so the
/// optimizer's references hold; batches go there as the caller sends them).
/// The model needs nothing from ztrain: its forward runs as written. Parameters stay
/// replicated (optimizer state too); use it where the model and its optimizer state fit on
/// every rank.

#include <ztrain/booster/booster.h>
#include <ztrain/runtime/parallel_context.h>

#include <cstdint>
#include <memory>

namespace ztrain {

struct DataParallelOptions {
  /// The most gradient bytes one reduction carries (DDP's bucket_cap_mb): smaller buckets
  /// start reducing earlier in backward, larger ones pay fewer per-call costs.
  int64_t bucket_bytes = int64_t{25} << 20;
  /// The mesh whose dp group the plugin spans. Not set: the default context (init_distributed).
  std::shared_ptr<ParallelContext> context;
};

using DataParallelStats = BucketStats;

namespace detail {
class GradientBuckets;
}

class DataParallel : public Plugin {
 public:
  explicit DataParallel(DataParallelOptions options = {});
  ~DataParallel() override;

  std::string name() const override { return "DataParallel"; }
  void boost(torch::nn::Module& model, torch::optim::Optimizer& optimizer) override;
  void set_gradient_sync(bool on) override;
  void after_zero_grad() override;
  ParallelContext* mesh() override { return options_.context.get(); }

  DataParallelStats stats() const;
  const DataParallelOptions& options() const { return options_; }

 private:
  DataParallelOptions options_;
  std::shared_ptr<detail::GradientBuckets> buckets_;
};

}  // namespace ztrain
