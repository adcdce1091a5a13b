#include <ztrain/optim/optim_manager.h>

#include <ztrain/error.h>
#include <ztrain/runtime/parameter_record.h>

#include <cmath>
#include <optional>
#include <unordered_map>

namespace ztrain::optim {

OptimManager::OptimManager(torch::nn::Module& model, LossScaler scaler, ParallelContext* context)
    : model_(model), context_(context ? context : context_of(model)), scaler_(std::move(scaler)) {}

void OptimManager::add_optimizer(torch::optim::Optimizer& optimizer, std::shared_ptr<LRScheduler> scheduler) {
  for (auto* o : optimizers_) ZTRAIN_CHECK(o != &optimizer, "OptimManager: this optimizer was added already");
  optimizers_.push_back(&optimizer);
  schedulers_.push_back(std::move(scheduler));
  if (schedulers_.back()) schedulers_.back()->apply(optimizer);
}

std::vector<torch::Tensor> OptimManager::gradients() const {
  std::vector<torch::Tensor> out;
  for (auto* o : optimizers_) {
    for (const auto& group : o->param_groups()) {
      for (const auto& p : group.params()) {
        if (p.grad().defined()) out.push_back(p.grad());
      }
    }
  }
  return out;
}

void OptimManager::zero_grad() {
  for (auto* o : optimizers_) {
    for (auto& group : o->param_groups()) {
      for (auto& p : group.params()) p.mutable_grad().reset();
    }
  }
  unscaled_ = false;
}

void OptimManager::backward(const torch::Tensor& loss) {
  ZTRAIN_CHECK(loss.numel() == 1, "OptimManager::backward: the loss must have one element, got ", loss.sizes());
  const double scale = scaler_.scale();
  (scale == 1.0 ? loss : loss * scale).backward();  // returns once gradient reductions have landed
  unscaled_ = false;
}

void OptimManager::unscale() {
  if (unscaled_) return;
  unscaled_ = true;
  const double scale = scaler_.scale();
  if (scale == 1.0) return;
  torch::NoGradGuard no_grad;
  for (auto& g : gradients()) g.mul_(1.0 / scale);
}

double OptimManager::grad_norm() {
  unscale();
  // Each element once: a dp-sharded gradient is distinct on every dp rank, a tensor-parallel
  // one on every rank of its tp group; a replicated one is the same on all ranks of its group,
  // so each copy contributes 1/size of its square sum. Likewise for a parameter tied across
  // pipeline stages. The world sum covers every pipeline stage.
  const int dp = context_ ? context_->dp().size() : 1;
  const int tp = context_ ? context_->tp().size() : 1;
  // The model's records, found for the optimizers' tensors in the optimizers' order (the order
  // of the sum); a tensor the model does not record is a plain, replicated parameter.
  std::unordered_map<const c10::TensorImpl*, const ParameterRecord*> records;
  for (const auto& p : recorded_parameters(model_)) records.emplace(p.tensor.unsafeGetTensorImpl(), p.record);
  // Summed in fp64 on each gradient's device, in order, and read once (not once per tensor: on a
  // GPU each read waits for the device).
  std::optional<torch::Tensor> local;
  for (auto* o : optimizers_) {
    for (const auto& group : o->param_groups()) {
      for (const auto& p : group.params()) {
        if (!p.grad().defined()) continue;
        const auto it = records.find(p.unsafeGetTensorImpl());
        const ParameterRecord* r = it == records.end() ? nullptr : it->second;
        auto sq = p.grad().to(torch::kFloat64).pow(2).sum();
        if (!(r && r->dp_sharded)) sq = sq / dp;
        if (!(r && r->tp_distinct)) sq = sq / tp;
        if (r) sq = sq / r->tied_copies;
        local = local ? *local + sq.to(local->device()) : sq;
      }
    }
  }
  auto total = local ? local->reshape({1}).to(torch::kCPU) : torch::zeros({1}, torch::kFloat64);
  if (context_) context_->world().all_reduce(total);
  return std::sqrt(total.item<double>());
}

double OptimManager::clip_grad_norm(double max_norm) {
  ZTRAIN_CHECK(max_norm > 0, "clip_grad_norm: max_norm must be > 0, got ", max_norm);
  const double norm = grad_norm();
  if (std::isfinite(norm) && norm > max_norm) {
    torch::NoGradGuard no_grad;
    const double coef = max_norm / (norm + 1e-6);
    for (auto& g : gradients()) g.mul_(coef);
  }
  return norm;
}

bool OptimManager::step() {
  unscale();
  std::optional<torch::Tensor> finite;  // read once, as above
  for (const auto& g : gradients()) {
    const auto f = torch::isfinite(g).all();
    finite = finite ? finite->logical_and(f.to(finite->device())) : f;
  }
  const bool overflow = finite && !finite->item<bool>();
  auto flag = torch::tensor({overflow ? 1 : 0}, torch::kInt32);
  if (context_) context_->world().all_reduce(flag, ReduceOp::kMax);
  const bool apply = scaler_.update(flag.item<int>() != 0);
  if (apply) {
    for (size_t i = 0; i < optimizers_.size(); ++i) {
      if (schedulers_[i]) schedulers_[i]->apply(*optimizers_[i]);
      optimizers_[i]->step();
      if (schedulers_[i]) {
        schedulers_[i]->step();
        schedulers_[i]->apply(*optimizers_[i]);
      }
    }
    ++steps_;
  } else {
    ++skipped_;
  }
  zero_grad();
  return apply;
}

double OptimManager::current_lr() const {
  if (!schedulers_.empty() && schedulers_[0]) return schedulers_[0]->current_lr();
  ZTRAIN_CHECK(!optimizers_.empty() && !optimizers_[0]->param_groups().empty(), "OptimManager: no optimizer");
  return optimizers_[0]->param_groups()[0].options().get_lr();
}

OptimManagerState OptimManager::state() const {
  OptimManagerState s{.scaler = scaler_.state(), .steps = steps_, .skipped = skipped_};
  for (const auto& sch : schedulers_) s.schedulers.push_back(sch ? std::optional(sch->state()) : std::nullopt);
  return s;
}

void OptimManager::load_state(const OptimManagerState& s) {
  ZTRAIN_CHECK(s.schedulers.size() == schedulers_.size(), "OptimManager::load_state: the state has ",
               s.schedulers.size(), " optimizers, this manager ", schedulers_.size());
  for (size_t i = 0; i < schedulers_.size(); ++i) {
    ZTRAIN_CHECK(s.schedulers[i].has_value() == (schedulers_[i] != nullptr), "OptimManager::load_state: optimizer ",
                 i, (schedulers_[i] ? " has" : " has no"), " schedule here but the state says otherwise");
    if (schedulers_[i]) {
      schedulers_[i]->load_state(*s.schedulers[i]);
      schedulers_[i]->apply(*optimizers_[i]);
    }
  }
  scaler_.load_state(s.scaler);
  steps_ = s.steps;
  skipped_ = s.skipped;
}

}  // namespace ztrain::optim
