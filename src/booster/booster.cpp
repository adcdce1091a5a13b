#include <ztrain/booster/booster.h>

#include <ztrain/ckpt/optimizer_state.h>
#include <ztrain/error.h>

#include <limits>

namespace ztrain {

Booster::Booster(std::shared_ptr<Plugin> plugin, BoosterOptions options)
    : plugin_(std::move(plugin)), options_(std::move(options)),
      last_grad_norm_(std::numeric_limits<double>::quiet_NaN()) {
  ZTRAIN_CHECK(plugin_ != nullptr, "Booster: the plugin is null");
  ZTRAIN_CHECK(options_.max_grad_norm >= 0, "Booster: max_grad_norm must be >= 0 (0: no clipping), got ",
               options_.max_grad_norm);
}

void Booster::boost(torch::nn::Module& model, torch::optim::Optimizer& optimizer) {
  ZTRAIN_CHECK(!model_, "Booster: boost() was called already; a booster boosts one model and optimizer");
  plugin_->boost(model, optimizer);
  model_ = &plugin_->boosted(model);
  optimizer_ = &optimizer;
  manager_.emplace(*model_, options_.loss_scaler, plugin_->mesh());
  manager_->add_optimizer(optimizer, options_.lr_scheduler);
}

torch::nn::Module& Booster::model() {
  ZTRAIN_CHECK(model_, "Booster: call boost(model, optimizer) first");
  return *model_;
}

torch::optim::Optimizer& Booster::optimizer() {
  ZTRAIN_CHECK(optimizer_, "Booster: call boost(model, optimizer) first");
  return *optimizer_;
}

optim::OptimManager& Booster::manager() {
  ZTRAIN_CHECK(manager_, "Booster: call boost(model, optimizer) first");
  return *manager_;
}

void Booster::zero_grad() {
  manager().zero_grad();
  plugin_->after_zero_grad();
}

void Booster::backward(const torch::Tensor& loss) { manager().backward(loss); }

torch::Tensor Booster::execute_pipeline(const std::vector<std::vector<torch::Tensor>>& micro_batches) {
  return plugin_->execute_pipeline(micro_batches, manager().loss_scale());
}

torch::Tensor Booster::evaluate_pipeline(const std::vector<std::vector<torch::Tensor>>& micro_batches) {
  return plugin_->evaluate_pipeline(micro_batches);
}

torch::Tensor Plugin::execute_pipeline(const std::vector<std::vector<torch::Tensor>>& /*micro_batches*/,
                                       double /*loss_scale*/) {
  ZTRAIN_CHECK(false, name(), " runs no pipeline stages; compute the loss with the model and call "
               "Booster::backward (HybridParallel with pp_size > 1 runs pipelines)");
  return {};
}

torch::Tensor Plugin::evaluate_pipeline(const std::vector<std::vector<torch::Tensor>>& /*micro_batches*/) {
  ZTRAIN_CHECK(false, name(), " runs no pipeline stages; compute the loss with the model (HybridParallel with "
               "pp_size > 1 runs pipelines)");
  return {};
}

bool Booster::step() {
  auto& mgr = manager();
  if (options_.max_grad_norm > 0) last_grad_norm_ = mgr.clip_grad_norm(options_.max_grad_norm);
  const bool applied = mgr.step();
  if (applied) plugin_->after_update();
  return applied;
}

Booster::NoSync Booster::no_sync() {
  model();
  return NoSync(*plugin_);
}

void Booster::save_model(const std::string& path, const SaveOptions& options) { save(model(), path, on_mesh(options)); }

void Booster::load_model(const std::string& path, const LoadOptions& options) {
  load(model(), path, on_mesh(options));
  plugin_->after_update();
}

void Booster::save_optimizer(const std::string& path, const SaveOptions& options) {
  save_optimizer_state(model(), optimizer(), path, on_mesh(options));
}

void Booster::load_optimizer(const std::string& path) { load_optimizer_state(model(), optimizer(), path); }

}  // namespace ztrain
