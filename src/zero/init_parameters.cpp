#include <ztrain/zero/init_parameters.h>

#include <ztrain/error.h>
#include <ztrain/runtime/init.h>
#include <ztrain/runtime/rng.h>

#include <ATen/CPUGeneratorImpl.h>

namespace ztrain {

namespace {
uint64_t name_hash(const std::string& name) {
  uint64_t h = 1469598103934665603ull;  // FNV-1a
  for (unsigned char c : name) h = (h ^ c) * 1099511628211ull;
  return h;
}

/// Copies the elements of `value` (flattened) that this rank holds of `ref`'s sharded module.
void write_owned(const NamedParameterRef& ref, const torch::Tensor& value) {
  const auto& group = ref.owner->groups()[ref.group];
  const auto flat = value.reshape(-1);
  if (!ref.owner->policy().shards_parameters) {  // the full buffer is kept: the values live there
    const auto& e = group.layout.entries()[ref.entry];
    group.full.narrow(0, e.offset, e.numel).copy_(flat);
    return;
  }
  for (const auto& piece : group.layout.pieces(ref.owner->context().dp().rank())) {
    if (piece.entry != ref.entry) continue;
    group.shard.narrow(0, piece.shard_offset, piece.end - piece.begin).copy_(flat.narrow(0, piece.begin, piece.end - piece.begin));
  }
}
}  // namespace

void gpt2_init(const std::string& name, torch::Tensor& value, at::Generator& gen) {
  if (value.dim() >= 2) {
    value.normal_(0.0, 0.02, gen);
  } else if (name.size() >= 4 && name.compare(name.size() - 4, 4, "bias") == 0) {
    value.zero_();
  } else {
    value.fill_(1.0);
  }
}

void init_parameters(torch::nn::Module& module, const InitParametersOptions& options) {
  ZTRAIN_CHECK(options.init, "init_parameters: the init function is empty");
  const auto* context = context_of(module);
  const uint64_t seed = options.seed.value_or(context ? context->seed() : 0);
  torch::NoGradGuard no_grad;
  for (const auto& ref : named_parameter_refs(module)) {
    if (options.select && !options.select(ref.name)) continue;
    at::Generator gen = at::detail::createCPUGenerator(rng::derive(rng::shared_seed(seed), {name_hash(ref.name)}));
    const auto shape = ref.full_shape();
    auto value = torch::empty(shape, torch::kFloat32);
    options.init(ref.name, value, gen);
    ZTRAIN_CHECK(value.sizes() == at::IntArrayRef(shape), "init_parameters: the init function changed the shape of '",
                 ref.name, "' to ", value.sizes());
    if (const auto split = ref.tp_split()) value = slice(value, *split, ref.tp_group->rank(), ref.tp_group->size());
    value = value.to(ref.dtype);
    if (ref.owner) {
      write_owned(ref, value);
    } else {
      ref.tensor.copy_(value);
    }
  }
}

}  // namespace ztrain
