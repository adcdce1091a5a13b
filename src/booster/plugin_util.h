#pragma once
// What every plugin's boost() does to a plain model before its own work.

#include <ztrain/comm/communicator.h>
#include <ztrain/runtime/parallel_context.h>

#include <torch/torch.h>

#include <string>
#include <utility>
#include <vector>

namespace ztrain::detail {

/// The context a plugin spans: `context`, else the default one (init_distributed's).
ParallelContext& plugin_context(const std::shared_ptr<ParallelContext>& context);

/// Refuses an optimizer that updates a tensor that is not one of `model`'s parameters.
void check_optimizer_over(torch::nn::Module& model, const torch::optim::Optimizer& optimizer, const std::string& who);

/// Refuses an optimizer that holds state already: a sharding plugin swaps its parameters.
void check_no_state(const torch::optim::Optimizer& optimizer, const std::string& who);

/// `module` as a shared_ptr: its owner's when a holder owns it, else one that does not own it
/// (the caller keeps the module alive).
std::shared_ptr<torch::nn::Module> shared_module(torch::nn::Module& module);

/// Moves a model built elsewhere to `device` (Module::to keeps the parameter objects, so the
/// optimizer's references hold); refuses when the optimizer holds state already, which would
/// not follow.
void move_to_device(torch::nn::Module& model, const torch::optim::Optimizer& optimizer, c10::Device device,
                    const std::string& who);

/// Checks that every rank of `dp` holds the same parameters and buffers (names, dtypes,
/// shapes), naming the difference otherwise. Returns the parameters, each tensor once.
std::vector<std::pair<std::string, torch::Tensor>> check_same_model(torch::nn::Module& model, Communicator& dp,
                                                                    const std::string& who);

/// Overwrites `tensors` with dp rank 0's values, one broadcast per dtype.
void broadcast_from_first(const std::vector<torch::Tensor>& tensors, Communicator& dp);

}  // namespace ztrain::detail
