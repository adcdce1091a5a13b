#include <ztrain/booster/fully_shard.h>

#include "plugin_util.h"
#include "sharding.h"

#include <ztrain/error.h>
#include <ztrain/runtime/init.h>
#include <ztrain/zero/layer_list.h>

#include <algorithm>
#include <map>

namespace ztrain {

namespace detail {

/// The order in which a model's Blocks start their forwards (first calls), recorded until it is
/// fixed after the first step.
struct ExecutionOrder {
  std::vector<ShardedModule*> calls;
  bool fixed = false;

  void called(ShardedModule& block) {
    if (!fixed && std::find(calls.begin(), calls.end(), &block) == calls.end()) calls.push_back(&block);
  }
};

}  // namespace detail

namespace {

/// Whether `path` names a module strictly inside the module at `ancestor`.
bool inside(const std::string& path, const std::string& ancestor) { return path.rfind(ancestor + ".", 0) == 0; }

}  // namespace

FullyShard::FullyShard(FullyShardOptions options) : options_(options) {}

FullyShard::~FullyShard() = default;

void FullyShard::boost(torch::nn::Module& model, torch::optim::Optimizer& optimizer) {
  ZTRAIN_CHECK(!boosted_, "FullyShard: this plugin has boosted a model already; make one plugin per model");
  ZTRAIN_CHECK(options_.prefetch_depth >= 0, "FullyShard: prefetch_depth must be >= 0, got ", options_.prefetch_depth);
  ZTRAIN_CHECK(options_.bucket_bytes > 0, "FullyShard: bucket_bytes must be positive, got ", options_.bucket_bytes);
  detail::check_optimizer_over(model, optimizer, name());
  detail::check_no_state(optimizer, name());

  // The layer lists, and the outermost modules outside them that own parameters themselves.
  const auto modules = model.named_modules("", /*include_self=*/true);
  std::map<std::string, std::shared_ptr<torch::nn::Module>> by_path;
  std::vector<std::pair<std::string, LayerListBase*>> lists;
  for (const auto& item : modules) {
    by_path[item.key()] = item.value();
    if (auto* list = dynamic_cast<LayerListBase*>(item.value().get())) lists.emplace_back(item.key(), list);
  }
  ZTRAIN_CHECK(!lists.empty(), "FullyShard: the model holds no ztrain::LayerList; put its repeated layers in one "
               "(docs/booster.md, what a model must do), or use LowLevelZero, which needs nothing of the model");
  std::vector<std::string> owners;
  for (const auto& item : modules) {
    const auto& path = item.key();
    const auto direct = item.value()->named_parameters(/*recurse=*/false);
    if (direct.is_empty()) continue;
    bool taken = false;  // by a layer list, or whole by an outer owner
    for (const auto& list : lists) taken = taken || inside(path, list.first);
    for (const auto& owner : owners) taken = taken || inside(path, owner);
    if (taken) continue;
    ZTRAIN_CHECK(!path.empty(), "FullyShard: the model registers parameter '", direct.keys().front(),
                 "' on itself; register it in a submodule (an embedding, a norm, a linear), which FullyShard shards");
    for (const auto& list : lists) {
      ZTRAIN_CHECK(!inside(list.first, path), "FullyShard: module '", path, "' owns parameter '", direct.keys().front(),
                   "' and also holds the LayerList '", list.first, "'; move the parameter into a submodule");
    }
    owners.push_back(path);
  }

  auto& context = detail::plugin_context(options_.context);
  detail::move_to_device(model, optimizer, context.device(), name());
  detail::check_same_model(model, context.dp(), name());
  detail::broadcast_from_first(model.buffers(), context.dp());

  const auto unit = detail::optimizer_units(optimizer);
  const BlockOptions block{.zero_level = 3, .use_checkpoint = options_.use_checkpoint,
                           .prefetch_depth = options_.prefetch_depth, .context = context.shared_from_this(),
                           .offload_dir = options_.offload_dir};
  order_ = std::make_shared<detail::ExecutionOrder>();
  for (auto& list : lists) {
    list.second->shard(block, ShardGrouping{.unit = unit});
    for (auto* b : list.second->blocks()) {
      b->set_forward_observer([order = order_](ShardedModule& m) { order->called(m); });
      blocks_.push_back(b);
    }
  }
  for (const auto& path : owners) {
    const auto dot = path.rfind('.');
    const auto parent = by_path.at(dot == std::string::npos ? "" : path.substr(0, dot));
    auto shards = std::make_shared<detail::ZeroShards>(
        by_path.at(path), ShardGrouping{.unit = unit, .max_group_bytes = options_.bucket_bytes}, name(),
        context.shared_from_this());
    parent->replace_module(dot == std::string::npos ? path : path.substr(dot + 1), shards);
    roots_.push_back(std::move(shards));
  }
  auto all = roots();
  all.insert(all.end(), blocks_.begin(), blocks_.end());
  detail::hand_shards(optimizer, all, unit);
  if (!roots_.empty()) buckets_ = detail::shard_buckets(context, roots(), 2);
  boosted_ = true;
}

std::vector<ShardedModule*> FullyShard::roots() const {
  std::vector<ShardedModule*> out;
  for (const auto& r : roots_) out.push_back(r.get());
  return out;
}

void FullyShard::set_gradient_sync(bool on) {
  ZTRAIN_CHECK(boosted_, "FullyShard: no_sync before boost()");
  if (buckets_) buckets_->set_sync(on);
  for (auto* b : blocks_) b->set_gradient_sync(on);
}

void FullyShard::after_zero_grad() {
  if (buckets_) buckets_->zero();
}

void FullyShard::after_update() {
  if (!order_->fixed && !order_->calls.empty()) link_in_execution_order();
  // A layer prefetched where its forward did not follow (a layer run out of the order linked
  // then) holds, or is gathering, values from before the step.
  for (auto* block : blocks_) block->shards_changed();
  detail::refresh(roots());
}

void FullyShard::link_in_execution_order() {
  // Prefetches are collective: every dp rank must link the layers alike.
  order_->fixed = true;
  const auto& order = order_->calls;
  std::string signature;
  for (auto* block : order) {
    signature += std::to_string(std::find(blocks_.begin(), blocks_.end(), block) - blocks_.begin()) + ' ';
  }
  const auto all = detail::plugin_context(options_.context).dp().all_gather_bytes(signature);
  for (size_t r = 1; r < all.size(); ++r) {
    ZTRAIN_CHECK(all[r] == all[0], "FullyShard: dp ranks 0 and ", r, " called the model's layers in different orders "
                 "in the first step (layer indices ", all[0], "against ", all[r], "); every rank must call the same "
                 "layers in the same order");
  }
  // A layer the step did not call keeps its list neighbours.
  for (size_t i = 0; i < order.size(); ++i) {
    std::vector<ShardedModule*> ahead, behind;
    for (size_t k = 1; k <= static_cast<size_t>(options_.prefetch_depth); ++k) {
      if (i + k < order.size()) ahead.push_back(order[i + k]);
      if (i >= k) behind.push_back(order[i - k]);
    }
    order[i]->set_prefetch_neighbours(std::move(ahead), std::move(behind));
  }
}

std::vector<ShardedModule*> FullyShard::execution_order() const {
  return order_ && order_->fixed ? order_->calls : std::vector<ShardedModule*>{};
}

BucketStats FullyShard::stats() const { return buckets_ ? buckets_->stats() : BucketStats{}; }

}  // namespace ztrain
