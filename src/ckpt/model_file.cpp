#include <ztrain/ckpt/model_file.h>

#include "sharded_io.h"

#include <ztrain/error.h>
#include <ztrain/runtime/parallel_context.h>
#include <ztrain/runtime/parameter_record.h>

#include <set>

namespace ztrain {

namespace {
/// The model's entries, once no asynchronous optimizer is still writing its parameters.
std::vector<detail::ShardedEntry> model_entries(torch::nn::Module& model) {
  wait_for_updates(model);
  std::vector<detail::ShardedEntry> out;
  for (const auto& r : named_parameter_refs(model)) {
    out.push_back(detail::entry_of(r, r.name, r.owner ? r.owner->groups()[r.group].shard : r.tensor));
  }
  return out;
}
}  // namespace

void save(torch::nn::Module& model, const std::string& path, const SaveOptions& options) {
  auto metadata = options.metadata;
  metadata["format"] = "pt";
  detail::write_sharded(path, model_entries(model), metadata, options.parallel,
                        detail::comms_of(detail::context_for(model, options.context)));
}

void load(torch::nn::Module& model, const std::string& path, const LoadOptions& options) {
  ckpt::SafetensorsReader reader(path);
  const auto entries = model_entries(model);
  const auto comms = detail::comms_of(detail::context_for(model, options.context));
  std::vector<std::string> names;
  for (const auto& e : entries) names.push_back(e.name);
  // Pipeline stages: the whole model's names.
  const auto all_names = options.strict ? detail::names_of_all_stages(names, comms.pp) : names;
  std::string error;
  try {
    std::vector<std::string> missing;
    for (const auto& name : names) {
      if (!reader.contains(name)) missing.push_back(name);
    }
    ZTRAIN_CHECK(missing.empty(), "load: '", path, "' has no tensor '", missing.front(), "' (", missing.size(),
                 " of the model's parameters are missing)");
    if (options.strict) {
      const std::set<std::string> expected(all_names.begin(), all_names.end());
      for (const auto& info : reader.entries()) {
        ZTRAIN_CHECK(expected.count(info.name), "load: '", path, "' holds '", info.name,
                     "', which the model does not have (LoadOptions{.strict = false} ignores it)");
      }
    }
    for (const auto& e : entries) detail::check_entry(reader, e);
  } catch (const std::exception& e) {
    error = e.what();
  }
  detail::throw_if_any_failed(error, comms.world);  // every rank, so none waits in a collective for one that failed
  for (const auto& e : entries) detail::read_sharded(reader, e);
}

}  // namespace ztrain
