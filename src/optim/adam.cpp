#include <ztrain/optim/adam.h>

#include <ztrain/error.h>
#include <ztrain/runtime/mapped_file.h>
#include <ztrain/torch_compat.h>

#include "adam_kernels.h"
#include "thread_pool.h"

#include <ATen/Parallel.h>
#include <torch/optim/serialize.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <unordered_set>

// How it works: step() first checks every group's options, every parameter and every gradient,
// so that a bad one throws before anything changed. Then, per parameter with a gradient, it
// creates the state on first use (zero moments, and for bf16/fp16 the fp32 master copied from the
// parameter), computes the step's scalars in double as PyTorch does, and runs the fused kernel
// (adam_kernels.cpp) over the parameter: inline when it is small, otherwise split into one
// contiguous part per thread, each a multiple of 64 elements (whole cache lines for fp32 and
// 16-bit data alike), the first on the calling thread. Elements are independent, so the split
// never changes a result. A parameter on a CUDA device (or any, with kTorchFused) is handed to
// libtorch's fused kernel instead, its state beside it on the device.
//
// State lives in torch::optim::Optimizer::state_, under the key libtorch uses (the parameter's
// TensorImpl address), so libtorch's save/load helpers work on it unchanged.

namespace ztrain::optim {

using detail::AdamScalars;
using detail::AdamSpan;
using detail::Decay;
using detail::WeightType;

// ---- options and state -----------------------------------------------------------------------

AdamOptions::AdamOptions(double lr) : lr_(lr) {}

AdamOptions AdamOptions::adam(double lr) { return AdamOptions(lr).weight_decay(0).decoupled_weight_decay(false); }

void AdamOptions::serialize(torch::serialize::OutputArchive& archive) const {
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(lr);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(betas);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(eps);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(weight_decay);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(decoupled_weight_decay);
}

void AdamOptions::serialize(torch::serialize::InputArchive& archive) {
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(double, lr);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(betas_t, betas);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(double, eps);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(double, weight_decay);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(bool, decoupled_weight_decay);
}

bool operator==(const AdamOptions& a, const AdamOptions& b) {
  return a.lr() == b.lr() && a.betas() == b.betas() && a.eps() == b.eps() && a.weight_decay() == b.weight_decay() &&
         a.decoupled_weight_decay() == b.decoupled_weight_decay();
}

namespace {

// How AdamParamState is stored in torch::optim::Optimizer::state_ (and serialized by libtorch's
// save/load helpers).
struct AdamStateEntry : public torch::optim::OptimizerCloneableParamState<AdamStateEntry> {
  AdamParamState state;

  AdamStateEntry() = default;
  explicit AdamStateEntry(AdamParamState s) : state(std::move(s)) {}

