#include <ztrain/optim/param_groups.h>

namespace ztrain::optim {

std::vector<bool> default_weight_decay(torch::nn::Module& module) {
  std::unordered_set<const void*> embeddings;
  for (const auto& m : module.modules()) {
    if (const auto* e = dynamic_cast<const torch::nn::EmbeddingImpl*>(m.get())) {
      embeddings.insert(e->weight.unsafeGetTensorImpl());
    }
  }
  std::vector<bool> out;
  for (const auto& p : recorded_parameters(module)) {
    const auto* r = p.record;
    const bool skip = (r && r->no_weight_decay) || embeddings.count(p.tensor.unsafeGetTensorImpl()) ||
                      (!(r && r->flat) && p.tensor.dim() < 2);
    out.push_back(!skip);
  }
  return out;
}

}  // namespace ztrain::optim
