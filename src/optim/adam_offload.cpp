#include <ztrain/optim/adam_offload.h>

#include <ztrain/error.h>

#include <unordered_map>

namespace ztrain::optim {

namespace {
std::vector<torch::Tensor> tensors_of(const std::vector<RecordedParameter>& params) {
  std::vector<torch::Tensor> out;
  for (const auto& p : params) out.push_back(p.tensor);
  return out;
}
}  // namespace

AdamOffload::AdamOffload(torch::nn::Module& model, AdamOptions defaults, AdamEngineOptions engine)
    : AdamOffload(model, {torch::optim::OptimizerParamGroup(tensors_of(recorded_parameters(model)))},
                  std::move(defaults), engine) {}

AdamOffload::AdamOffload(torch::nn::Module& model, std::vector<torch::optim::OptimizerParamGroup> groups,
                         AdamOptions defaults, AdamEngineOptions engine)
    : AdamW(std::move(groups), std::move(defaults), engine) {
  // The fences of the model's parameters, found for the groups' tensors.
  std::unordered_map<const c10::TensorImpl*, std::shared_ptr<UpdateFence>> fences;
  for (const auto& p : recorded_parameters(model)) {
    fences.emplace(p.tensor.unsafeGetTensorImpl(), p.record ? p.record->update : nullptr);
  }
  for (const auto& group : param_groups_) {
    auto& fenced = fenced_.emplace_back();
    for (const auto& p : group.params()) {
      const auto it = fences.find(p.unsafeGetTensorImpl());
      ZTRAIN_CHECK(it != fences.end(), "AdamOffload: a tensor of shape ", p.sizes(),
                   " in the parameter groups is not a parameter of the model");
      fenced.emplace_back(p, it->second);
    }
  }
  start();
}

AdamOffload::~AdamOffload() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  wake_.notify_all();
  if (worker_.joinable()) worker_.join();  // runs what was queued first
}

void AdamOffload::start() { worker_ = std::thread([this] { run(); }); }

void AdamOffload::run() {
  torch::NoGradGuard no_grad;  // grad mode is per thread: the update writes leaves that require grad
  for (;;) {
    std::function<void()> job;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      wake_.wait(lock, [&] { return stop_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stopping, nothing left
      job = std::move(queue_.front());
      queue_.pop_front();
    }
    job();
  }
}

bool AdamOffload::busy() const {
  std::lock_guard<std::mutex> lock(mutex_);
  for (const auto& f : in_flight_) {
    if (f.wait_for(std::chrono::seconds(0)) != std::future_status::ready) return true;
  }
  return false;
}

void AdamOffload::wait() {
  std::vector<std::shared_future<void>> all;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    all.swap(in_flight_);
  }
  std::exception_ptr first;
  for (auto& f : all) {
    try {
      f.get();
    } catch (...) {
      if (!first) first = std::current_exception();
    }
  }
  if (first) std::rethrow_exception(first);
}

torch::Tensor AdamOffload::step(LossClosure closure) {
  wait();
  torch::Tensor loss;
  if (closure) {
    at::AutoGradMode enable_grad(true);
    loss = closure();
  }
  torch::NoGradGuard no_grad;
  check_step();

  struct Deferred {
    torch::Tensor param, grad;
    const AdamOptions* options;
    std::shared_ptr<UpdateFence> fence;
  };
  std::vector<Deferred> deferred;
  for (size_t g = 0; g < param_groups_.size(); ++g) {
    const auto& options = static_cast<const AdamOptions&>(param_groups_[g].options());
    auto& params = param_groups_[g].params();
    for (size_t i = 0; i < params.size(); ++i) {
      auto& p = params[i];
      if (!p.grad().defined()) continue;
      auto grad = p.grad();
      p.mutable_grad().reset();  // the step takes the gradient
      const bool same = g < fenced_.size() && i < fenced_[g].size() && fenced_[g][i].first.is_same(p);
      auto fence = same ? fenced_[g][i].second : nullptr;
      if (fence) {
        state_for(p);  // created here, so the update thread never inserts into the state map
        deferred.push_back({p, grad, &options, std::move(fence)});
      } else {
        read_ahead(p);
        update(p, grad, options);
        write_behind(p);
      }
    }
  }
  if (!deferred.empty()) read_ahead(deferred.front().param);
  std::lock_guard<std::mutex> lock(mutex_);
  for (size_t k = 0; k < deferred.size(); ++k) {
    const auto& d = deferred[k];
    const torch::Tensor next = k + 1 < deferred.size() ? deferred[k + 1].param : torch::Tensor();
    auto promise = std::make_shared<std::promise<void>>();
    std::shared_future<void> done = promise->get_future().share();
    d.fence->set(done);
    in_flight_.push_back(done);
    // Options are copied: a scheduler may change the group's lr before the update runs.
    queue_.push_back([this, d, next, options = *d.options, promise] {
      try {
        if (next.defined()) read_ahead(next);  // its state read in while this one updates
        update(d.param, d.grad, options);
        write_behind(d.param);
        promise->set_value();
      } catch (...) {
        promise->set_exception(std::current_exception());
      }
    });
  }
  wake_.notify_one();
  return loss;
}

}  // namespace ztrain::optim
