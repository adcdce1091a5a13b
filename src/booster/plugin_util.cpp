#include "plugin_util.h"

#include <ztrain/error.h>
#include <ztrain/runtime/init.h>

#include <map>
#include <sstream>
#include <unordered_set>

namespace ztrain::detail {

ParallelContext& plugin_context(const std::shared_ptr<ParallelContext>& context) {
  return context ? *context : default_context();
}

void check_optimizer_over(torch::nn::Module& model, const torch::optim::Optimizer& optimizer, const std::string& who) {
  // The plugin's reductions cover the model's parameters only.
  std::unordered_set<const void*> owned;
  for (const auto& p : model.parameters()) owned.insert(p.unsafeGetTensorImpl());
  for (const auto& group : optimizer.param_groups()) {
    for (const auto& p : group.params()) {
      ZTRAIN_CHECK(owned.count(p.unsafeGetTensorImpl()), who, ": the optimizer updates a tensor of shape ", p.sizes(),
                   " that is not a parameter of the model; build the optimizer over model->parameters()");
    }
  }
}

void check_no_state(const torch::optim::Optimizer& optimizer, const std::string& who) {
  ZTRAIN_CHECK(optimizer.state().empty(), who, ": the optimizer holds state already; it is kept per shard, "
               "so boost() before the first step");
}

std::shared_ptr<torch::nn::Module> shared_module(torch::nn::Module& module) {
  try {
    return module.shared_from_this();
  } catch (const std::bad_weak_ptr&) {
    return {std::shared_ptr<torch::nn::Module>(), &module};
  }
}

void move_to_device(torch::nn::Module& model, const torch::optim::Optimizer& optimizer, c10::Device device,
                    const std::string& who) {
  bool elsewhere = false;
  for (const auto& p : model.parameters()) elsewhere = elsewhere || p.device() != device;
  for (const auto& b : model.buffers()) elsewhere = elsewhere || b.device() != device;
  if (!elsewhere) return;
  ZTRAIN_CHECK(optimizer.state().empty(), who, ": the model is not on the context's device ", device,
               " and its optimizer holds state already; boost() before the first step, or move both there first");
  model.to(device);
}

std::vector<std::pair<std::string, torch::Tensor>> check_same_model(torch::nn::Module& model, Communicator& dp,
                                                                    const std::string& who) {
  std::ostringstream signature;
  std::vector<std::pair<std::string, torch::Tensor>> params;
  std::unordered_set<const void*> seen;
  for (const auto& item : model.named_parameters()) {
    const auto& p = item.value();
    if (!seen.insert(p.unsafeGetTensorImpl()).second) continue;  // one tensor under two names
    signature << item.key() << ' ' << p.scalar_type() << ' ' << p.sizes() << (p.requires_grad() ? "" : " frozen")
              << '\n';
    params.emplace_back(item.key(), p);
  }
  for (const auto& item : model.named_buffers()) {
    signature << "buffer " << item.key() << ' ' << item.value().scalar_type() << ' ' << item.value().sizes() << '\n';
  }
  const auto all = dp.all_gather_bytes(signature.str());
  for (size_t r = 1; r < all.size(); ++r) {
    ZTRAIN_CHECK(all[r] == all[0], who, ": dp ranks 0 and ", r,
                 " hold different models (parameter or buffer names, dtypes or shapes differ).\nrank 0:\n", all[0],
                 "rank ", r, ":\n", all[r]);
  }
  return params;
}

void broadcast_from_first(const std::vector<torch::Tensor>& tensors, Communicator& dp) {
  if (dp.size() == 1) return;
  torch::NoGradGuard no_grad;
  std::map<c10::ScalarType, std::vector<torch::Tensor>> by_dtype;
  for (const auto& t : tensors) by_dtype[t.scalar_type()].push_back(t);
  for (auto& [dtype, same] : by_dtype) {
    std::vector<torch::Tensor> parts;
    for (const auto& t : same) parts.push_back(t.reshape(-1));
    auto flat = torch::cat(parts);
    dp.broadcast(flat, 0);
    int64_t offset = 0;
    for (auto& t : same) {
      t.copy_(flat.narrow(0, offset, t.numel()).view(t.sizes()));
      offset += t.numel();
    }
  }
}

}  // namespace ztrain::detail
