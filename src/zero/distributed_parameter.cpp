#include <ztrain/zero/distributed_parameter.h>

#include <ztrain/error.h>
#include <ztrain/runtime/init.h>

namespace ztrain {

namespace {
struct HolderImpl : torch::nn::Module, ParameterRecords {
  HolderImpl(const DistributedParameterOptions& o, torch::Tensor value, ParallelContext& context) {
    ZTRAIN_CHECK(value.defined(), "DistributedParameter: the value is undefined");
    ZTRAIN_CHECK(!o.name.empty() && o.name.find('.') == std::string::npos,
                 "DistributedParameter: the name must be non-empty and contain no '.', got '", o.name, "'");
    param = register_parameter(o.name, value.detach().clone(), o.requires_grad);
    if (o.tp_split) declare_split(o.name, param, *o.tp_split, &context.tp());
    if (!o.weight_decay) record(o.name).no_weight_decay = true;
  }
  torch::Tensor param;
};

std::vector<int64_t> shard_versions(const std::vector<ShardGroup>& groups) {
  std::vector<int64_t> v;
  for (const auto& g : groups) v.push_back(g.shard._version());
  return v;
}
}  // namespace

DistributedParameterImpl::DistributedParameterImpl(torch::Tensor value, DistributedParameterOptions options)
    : ShardedModule(std::make_shared<HolderImpl>(options, std::move(value), *context_or_default(options.context)),
                    {.zero_level = options.zero_level, .use_checkpoint = false, .prefetch_depth = 0,
                     .context = options.context},
                    "DistributedParameter"),
      name_(options.name) {}

torch::Tensor DistributedParameterImpl::forward() {
  const bool with_grad = torch::GradMode::is_enabled();
  const bool reusable = cached_.defined() && cached_with_grad_ == with_grad &&
                        cached_versions_ == shard_versions(groups()) &&
                        (!with_grad || last_call_pending_backward());
  if (reusable) return cached_;
  auto holder = std::static_pointer_cast<HolderImpl>(wrapped());
  auto out = run([holder](const std::vector<torch::Tensor>&) { return std::vector<torch::Tensor>{holder->param.view_as(holder->param)}; },
                 {});
  cached_ = out[0];
  cached_with_grad_ = with_grad;
  cached_versions_ = shard_versions(groups());
  return cached_;
}

torch::Tensor DistributedParameterImpl::gradient_place() {
  const auto& group = groups().front();  // its one parameter's
  if (!group.requires_grad) return {};
  const auto buffer = gradient_buffer_ahead(0);
  if (!buffer.defined()) return {};
  const auto& entry = group.layout.entries().front();
  return buffer.narrow(0, entry.offset, entry.numel).view(entry.shape);
}

}  // namespace ztrain
