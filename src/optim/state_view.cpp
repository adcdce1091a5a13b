#include <ztrain/optim/state_view.h>

#include <ztrain/error.h>
#include <ztrain/optim/adam.h>
#include <ztrain/torch_compat.h>

namespace ztrain::optim {

namespace {

constexpr const char* kSupported =
    "ztrain AdamW/Adam and torch::optim Adam, AdamW, SGD, RMSprop and Adagrad are supported";

const torch::optim::OptimizerParamState* torch_state(const torch::optim::Optimizer& opt, const torch::Tensor& p) {
  auto it = opt.state().find(ztrain::detail::optimizer_state_key(p));
  return it == opt.state().end() ? nullptr : it->second.get();
}

}  // namespace

ParameterState state_of(torch::optim::Optimizer& optimizer, const torch::Tensor& param) {
  ParameterState s;
  auto put = [&](const char* name, const torch::Tensor& t) {
    if (t.defined()) s.tensors[name] = t;
  };
  if (auto* ours = dynamic_cast<AdamW*>(&optimizer)) {
    if (const auto* a = ours->state_of(param)) {
      put("exp_avg", a->exp_avg);
      put("exp_avg_sq", a->exp_avg_sq);
      put("master", a->master);
      s.step = a->step;
    }
    return s;
  }
  const bool known = dynamic_cast<torch::optim::Adam*>(&optimizer) || dynamic_cast<torch::optim::AdamW*>(&optimizer) ||
                     dynamic_cast<torch::optim::SGD*>(&optimizer) || dynamic_cast<torch::optim::RMSprop*>(&optimizer) ||
                     dynamic_cast<torch::optim::Adagrad*>(&optimizer);
  ZTRAIN_CHECK(known, "optimizer state: this optimizer is not supported (", kSupported, ")");
  const auto* base = torch_state(optimizer, param);
  if (!base) return s;
  if (auto* a = dynamic_cast<const torch::optim::AdamParamState*>(base)) {
    put("exp_avg", a->exp_avg());
    put("exp_avg_sq", a->exp_avg_sq());
    put("max_exp_avg_sq", a->max_exp_avg_sq());
    s.step = a->step();
  } else if (auto* w = dynamic_cast<const torch::optim::AdamWParamState*>(base)) {
    put("exp_avg", w->exp_avg());
    put("exp_avg_sq", w->exp_avg_sq());
    put("max_exp_avg_sq", w->max_exp_avg_sq());
    s.step = w->step();
  } else if (auto* g = dynamic_cast<const torch::optim::SGDParamState*>(base)) {
    put("momentum_buffer", g->momentum_buffer());
  } else if (auto* r = dynamic_cast<const torch::optim::RMSpropParamState*>(base)) {
    put("square_avg", r->square_avg());
    put("momentum_buffer", r->momentum_buffer());
    put("grad_avg", r->grad_avg());
    s.step = r->step();
  } else if (auto* d = dynamic_cast<const torch::optim::AdagradParamState*>(base)) {
    put("sum", d->sum());
    s.step = d->step();
  }
  return s;
}

void set_state(torch::optim::Optimizer& optimizer, const torch::Tensor& param, ParameterState s) {
  auto* ours = dynamic_cast<AdamW*>(&optimizer);
  // Where the optimizer keeps the state: beside the parameter, or in host memory (AdamOffload).
  const auto device = ours ? ours->state_device(param) : param.device();
  auto get = [&](const char* name) { return s.tensors.count(name) ? s.tensors.at(name).to(device) : torch::Tensor(); };
  const int64_t step = s.step.value_or(0);
  if (ours) {
    // A float32 parameter's master is the parameter itself, kept only where the state is away
    // from the parameter: state saved with AdamW loads into AdamOffload and back.
    auto master = get("master");
    if (param.scalar_type() == torch::kFloat32) {
      master = device != param.device() ? param.detach().to(device, torch::kFloat32, false, true) : torch::Tensor();
    }
    ours->set_state(param, {.step = step, .exp_avg = get("exp_avg"), .exp_avg_sq = get("exp_avg_sq"),
                            .master = master});
    return;
  }
  std::unique_ptr<torch::optim::OptimizerParamState> state;
  if (dynamic_cast<torch::optim::Adam*>(&optimizer)) {
    auto st = std::make_unique<torch::optim::AdamParamState>();
    st->step(step).exp_avg(get("exp_avg")).exp_avg_sq(get("exp_avg_sq")).max_exp_avg_sq(get("max_exp_avg_sq"));
    state = std::move(st);
  } else if (dynamic_cast<torch::optim::AdamW*>(&optimizer)) {
    auto st = std::make_unique<torch::optim::AdamWParamState>();
    st->step(step).exp_avg(get("exp_avg")).exp_avg_sq(get("exp_avg_sq")).max_exp_avg_sq(get("max_exp_avg_sq"));
    state = std::move(st);
  } else if (dynamic_cast<torch::optim::SGD*>(&optimizer)) {
    auto st = std::make_unique<torch::optim::SGDParamState>();
    st->momentum_buffer(get("momentum_buffer"));
    state = std::move(st);
  } else if (dynamic_cast<torch::optim::RMSprop*>(&optimizer)) {
    auto st = std::make_unique<torch::optim::RMSpropParamState>();
    st->step(step).square_avg(get("square_avg")).momentum_buffer(get("momentum_buffer")).grad_avg(get("grad_avg"));
    state = std::move(st);
  } else if (dynamic_cast<torch::optim::Adagrad*>(&optimizer)) {
    auto st = std::make_unique<torch::optim::AdagradParamState>();
    st->step(step).sum(get("sum"));
    state = std::move(st);
  } else {
    ZTRAIN_CHECK(false, "optimizer state: this optimizer is not supported (", kSupported, ")");
  }
  optimizer.state()[ztrain::detail::optimizer_state_key(param)] = std::move(state);
}

int64_t state_bytes(torch::optim::Optimizer& optimizer) {
  int64_t bytes = 0;
  for (const auto& group : optimizer.param_groups()) {
    for (const auto& p : group.params()) {
      for (const auto& [name, t] : state_of(optimizer, p).tensors) bytes += static_cast<int64_t>(t.nbytes());
    }
  }
  return bytes;
}

}  // namespace ztrain::optim
