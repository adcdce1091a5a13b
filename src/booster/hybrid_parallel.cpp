#include <ztrain/booster/hybrid_parallel.h>

#include "plugin_util.h"

#include <ztrain/booster/data_parallel.h>
#include <ztrain/booster/fully_shard.h>
#include <ztrain/booster/low_level_zero.h>
#include <ztrain/error.h>
#include <ztrain/runtime/init.h>
#include <ztrain/zero/layer_list.h>

#include <unordered_set>

namespace ztrain {

namespace {

/// One pipeline stage of a policy's model: the embedding on the first, layers [first, last),
/// the head and loss on the last.
class PolicyStage : public pipe::StageImpl {
 public:
  /// `boosted`: the plugin's module holding what the optimizer updates (registered beside the
  /// model, so that Pipeline::tie finds their records).
  PolicyStage(std::shared_ptr<torch::nn::Module> model, std::shared_ptr<torch::nn::Module> boosted,
              const PipelinePolicy& policy, std::pair<int64_t, int64_t> layers, bool first, bool last)
      : model_(register_module("model", std::move(model))), policy_(policy), layers_(layers), first_(first),
        last_(last) {
    if (boosted != model_) register_module("boosted", std::move(boosted));
  }

  pipe::TensorList forward(const pipe::TensorList& inputs, const pipe::TensorList& micro_batch) override {
    auto x = first_ ? policy_.embed(*model_, micro_batch) : inputs;
    for (int64_t i = layers_.first; i < layers_.second; ++i) x = policy_.layer(*model_, i, x);
    if (last_) return {policy_.loss(*model_, x, micro_batch)};
    return x;
  }

