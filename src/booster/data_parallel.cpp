#include <ztrain/booster/data_parallel.h>

#include "gradient_buckets.h"
#include "plugin_util.h"

#include <ztrain/error.h>
#include <ztrain/runtime/init.h>

namespace ztrain {

DataParallel::DataParallel(DataParallelOptions options) : options_(options) {}

DataParallel::~DataParallel() = default;

void DataParallel::boost(torch::nn::Module& model, torch::optim::Optimizer& optimizer) {
  ZTRAIN_CHECK(!buckets_, "DataParallel: this plugin has boosted a model already; make one plugin per model");
  ZTRAIN_CHECK(options_.bucket_bytes > 0, "DataParallel: bucket_bytes must be positive, got ", options_.bucket_bytes);
  auto& context = detail::plugin_context(options_.context);
  detail::check_optimizer_over(model, optimizer, name());
  detail::move_to_device(model, optimizer, context.device(), name());
  const auto params = detail::check_same_model(model, context.dp(), name());
  std::vector<torch::Tensor> state;  // replicas start equal: dp rank 0's values
  for (const auto& item : params) state.push_back(item.second);
  for (const auto& b : model.buffers()) state.push_back(b);
  detail::broadcast_from_first(state, context.dp());

  // Buckets over the trainable parameters, last registered first (the order backward produces
  // their gradients), at most bucket_bytes and one dtype each.
  std::vector<detail::BucketPlan> plans;
  int64_t filled = 0;
  for (auto it = params.rbegin(); it != params.rend(); ++it) {
    const auto& [pname, p] = *it;
    if (!p.requires_grad()) continue;
    const int64_t bytes = p.numel() * static_cast<int64_t>(p.element_size());
    const bool fresh = plans.empty() || (filled > 0 && filled + bytes > options_.bucket_bytes) ||
                       plans.back().options.dtype() != p.dtype();
    if (fresh) {
      plans.push_back({.options = p.options()});
      filled = 0;
    }
    plans.back().members.push_back({.name = pname, .param = p, .offset = plans.back().numel});
    plans.back().numel += p.numel();
    filled += bytes;
  }
  const bool alone = context.dp().size() == 1;
  if (!alone) context.reduce_stream();  // made now: collective, the same point on every rank
  buckets_ = std::make_shared<detail::GradientBuckets>(
      std::move(plans), detail::GradientBuckets::Keep::kBuffers, [&context, alone](size_t, torch::Tensor flat) {
        return alone ? Work() : context.reduce_stream().all_reduce(std::move(flat), ReduceOp::kAvg);
      });
  buckets_->arm();
}

void DataParallel::set_gradient_sync(bool on) {
  ZTRAIN_CHECK(buckets_, "DataParallel: no_sync before boost()");
  buckets_->set_sync(on);
}

void DataParallel::after_zero_grad() {
  if (buckets_) buckets_->zero();
}

DataParallelStats DataParallel::stats() const { return buckets_ ? buckets_->stats() : DataParallelStats{}; }

}  // namespace ztrain
