#include <ztrain/booster/policy.h>

#include <ztrain/error.h>
#include <ztrain/tp/layers.h>
#include <ztrain/zero/layer_list.h>

#include <sstream>

namespace ztrain {

namespace {

std::vector<std::string> components(const std::string& path) {
  std::vector<std::string> out;
  std::stringstream in(path);
  for (std::string part; std::getline(in, part, '.');) out.push_back(part);
  return out;
}

}  // namespace

bool path_matches(const std::string& pattern, const std::string& path) {
  const auto want = components(pattern), got = components(path);
  if (want.size() != got.size()) return false;
  for (size_t i = 0; i < want.size(); ++i) {
    if (want[i] != "*" && want[i] != got[i]) return false;
  }
  return true;
}

void apply_tensor_parallel(torch::nn::Module& model, const Policy& policy, Communicator& tp, ParallelContext* context) {
  std::vector<int> matched(policy.tensor_parallel.size(), 0);
  for (const auto& item : model.named_modules()) {
    const auto& path = item.key();
    const TpRule* rule = nullptr;
    for (size_t r = 0; r < policy.tensor_parallel.size(); ++r) {
      if (!path_matches(policy.tensor_parallel[r].path, path)) continue;
      ZTRAIN_CHECK(!rule, "policy '", policy.name, "': module '", path, "' matches both '", rule ? rule->path : "",
                   "' and '", policy.tensor_parallel[r].path, "'; a module takes one rule");
      rule = &policy.tensor_parallel[r];
      ++matched[r];
    }
    if (!rule) continue;
    auto& module = *item.value();
    try {
      if (auto* linear = dynamic_cast<nn::LinearImpl*>(&module)) {
        linear->parallelize(rule->style, tp, context);
      } else if (auto* embedding = dynamic_cast<nn::EmbeddingImpl*>(&module)) {
        embedding->parallelize(rule->style, tp, context);
      } else if (auto* column = dynamic_cast<tp::ColumnParallelLinearImpl*>(&module)) {
        // A tp layer splits as it was built to: the rule must say the same.
        const auto& o = column->options();
        ZTRAIN_CHECK(rule->style.role == nn::TpRole::kColumn && rule->style.fused_parts == o.fused_parts &&
                         rule->style.gather_output == o.gather_output,
                     "it is a tp::ColumnParallelLinear with ", o.fused_parts, " fused part(s) and gather_output ",
                     o.gather_output, ", which only a column rule saying the same splits");
        column->parallelize(tp, context);
      } else if (auto* row = dynamic_cast<tp::RowParallelLinearImpl*>(&module)) {
        ZTRAIN_CHECK(rule->style.role == nn::TpRole::kRow &&
                         rule->style.input_is_parallel == row->options().input_is_parallel,
                     "it is a tp::RowParallelLinear with input_is_parallel ", row->options().input_is_parallel,
                     ", which only a row rule saying the same splits");
        row->parallelize(tp, context);
      } else {
        ZTRAIN_CHECK(false, "it is a ", module.name(), "; the layers a policy splits are ztrain::nn::Linear and "
                     "ztrain::nn::Embedding (ztrain/tp/nn.h), drop-ins for torch's, and the tp:: parallel linears "
                     "(ztrain/tp/layers.h)");
      }
    } catch (const Error& e) {
      ZTRAIN_CHECK(false, "policy '", policy.name, "': cannot split module '", path, "' (rule '", rule->path, "', ",
                   nn::role_name(rule->style.role), "): ", e.what());
    }
  }
  // A layer list made for a pipeline stage may hold none of the layers a rule names.
  const auto& layers = policy.pipeline.layers;
  const auto modules = model.named_modules();  // find() points into it
  const auto* list = layers.empty() ? nullptr : modules.find(layers);
  const auto* stages = list ? dynamic_cast<const LayerListBase*>(list->get()) : nullptr;
  const bool partial = stages && stages->partial();
  for (size_t r = 0; r < matched.size(); ++r) {
    const auto& path = policy.tensor_parallel[r].path;
    ZTRAIN_CHECK(matched[r] > 0 || (partial && path.rfind(layers + ".", 0) == 0), "policy '", policy.name, "': rule '",
                 path, "' names no module of the model");
  }
  if (context) nn::adopt_records(model, *context);
  if (policy.adapt) policy.adapt(model, tp.size());
}

}  // namespace ztrain
