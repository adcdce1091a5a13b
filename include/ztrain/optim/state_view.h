#pragma once
/// A uniform view of what an optimizer keeps per parameter, for checkpoints and memory
/// accounting.
///
/// Each kind of optimizer stores its state differently (ztrain's AdamW beside libtorch's state
/// map, libtorch's per-class ParamState types); this view names every per-parameter state tensor
/// the same way everywhere — tensors shaped like the parameter, by name — plus the step counter
/// where there is one. Supported: ztrain's AdamW and Adam (exp_avg, exp_avg_sq, master for
/// 16-bit parameters), and libtorch's Adam and AdamW (exp_avg, exp_avg_sq, max_exp_avg_sq), SGD
/// (momentum_buffer), RMSprop (square_avg, momentum_buffer, grad_avg) and Adagrad (sum). Any
/// other optimizer is a ztrain::Error naming the supported ones. Not collective.
///
///   for (const auto& p : opt.param_groups()[0].params()) {
///     auto s = ztrain::optim::state_of(opt, p);        // s.tensors["exp_avg"], s.step
///     ztrain::optim::set_state(other, q, std::move(s));
///   }

#include <torch/torch.h>

#include <cstdint>
#include <map>
#include <optional>
#include <string>

namespace ztrain::optim {

struct ParameterState {
  /// Undefined tensors are left out.
  std::map<std::string, torch::Tensor> tensors;
  std::optional<int64_t> step;
};

/// The state `optimizer` keeps for `param` (empty before its first step). Waits for an
/// asynchronous optimizer's updates first.
ParameterState state_of(torch::optim::Optimizer& optimizer, const torch::Tensor& param);

/// Replaces the state `optimizer` keeps for `param` (loading a checkpoint). The tensors are
/// stored as given; a missing one is left undefined.
void set_state(torch::optim::Optimizer& optimizer, const torch::Tensor& param, ParameterState state);

/// Bytes of every state tensor `optimizer` keeps.
int64_t state_bytes(torch::optim::Optimizer& optimizer);

}  // namespace ztrain::optim
