#include <ztrain/booster/hybrid_parallel.h>

#include "plugin_util.h"

#include <ztrain/booster/data_parallel.h>
#include <ztrain/booster/fully_shard.h>
#include <ztrain/booster/low_level_zero.h>
#include <ztrain/error.h>
#include <ztrain/runtime/init.h>

namespace ztrain {

HybridParallel::HybridParallel(HybridParallelOptions options) : options_(std::move(options)) {
  ZTRAIN_CHECK(options_.tp_size >= 1, "HybridParallel: tp_size must be >= 1, got ", options_.tp_size);
  ZTRAIN_CHECK(options_.zero_level >= 0 && options_.zero_level <= 3, "HybridParallel: zero_level must be 0-3, got ",
               options_.zero_level);
  ZTRAIN_CHECK(options_.tp_size == 1 || !options_.policy.tensor_parallel.empty(), "HybridParallel: tp_size ",
               options_.tp_size, " with a policy ('", options_.policy.name, "') that splits no layer");
}

HybridParallel::~HybridParallel() = default;

void HybridParallel::boost(torch::nn::Module& model, torch::optim::Optimizer& optimizer) {
  ZTRAIN_CHECK(!inner_, "HybridParallel: this plugin has boosted a model already; make one plugin per model");
  auto& base = default_context();
  ZTRAIN_CHECK(base.world_size() % options_.tp_size == 0, "HybridParallel: tp_size ", options_.tp_size,
               " does not divide the ", base.world_size(), " ranks");
  if (base.tp().size() == options_.tp_size && base.pp().size() == 1) {
    context_ = base.shared_from_this();
  } else {
    auto layout = base.options();  // the same seed, device and buffers, laid out dp × tp
    layout.tp_size = options_.tp_size;
    layout.pp_size = 1;
    layout.name = "hybrid";
    context_ = base.split(0, layout);
  }
  detail::check_optimizer_over(model, optimizer, name());
  detail::move_to_device(model, optimizer, context_->device(), name());
  // Every tp rank splits the same full tensors: rank 0's.
  const auto params = detail::check_same_model(model, context_->world(), name());
  std::vector<torch::Tensor> state;
  for (const auto& item : params) state.push_back(item.second);
  for (const auto& b : model.buffers()) state.push_back(b);
  detail::broadcast_from_first(state, context_->world());
  apply_tensor_parallel(model, options_.policy, context_->tp(), context_.get());

  switch (options_.zero_level) {
    case 0:
      inner_ = std::make_shared<DataParallel>(
          DataParallelOptions{.bucket_bytes = options_.bucket_bytes, .context = context_});
      break;
    case 1:
    case 2:
      inner_ = std::make_shared<LowLevelZero>(LowLevelZeroOptions{
          .stage = options_.zero_level, .bucket_bytes = options_.bucket_bytes, .context = context_});
      break;
    default:
      inner_ = std::make_shared<FullyShard>(FullyShardOptions{.use_checkpoint = options_.use_checkpoint,
                                                              .prefetch_depth = options_.prefetch_depth,
                                                              .bucket_bytes = options_.bucket_bytes,
                                                              .context = context_});
  }
  inner_->boost(model, optimizer);
}

torch::nn::Module& HybridParallel::boosted(torch::nn::Module& model) { return data_parallel().boosted(model); }

void HybridParallel::set_gradient_sync(bool on) { data_parallel().set_gradient_sync(on); }

void HybridParallel::after_zero_grad() {
  if (inner_) inner_->after_zero_grad();
}

void HybridParallel::after_update() {
  if (inner_) inner_->after_update();
}

ParallelContext& HybridParallel::context() {
  ZTRAIN_CHECK(context_, "HybridParallel: boost() first");
  return *context_;
}

Plugin& HybridParallel::data_parallel() {
  ZTRAIN_CHECK(inner_, "HybridParallel: boost() first");
  return *inner_;
}

}  // namespace ztrain
