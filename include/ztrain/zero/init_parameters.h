#pragma once
/// init_parameters: initialisation that does not depend on the number of ranks.
///
/// Every parameter — wrapped by a Block or DistributedParameter, or plain — is drawn in full
/// from its own generator, seeded from the seed and the parameter's name, and each rank keeps
/// the elements it holds. The same seed therefore gives bit-identical weights on 1 and on 64
/// ranks, and a sharded model never holds more than one full parameter at a time. A
/// tensor-parallel parameter (tp/split.h) is drawn in its full unsplit shape and each tp rank
/// keeps its slice, so weights do not depend on the tp size either. Values are drawn in fp32
/// and rounded to the parameter's dtype.
///
/// The default rule is GPT-2's: weights with two or more dimensions ~ N(0, 0.02²), parameters
/// whose name ends in "bias" zero, other one-dimensional parameters (norm scales) one. Pass
/// your own to change it. Collective only in the sense that every rank must call it on the
/// same model (no communication).
///
///   ztrain::init_parameters(*model, {.seed = 42});
///   ztrain::init_parameters(*model, {.init = [](const std::string& name, torch::Tensor& w, at::Generator& g) {
///     w.normal_(0, name.ends_with("c_proj.weight") ? 0.02 / std::sqrt(24.0) : 0.02, g);
///   }});

#include <ztrain/zero/sharded_module.h>

#include <ATen/core/Generator.h>

#include <functional>
#include <optional>

namespace ztrain {

/// Fills `value` (fp32, the parameter's full shape) for parameter `name` using `gen`.
using ParameterInit = std::function<void(const std::string& name, torch::Tensor& value, at::Generator& gen)>;

/// The default rule described above.
void gpt2_init(const std::string& name, torch::Tensor& value, at::Generator& gen);

struct InitParametersOptions {
  /// Not set: the seed given to init_distributed (or 0 without a runtime).
  std::optional<uint64_t> seed;
  ParameterInit init = gpt2_init;
  /// Which parameters to initialise, by name; not set: every one. The others keep their values.
  std::function<bool(const std::string& name)> select;
};

void init_parameters(torch::nn::Module& module, const InitParametersOptions& options = {});

}  // namespace ztrain