 private:
  std::shared_ptr<torch::nn::Module> model_;
  PipelinePolicy policy_;
  std::pair<int64_t, int64_t> layers_;
  bool first_, last_;
};

/// The submodule of `model` at `path`, or null.
std::shared_ptr<torch::nn::Module> find_module(torch::nn::Module& model, const std::string& path) {
  for (const auto& item : model.named_modules()) {
    if (item.key() == path) return item.value();
  }
  return nullptr;
}

/// Puts `module` in place of the submodule at `path` (which must exist) in `model`; returns the
/// one it replaced.
std::shared_ptr<torch::nn::Module> replace(torch::nn::Module& model, const std::string& path,
                                           std::shared_ptr<torch::nn::Module> module) {
  auto old = find_module(model, path);
  const auto dot = path.rfind('.');
  const auto parent = dot == std::string::npos ? detail::shared_module(model) : find_module(model, path.substr(0, dot));
  ZTRAIN_INTERNAL_ASSERT(old && parent, "replace: no module at '", path, "'");
  parent->replace_module(path.substr(dot == std::string::npos ? 0 : dot + 1), std::move(module));
  return old;
}

/// A module tied across pipeline stages, as a stage holds it in the model: the same parameter
/// tensors under the same names, with the original's records (a split over tp) and those that
/// Pipeline::tie writes (how many copies a gradient norm counts). The model's own code goes on
/// calling the original module.
class TiedModule : public torch::nn::Module, public ParameterRecords {
 public:
  explicit TiedModule(torch::nn::Module& original) : torch::nn::Module("TiedModule") {
    const auto* records = dynamic_cast<const ParameterRecords*>(&original);
    for (const auto& p : original.named_parameters(/*recurse=*/false)) {
      register_parameter(p.key(), p.value(), p.value().requires_grad());
      if (const auto* r = records ? records->find_record(p.key()) : nullptr) record(p.key()) = *r;
    }
  }
};

/// Moves `params` out of the optimizer's groups into groups of their own, one per group they
/// came from, with its options: a ZeRO plugin lays each group out in flat buffers of its own,
/// so the copies on two stages shard alike. Returns the new groups' indices.
std::vector<size_t> isolate(torch::optim::Optimizer& optimizer, const std::vector<torch::Tensor>& params) {
  std::unordered_set<const c10::TensorImpl*> moving;
  for (const auto& p : params) moving.insert(p.unsafeGetTensorImpl());
  std::vector<torch::optim::OptimizerParamGroup> fresh;
  for (auto& group : optimizer.param_groups()) {
    std::vector<torch::Tensor> taken;
    auto& held = group.params();
    for (auto it = held.begin(); it != held.end();) {
      if (moving.count(it->unsafeGetTensorImpl())) {
        taken.push_back(*it);
        it = held.erase(it);
      } else {
        ++it;
      }
    }
    if (!taken.empty()) fresh.emplace_back(std::move(taken), group.options().clone());
  }
  std::vector<size_t> indices;
  for (const auto& group : fresh) {
    indices.push_back(optimizer.param_groups().size());
    optimizer.add_param_group(group);
  }
  return indices;
}

}  // namespace

HybridParallel::HybridParallel(HybridParallelOptions options) : options_(std::move(options)) {
  ZTRAIN_CHECK(options_.tp_size >= 1, "HybridParallel: tp_size must be >= 1, got ", options_.tp_size);
  ZTRAIN_CHECK(options_.zero_level >= 0 && options_.zero_level <= 3, "HybridParallel: zero_level must be 0-3, got ",
               options_.zero_level);
  ZTRAIN_CHECK(options_.pp_size >= 1, "HybridParallel: pp_size must be >= 1, got ", options_.pp_size);
  const auto& pipeline = options_.policy.pipeline;
  ZTRAIN_CHECK(options_.pp_size == 1 || (pipeline && pipeline.embed && pipeline.layer && pipeline.loss),
               "HybridParallel: pp_size ", options_.pp_size, " with a policy ('", options_.policy.name,
               "') whose pipeline part does not name the layer list and its embed, layer and loss calls");
  const bool interleaved = options_.schedule == pipe::ScheduleKind::kInterleaved1F1B;
  ZTRAIN_CHECK(interleaved ? options_.chunks >= 2 : options_.chunks == 1, "HybridParallel: ", options_.chunks,
               " model chunks per rank with the ", interleaved ? "interleaved" : "GPipe or 1F1B", " schedule; ",
               interleaved ? "the interleaved schedule needs chunks >= 2" : "more than one needs the interleaved schedule");
}

HybridParallel::~HybridParallel() = default;

void HybridParallel::boost(torch::nn::Module& model, torch::optim::Optimizer& optimizer) {
  ZTRAIN_CHECK(!inner_, "HybridParallel: this plugin has boosted a model already; make one plugin per model");
  mesh_context();
  detail::check_optimizer_over(model, optimizer, name());
  model_ = detail::shared_module(model);
  // A model made in build() for this stage: the policy's list holds this stage's layers only,
  // and no other list may have been cut.
  bool by_stage = false;
  for (const auto& item : model.named_modules()) {
    auto* list = dynamic_cast<LayerListBase*>(item.value().get());
    if (!list || !list->partial()) continue;
    ZTRAIN_CHECK(options_.pp_size > 1 && item.key() == options_.policy.pipeline.layers, "HybridParallel: the layer "
                 "list '", item.key(), "' was made for a pipeline stage (in build()), but it is not the layer list '",
                 options_.policy.pipeline.layers, "' that policy '", options_.policy.name,
                 "' has the stages share out; make the other lists without a size and factory (push_back)");
    by_stage = true;
  }
  detail::move_to_device(model, optimizer, context_->device(), name());
  split_tensor_parallel(model, by_stage);
  if (options_.pp_size > 1) hold_stage(model, optimizer);
  boost_data_parallel(model, optimizer);
  if (options_.pp_size > 1) build_pipeline(model, optimizer);
}

ParallelContext& HybridParallel::mesh_context() {
  if (context_) return *context_;
  auto& base = default_context();
  ZTRAIN_CHECK(base.world_size() % (options_.tp_size * options_.pp_size) == 0, "HybridParallel: tp_size ",
               options_.tp_size, " x pp_size ", options_.pp_size, " does not divide the ", base.world_size(), " ranks");
  if (base.tp().size() == options_.tp_size && base.pp().size() == options_.pp_size) {
    context_ = base.shared_from_this();
  } else {
    auto layout = base.options();  // the same seed, device and buffers, laid out pp × dp × tp
    layout.tp_size = options_.tp_size;
    layout.pp_size = options_.pp_size;
    layout.name = "hybrid";
    context_ = base.split(0, layout);
  }
  return *context_;
}

LayerListScope::Ranges HybridParallel::stage_layers(size_t size) {
  const int parts = options_.pp_size * options_.chunks;
  if (parts == 1) return {{0, size}};
  const auto n = static_cast<int64_t>(size);
  const auto bounds = options_.bounds.empty() ? pipe::partition_uniform(n, parts)
                                              : pipe::partition_explicit(options_.bounds, n, parts);
  const int stage = mesh_context().pp_rank();
  LayerListScope::Ranges ranges;
  for (int c = 0; c < options_.chunks; ++c) {
    const int v = pipe::virtual_stage(stage, c, options_.pp_size);
    ranges.emplace_back(static_cast<size_t>(bounds[v]), static_cast<size_t>(bounds[v + 1]));
  }
  return ranges;
}

void HybridParallel::split_tensor_parallel(torch::nn::Module& model, bool by_stage) {
  // Every rank starts from rank 0's model (each stage's first rank's, for a model made for its
  // stage), and splits the same full tensors; the slices of layers split at construction
  // (ztrain::tp layers over several ranks) come from the lowest rank with their tp rank.
  auto& same = by_stage ? context_->stage() : context_->world();
  detail::check_same_model(model, same, name());
  std::vector<torch::Tensor> whole, slices;
  for (const auto& p : recorded_parameters(model)) {
    const bool split = p.record && p.record->tp_distinct && p.record->tp_group && p.record->tp_group->size() > 1;
    (split ? slices : whole).push_back(p.tensor);
  }
  for (const auto& b : model.buffers()) whole.push_back(b);
  detail::broadcast_from_first(whole, same);
  if (!slices.empty()) {  // alike on every rank: the same model
    const auto same_tp_rank = same.split(context_->tp_rank(), context_->rank(), "hybrid.tp_rank");
    detail::broadcast_from_first(slices, *same_tp_rank);
  }
  apply_tensor_parallel(model, options_.policy, context_->tp(), context_.get());
  bool split = false;
  for (const auto& p : recorded_parameters(model)) {
    // (A layer made to split over one rank is whole, whichever mesh's group it names.)
    if (!p.record || !p.record->tp_distinct || !p.record->tp_group || p.record->tp_group->size() == 1) continue;
    split = true;
    ZTRAIN_CHECK(p.record->tp_group == &context_->tp(), "HybridParallel: parameter '", p.name, "' is split over ",
                 p.record->tp_group ? p.record->tp_group->size() : 1, " tensor-parallel ranks, not over the plugin's ",
                 options_.tp_size, "; build layers that split at construction under init_distributed({.tp_size = ",
                 options_.tp_size, "})");
  }
  ZTRAIN_CHECK(options_.tp_size == 1 || split, "HybridParallel: tp_size ", options_.tp_size,
               ", but neither the policy ('", options_.policy.name,
               "') nor the model's own layers split a parameter over the tensor-parallel group");
}

void HybridParallel::boost_data_parallel(torch::nn::Module& model, torch::optim::Optimizer& optimizer) {
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

void HybridParallel::build_pipeline(torch::nn::Module& model, torch::optim::Optimizer& optimizer) {
  const int stage = context_->pp_rank(), virtual_stages = options_.pp_size * options_.chunks;
  auto& boosted = inner_->boosted(model);
  std::vector<std::shared_ptr<pipe::StageImpl>> chunks;
  for (int c = 0; c < options_.chunks; ++c) {
    const int v = pipe::virtual_stage(stage, c, options_.pp_size);
    chunks.push_back(std::make_shared<PolicyStage>(detail::shared_module(model), detail::shared_module(boosted),
                                                   options_.policy.pipeline, held_[c], v == 0, v == virtual_stages - 1));
  }
  pipeline_ = std::make_unique<pipe::Pipeline>(
      std::move(chunks),
      pipe::PipelineOptions{.schedule = options_.schedule,
                            .broadcast_loss = true,
                            .context = context_,
                            // Gradients accumulate unreduced until each model chunk's last
                            // backward (with several chunks, the ends' buckets are reduced in
                            // each chunk's, the sums adding up to the step's).
                            .before_backward = [this](bool last) { inner_->set_gradient_sync(sync_ && last); }});
  // Each tied module: what the optimizer updates for it (the parameters at level 0, the shards
  // of their own flat groups above), the k-th tensor of the first stage tied to the k-th of the
  // last.
  const auto& tied = options_.policy.pipeline.tied;
  for (size_t t = 0; t < tied.size(); ++t) {
    std::vector<torch::Tensor> local;
    for (auto g : tied_groups_[t]) {
      for (const auto& p : optimizer.param_groups().at(g).params()) local.push_back(p);
    }
    std::vector<int64_t> sizes;
    for (const auto& p : local) sizes.push_back(p.numel());
    const auto all = context_->pp().all_gather_bytes(
        std::string_view(reinterpret_cast<const char*>(sizes.data()), sizes.size() * sizeof(int64_t)));
    ZTRAIN_CHECK(all.back() == all.front(), "HybridParallel: the tied module '", tied[t], "' is laid out in ",
                 all.front().size() / sizeof(int64_t), " tensors on the first stage and ",
                 all.back().size() / sizeof(int64_t), " on the last, or with other sizes; the two must hold the same "
                 "module");
    for (size_t k = 0; k < all.front().size() / sizeof(int64_t); ++k) {
      pipeline_->tie(c10::str(tied[t], "#", k), local.empty() ? std::vector<torch::Tensor>{}
                                                               : std::vector<torch::Tensor>{local[k]});
    }
  }
}

void HybridParallel::hold_stage(torch::nn::Module& model, torch::optim::Optimizer& optimizer) {
  const auto& policy = options_.policy.pipeline;
  auto* list = dynamic_cast<LayerListBase*>(find_module(model, policy.layers).get());
  ZTRAIN_CHECK(list, "HybridParallel: policy '", options_.policy.name, "' names the layer list '", policy.layers,
               "', which is not a ztrain::LayerList of the model");
  const auto ranges = stage_layers(list->size());
  held_.assign(ranges.begin(), ranges.end());
  list->hold(ranges);
  const int stage = context_->pp_rank();
  const bool first = stage == 0, last = stage == options_.pp_size - 1;
  auto check_end = [&](const std::string& path) {
    ZTRAIN_CHECK(!path.empty() && find_module(model, path), "HybridParallel: policy '", options_.policy.name,
                 "' names the stage end '", path, "', which is not a submodule of the model");
  };
  // The ends this stage does not hold: let go of in the model, their tensors freed.
  std::vector<std::string> dropped;
  if (!first) dropped = policy.first_stage;
  if (!last) dropped.insert(dropped.end(), policy.last_stage.begin(), policy.last_stage.end());
  if (!first && !last) dropped.insert(dropped.end(), policy.tied.begin(), policy.tied.end());
  for (const auto& path : dropped) {
    check_end(path);
    const auto module = replace(model, path, std::make_shared<torch::nn::Module>("DroppedModule"));
    torch::NoGradGuard no_grad;
    for (auto& p : module->parameters()) p.set_data(torch::empty({0}, p.options()));
  }
  // The tied ends it holds: under a TiedModule each, in optimizer groups of their own.
  tied_groups_.assign(policy.tied.size(), {});
  for (size_t t = 0; t < policy.tied.size() && (first || last); ++t) {
    const auto& path = policy.tied[t];
    check_end(path);
    auto module = find_module(model, path);
    ZTRAIN_CHECK(module->buffers().empty() &&
                     module->parameters(/*recurse=*/true).size() == module->parameters(/*recurse=*/false).size(),
                 "HybridParallel: policy '", options_.policy.name, "' ties module '", path,
                 "', which holds buffers or submodules with parameters; tie modules that own their parameters "
                 "directly (an embedding, a linear)");
    replace(model, path, std::make_shared<TiedModule>(*module));
    tied_groups_[t] = isolate(optimizer, module->parameters(/*recurse=*/false));
  }
  // The optimizer updates what the stage holds.
  std::unordered_set<const c10::TensorImpl*> held;
  for (const auto& p : model.parameters()) held.insert(p.unsafeGetTensorImpl());
  for (auto& group : optimizer.param_groups()) {
    auto& params = group.params();
    params.erase(std::remove_if(params.begin(), params.end(),
                                [&](const torch::Tensor& p) { return !held.count(p.unsafeGetTensorImpl()); }),
                 params.end());
  }
}

torch::Tensor HybridParallel::execute_pipeline(const std::vector<std::vector<torch::Tensor>>& micro_batches,
                                               double loss_scale) {
  ZTRAIN_CHECK(inner_, "HybridParallel: boost() first");
  ZTRAIN_CHECK(pipeline_, "HybridParallel: execute_pipeline needs pp_size > 1; with one stage compute the loss "
               "with the model and call Booster::backward");
  // The schedule turns the dp reduction off for all but each stage's last backward; whatever
  // happens in it, the plugin underneath is left as no_sync() had it.
  struct RestoreSync {
    Plugin& inner;
    bool on;
    ~RestoreSync() { inner.set_gradient_sync(on); }
  } restore{*inner_, sync_};
  check_micro_batches(micro_batches);
  auto loss = pipeline_->forward_backward_step(micro_batches, loss_scale);
  return sum_loss(loss, context_.get());
}

torch::Tensor HybridParallel::evaluate_pipeline(const std::vector<std::vector<torch::Tensor>>& micro_batches) {
  ZTRAIN_CHECK(inner_, "HybridParallel: boost() first");
  ZTRAIN_CHECK(pipeline_, "HybridParallel: evaluate_pipeline needs pp_size > 1; with one stage compute the loss "
               "with the model");
  check_micro_batches(micro_batches);
  return sum_loss(pipeline_->evaluate(micro_batches), context_.get());
}

void HybridParallel::check_micro_batches(const std::vector<std::vector<torch::Tensor>>& micro_batches) {
  const auto& check = options_.policy.pipeline.check;
  if (!check) return;
  for (const auto& mb : micro_batches) check(*model_, mb);
}

torch::nn::Module& HybridParallel::boosted(torch::nn::Module& model) { return data_parallel().boosted(model); }

void HybridParallel::set_gradient_sync(bool on) {
  data_parallel().set_gradient_sync(on);
  sync_ = on;
}

void HybridParallel::after_zero_grad() {
  if (inner_) inner_->after_zero_grad();
}

void HybridParallel::after_update() {
  if (inner_) inner_->after_update();
}

ParallelContext& HybridParallel::context() {
  ZTRAIN_CHECK(context_, "HybridParallel: build() or boost() first");
  return *context_;
}

Plugin& HybridParallel::data_parallel() {
  ZTRAIN_CHECK(inner_, "HybridParallel: boost() first");
  return *inner_;
}

}  // namespace ztrain
