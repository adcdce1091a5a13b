#include <ztrain/tp/split.h>

namespace ztrain::tp {

void set_split(ParameterRecords& owner, const std::string& name, Split split, Communicator* group) {
  auto& module = dynamic_cast<torch::nn::Module&>(owner);
  const auto* param = module.named_parameters(/*recurse=*/false).find(name);
  ZTRAIN_CHECK(param != nullptr, "tp::set_split: the module has no parameter '", name, "' of its own");
  owner.declare_split(name, *param, split, group);
}

void split_in_place(ParameterRecords& owner, const std::string& name, torch::Tensor& param, Split split,
                    Communicator& group) {
  torch::NoGradGuard no_grad;
  param.set_data(slice(param, split, group.rank(), group.size()));
  owner.declare_split(name, param, split, &group);
}

std::optional<Split> split_of(const torch::nn::Module& module, const std::string& name) {
  const auto* r = record_of(module, name);
  return r ? r->tp_split : std::nullopt;
}

}  // namespace ztrain::tp