  void serialize(torch::serialize::OutputArchive& archive) const override {
    archive.write("step", c10::IValue(state.step));
    archive.write("exp_avg", state.exp_avg);
    archive.write("exp_avg_sq", state.exp_avg_sq);
    if (state.master.defined()) archive.write("master", state.master);
  }
  void serialize(torch::serialize::InputArchive& archive) override {
    c10::IValue step;
    archive.read("step", step);
    state.step = step.toInt();
    archive.read("exp_avg", state.exp_avg);
    archive.read("exp_avg_sq", state.exp_avg_sq);
    if (!archive.try_read("master", state.master)) state.master = torch::Tensor();
  }
};

}  // namespace

namespace {

std::string group_name(size_t index) { return c10::str("param group ", index); }

void validate(const AdamOptions& o, const std::string& where) {
  const auto [beta1, beta2] = o.betas();
  ZTRAIN_CHECK(std::isfinite(o.lr()) && o.lr() >= 0, where, ": lr must be finite and >= 0, got ", o.lr());
  ZTRAIN_CHECK(beta1 >= 0 && beta1 < 1, where, ": betas[0] must be in [0, 1), got ", beta1);
  ZTRAIN_CHECK(beta2 >= 0 && beta2 < 1, where, ": betas[1] must be in [0, 1), got ", beta2);
  ZTRAIN_CHECK(std::isfinite(o.eps()) && o.eps() >= 0, where, ": eps must be finite and >= 0, got ", o.eps());
  ZTRAIN_CHECK(std::isfinite(o.weight_decay()) && o.weight_decay() >= 0, where,
               ": weight_decay must be finite and >= 0, got ", o.weight_decay());
}

const AdamOptions& options_of(const torch::optim::OptimizerParamGroup& group, size_t index) {
  const auto* o = dynamic_cast<const AdamOptions*>(&group.options());
  ZTRAIN_CHECK(o != nullptr, group_name(index),
               " has options of another optimizer; give ztrain::optim::AdamW/Adam groups AdamOptions (or none, "
               "to use the defaults)");
  return *o;
}

std::optional<WeightType> weight_type(c10::ScalarType dtype) {
  switch (dtype) {
    case torch::kFloat32:
      return WeightType::kFloat;
    case torch::kBFloat16:
      return WeightType::kBFloat16;
    case torch::kFloat16:
      return WeightType::kHalf;
    default:
      return std::nullopt;
  }
}

void check_param(const torch::Tensor& p, const std::string& where) {
  ZTRAIN_CHECK(p.defined(), where, ": a parameter is an undefined tensor");
  ZTRAIN_CHECK(p.layout() == torch::kStrided && (p.is_cpu() || p.is_cuda()), where,
               ": parameters must be dense tensors on the CPU or a CUDA device, got layout ", p.layout(), " on ",
               p.device());
  ZTRAIN_CHECK(weight_type(p.scalar_type()).has_value(), where, ": parameters must be float32, bfloat16 or float16, got ",
               p.scalar_type(), " (shape ", p.sizes(), ")");
  ZTRAIN_CHECK(p.is_contiguous(), where, ": parameters must be contiguous (the fused update runs over flat memory); "
               "got one of shape ", p.sizes(), " and strides ", p.strides(), ". Pass a contiguous tensor such as a "
               "flat shard");
}

void check_grad(const torch::Tensor& p, const torch::Tensor& g, const std::string& where) {
  ZTRAIN_CHECK(g.layout() == torch::kStrided, where,
               ": gradients must be dense tensors (sparse gradients are not supported), got layout ", g.layout());
  ZTRAIN_CHECK(g.device() == p.device(), where, ": a parameter on ", p.device(), " has its gradient on ", g.device(),
               "; they must be on the same device");
  ZTRAIN_CHECK(g.scalar_type() == p.scalar_type(), where, ": a ", p.scalar_type(), " parameter has a ",
               g.scalar_type(), " gradient; they must have the same dtype");
  ZTRAIN_CHECK(g.sizes() == p.sizes(), where, ": a parameter of shape ", p.sizes(), " has a gradient of shape ",
               g.sizes());
}

void check_state_tensor(const torch::Tensor& t, const torch::Tensor& p, c10::Device device, const char* name,
                        const std::string& where) {
  ZTRAIN_CHECK(t.defined(), where, ": state ", name, " is undefined");
  ZTRAIN_CHECK(t.scalar_type() == torch::kFloat32 && t.layout() == torch::kStrided && t.device() == device &&
                   t.is_contiguous() && t.sizes() == p.sizes(),
               where, ": state ", name, " must be a contiguous float32 tensor of the parameter's shape ", p.sizes(),
               " on ", device, ", got ", t.scalar_type(), " of shape ", t.sizes(), " on ", t.device(),
               (t.is_contiguous() ? "" : ", non-contiguous"));
}

/// Whether the state of `p`, kept on `device`, holds an fp32 master copy: for a 16-bit
/// parameter, and for any parameter whose state is kept away from it (offloaded).
bool needs_master(const torch::Tensor& p, c10::Device device) {
  return p.scalar_type() != torch::kFloat32 || p.device() != device;
}

void check_state(const AdamParamState& s, const torch::Tensor& p, c10::Device device, const std::string& where) {
  ZTRAIN_CHECK(s.step >= 0, where, ": state step must be >= 0, got ", s.step);
  check_state_tensor(s.exp_avg, p, device, "exp_avg", where);
  check_state_tensor(s.exp_avg_sq, p, device, "exp_avg_sq", where);
  if (!needs_master(p, device)) {
    ZTRAIN_CHECK(!s.master.defined(), where, ": a float32 parameter has no master copy, but the state holds one");
  } else {
    ZTRAIN_CHECK(s.master.defined(), where, ": a ", p.scalar_type(), " parameter on ", p.device(),
                 " needs an fp32 master copy on ", device, " in its state");
    check_state_tensor(s.master, p, device, "master", where);
  }
}

void bump_version(const torch::Tensor& t) {
  if (t.defined() && !t.is_inference()) t.unsafeGetTensorImpl()->bump_version();
}

/// One step of `param` by libtorch's fused kernel, on any device it has one for: fp32 weights
/// (the master for bf16/fp16 parameters) updated in place, the parameter rounded from the master.
void torch_fused_update(const torch::Tensor& param, const torch::Tensor& gradient, AdamParamState& s,
                        const AdamOptions& o, Decay decay) {
  const auto weight = s.master.defined() ? s.master : param;
  const auto grad = gradient.to(torch::kFloat32).contiguous();
  const auto step = torch::full({}, static_cast<double>(s.step), weight.options());
  const auto [beta1, beta2] = o.betas();
  const double wd = decay == Decay::kNone ? 0.0 : o.weight_decay();
  if (decay == Decay::kCoupled) {
    at::_fused_adam_({weight}, {grad}, {s.exp_avg}, {s.exp_avg_sq}, {}, {step}, o.lr(), beta1, beta2, wd, o.eps(),
                     /*amsgrad=*/false, /*maximize=*/false);
  } else {
    at::_fused_adamw_({weight}, {grad}, {s.exp_avg}, {s.exp_avg_sq}, {}, {step}, o.lr(), beta1, beta2, wd, o.eps(),
                      /*amsgrad=*/false, /*maximize=*/false);
  }
  if (s.master.defined()) param.copy_(s.master);
}

AdamOptions require_coupled(const AdamOptions& defaults) {
  ZTRAIN_CHECK(!defaults.decoupled_weight_decay(),
               "ztrain::optim::Adam is classic Adam (weight decay added to the gradient), but its options ask for "
               "decoupled_weight_decay; start from AdamOptions::adam(), or use AdamW");
  return defaults;
}

}  // namespace

// ---- AdamW -----------------------------------------------------------------------------------

AdamW::AdamW(std::vector<torch::optim::OptimizerParamGroup> param_groups, AdamOptions defaults,
             AdamEngineOptions engine)
    : Optimizer(std::move(param_groups), std::make_unique<AdamOptions>(defaults)), engine_(engine) {
  validate(defaults, "default options");
  ZTRAIN_CHECK(!engine.num_threads || *engine.num_threads >= 1, "AdamEngineOptions::num_threads must be >= 1, got ",
               engine.num_threads.value_or(0));
  ZTRAIN_CHECK(engine.min_numel_per_thread >= 1, "AdamEngineOptions::min_numel_per_thread must be >= 1, got ",
               engine.min_numel_per_thread);
  if (engine.kernel) {
    ZTRAIN_CHECK(adam_kernel_supported(*engine.kernel), "the ", to_string(*engine.kernel),
                 " Adam kernel was requested but this CPU cannot run it; leave AdamEngineOptions::kernel unset to "
                 "use the best supported one (", to_string(best_adam_kernel()), ")");
  }
  kernel_ = engine.kernel.value_or(best_adam_kernel());
  for (size_t i = 0; i < param_groups_.size(); ++i) {
    validate(options_of(param_groups_[i], i), group_name(i));
    check_params(param_groups_[i], i);
  }
  pool_ = std::make_unique<ztrain::detail::ThreadPool>(engine.num_threads.value_or(at::get_num_threads()));
}

AdamW::AdamW(std::vector<torch::Tensor> params, AdamOptions defaults, AdamEngineOptions engine)
    : AdamW(std::vector<torch::optim::OptimizerParamGroup>{torch::optim::OptimizerParamGroup(std::move(params))},
            std::move(defaults), engine) {}

AdamW::AdamW(AdamW&&) = default;
AdamW::~AdamW() = default;

int AdamW::num_threads() const { return pool_->size(); }

void AdamW::check_params(const torch::optim::OptimizerParamGroup& group, size_t index) const {
  for (const auto& p : group.params()) check_param(p, group_name(index));
}

void AdamW::check_step() const {
  std::unordered_set<const c10::TensorImpl*> seen;
  for (size_t i = 0; i < param_groups_.size(); ++i) {
    const auto where = group_name(i);
    validate(options_of(param_groups_[i], i), where);
    for (const auto& p : param_groups_[i].params()) {
      check_param(p, where);
      ZTRAIN_CHECK(seen.insert(p.unsafeGetTensorImpl()).second, where,
                   ": a parameter appears twice in the optimizer (it would be updated twice per step)");
      if (!p.grad().defined()) continue;
      check_grad(p, p.grad(), where);
      if (const auto* s = state_of(p)) check_state(*s, p, state_device(p), where);
    }
  }
}

torch::Tensor AdamW::step(LossClosure closure) {
  torch::Tensor loss;
  if (closure) {
    at::AutoGradMode enable_grad(true);
    loss = closure();
  }
  torch::NoGradGuard no_grad;
  check_step();  // everything is checked before anything changes
  std::vector<std::pair<torch::Tensor, const AdamOptions*>> todo;
  for (auto& group : param_groups_) {
    const auto& options = static_cast<const AdamOptions&>(group.options());
    for (const auto& p : group.params()) {
      if (p.grad().defined()) todo.emplace_back(p, &options);
    }
  }
  if (!todo.empty()) read_ahead(todo.front().first);
  for (size_t i = 0; i < todo.size(); ++i) {
    if (i + 1 < todo.size()) read_ahead(todo[i + 1].first);
    update(todo[i].first, todo[i].first.grad(), *todo[i].second);
    write_behind(todo[i].first);
  }
  return loss;
}

torch::Tensor AdamW::new_state(const torch::Tensor& param, c10::Device device) const {
  if (engine_.state_dir && device.is_cpu()) {
    return ztrain::detail::mapped_zeros(*engine_.state_dir, param.sizes(), torch::kFloat32, "optimizer state_dir");
  }
  // Host state of a device parameter is pinned, so that its copies run at full speed.
  return torch::zeros(param.sizes(), torch::TensorOptions().dtype(torch::kFloat32).device(device).pinned_memory(
                                          device.is_cpu() && !param.is_cpu()));
}

AdamParamState* AdamW::find_state(const torch::Tensor& param) {
  const auto it = state_.find(ztrain::detail::optimizer_state_key(param));
  return it == state_.end() ? nullptr : &static_cast<AdamStateEntry&>(*it->second).state;
}

void AdamW::read_ahead(const torch::Tensor& param) {
  // Each is read from its file only where it has one: the state with a state_dir, a block's
  // parameter and gradient shards with BlockOptions::offload_dir.
  ztrain::detail::read_ahead(param);
  ztrain::detail::read_ahead(param.grad());
  if (auto* s = find_state(param)) {
    for (const auto* t : {&s->exp_avg, &s->exp_avg_sq, &s->master}) ztrain::detail::read_ahead(*t);
  }
}

void AdamW::write_behind(const torch::Tensor& param) {
  ztrain::detail::write_behind(param);
  if (auto* s = find_state(param)) {
    for (const auto* t : {&s->exp_avg, &s->exp_avg_sq, &s->master}) ztrain::detail::write_behind(*t);
  }
}

AdamParamState& AdamW::state_for(const torch::Tensor& param) {
  auto& slot = state_[ztrain::detail::optimizer_state_key(param)];
  if (!slot) {
    AdamParamState fresh;
    const auto device = state_device(param);
    fresh.exp_avg = new_state(param, device);
    fresh.exp_avg_sq = new_state(param, device);
    if (needs_master(param, device)) fresh.master = new_state(param, device).copy_(param);
    slot = std::make_unique<AdamStateEntry>(std::move(fresh));
  }
  return static_cast<AdamStateEntry&>(*slot).state;
}

void AdamW::update(const torch::Tensor& param, const torch::Tensor& gradient, const AdamOptions& o) {
  const auto type = *weight_type(param.scalar_type());
  const bool low_precision = type != WeightType::kFloat;
  auto& s = state_for(param);
  s.step += 1;

  // The scalars, in double and then rounded to float, as torch.optim's _single_tensor_adam(w).
  const auto [beta1, beta2] = o.betas();
  const double bias_correction1 = 1 - std::pow(beta1, s.step);
  const double bias_correction2 = 1 - std::pow(beta2, s.step);
  AdamScalars scalars;
  scalars.beta1 = static_cast<float>(beta1);
  scalars.one_minus_beta1 = static_cast<float>(1 - beta1);
  scalars.beta2 = static_cast<float>(beta2);
  scalars.one_minus_beta2 = static_cast<float>(1 - beta2);
  scalars.bias_correction2_sqrt = static_cast<float>(std::sqrt(bias_correction2));
  scalars.eps = static_cast<float>(o.eps());
  scalars.neg_step_size = static_cast<float>(-(o.lr() / bias_correction1));
  scalars.decay = static_cast<float>(1 - o.lr() * o.weight_decay());
  scalars.weight_decay = static_cast<float>(o.weight_decay());
  const Decay decay = o.weight_decay() == 0       ? Decay::kNone
                      : o.decoupled_weight_decay() ? Decay::kDecoupled
                                                   : Decay::kCoupled;

  const int64_t n = param.numel();
  // Offloaded: the state is in host memory, the parameter on a device. The update runs on the
  // host from a host copy of the gradient, into the master (and a host copy of a 16-bit
  // parameter), which then goes to the device.
  const bool offloaded = s.exp_avg.is_cpu() && !param.is_cpu();
  const auto pinned = torch::TensorOptions().dtype(param.scalar_type()).pinned_memory(offloaded);
  const torch::Tensor grad = offloaded ? torch::empty(param.sizes(), pinned).copy_(gradient) : gradient.contiguous();
  if (n > 0 && (kernel_ == AdamKernel::kTorchFused || (!param.is_cpu() && !offloaded))) {
    torch_fused_update(param, grad, s, o, decay);
  } else if (n > 0) {
    const torch::Tensor param16 = offloaded && low_precision ? torch::empty(param.sizes(), pinned) : param;
    AdamSpan span;
    span.weight = s.master.defined() ? s.master.data_ptr<float>() : param.data_ptr<float>();
    span.param16 = low_precision ? static_cast<uint16_t*>(param16.data_ptr()) : nullptr;
    span.grad = grad.data_ptr();
    span.exp_avg = s.exp_avg.data_ptr<float>();
    span.exp_avg_sq = s.exp_avg_sq.data_ptr<float>();
    span.n = n;
    const auto fn = detail::adam_span_fn(kernel_, type, decay);

    constexpr int64_t kAlign = 64;  // elements per part boundary: whole cache lines for 2- and 4-byte data
    const int64_t wanted = std::clamp<int64_t>(n / engine_.min_numel_per_thread, 1, pool_->size());
    if (wanted == 1) {
      fn(scalars, span);
    } else {
      const int64_t chunk = (n + wanted - 1) / wanted;
      const int64_t part = (chunk + kAlign - 1) / kAlign * kAlign;
      const auto parts = static_cast<int>((n + part - 1) / part);
      pool_->run(parts, [&](int k) {
        const int64_t begin = k * part, end = std::min(n, begin + part);
        fn(scalars, span.slice(begin, end, type));
      });
    }
    if (offloaded) param.copy_(low_precision ? param16 : s.master);
  }
  bump_version(param);
  bump_version(s.exp_avg);
  bump_version(s.exp_avg_sq);
  bump_version(s.master);
}

AdamParamState* AdamW::state_of(const torch::Tensor& param) {
  sync();
  const auto it = state_.find(ztrain::detail::optimizer_state_key(param));
  return it == state_.end() ? nullptr : &static_cast<AdamStateEntry&>(*it->second).state;
}

const AdamParamState* AdamW::state_of(const torch::Tensor& param) const {
  sync();
  const auto it = state_.find(ztrain::detail::optimizer_state_key(param));
  return it == state_.end() ? nullptr : &static_cast<const AdamStateEntry&>(*it->second).state;
}

void AdamW::set_state(const torch::Tensor& param, AdamParamState state) {
  sync();
  const auto* impl = param.defined() ? param.unsafeGetTensorImpl() : nullptr;
  bool found = false;
  for (const auto& group : param_groups_) {
    for (const auto& p : group.params()) found = found || p.unsafeGetTensorImpl() == impl;
  }
  ZTRAIN_CHECK(found, "set_state: the tensor is not a parameter of this optimizer");
  check_param(param, "set_state");
  const auto device = state_device(param);
  check_state(state, param, device, "set_state");
  if (engine_.state_dir && device.is_cpu()) {  // into files of its own
    for (auto* t : {&state.exp_avg, &state.exp_avg_sq, &state.master}) {
      if (t->defined()) *t = new_state(param, device).copy_(*t);
    }
  }
  state_[ztrain::detail::optimizer_state_key(param)] = std::make_unique<AdamStateEntry>(std::move(state));
  write_behind(param);
}

void AdamW::save(torch::serialize::OutputArchive& archive) const {
  sync();
  torch::optim::serialize<AdamStateEntry, AdamOptions>(archive, *this);
}

void AdamW::load(torch::serialize::InputArchive& archive) {
  sync();
  torch::optim::serialize<AdamStateEntry, AdamOptions>(archive, *this);
}

// ---- Adam ------------------------------------------------------------------------------------

Adam::Adam(std::vector<torch::optim::OptimizerParamGroup> param_groups, AdamOptions defaults,
           AdamEngineOptions engine)
    : AdamW(std::move(param_groups), require_coupled(defaults), engine) {}

Adam::Adam(std::vector<torch::Tensor> params, AdamOptions defaults, AdamEngineOptions engine)
    : AdamW(std::move(params), require_coupled(defaults), engine) {}

}  // namespace ztrain::optim
