#include <ztrain/ckpt/optimizer_state.h>

#include "background_save.h"
#include "sharded_io.h"

#include <ztrain/error.h>
#include <ztrain/optim/state_view.h>
#include <ztrain/runtime/parallel_context.h>
#include <ztrain/runtime/parameter_record.h>

#include <nlohmann/json.hpp>

#include <map>
#include <unordered_map>

// How it works: every optimizer parameter is matched to the model parameters it holds — all
// entries of a sharded module's group (its shard) or one plain parameter. Its state comes from
// the optimizer-state view (optim/state_view.h); a state tensor has the parameter's layout, so it is written with the same pieces and offsets
// as the parameter itself, one file entry per (model parameter, state name). Reading fills a
// zeroed tensor laid out like the parameter with the elements this rank holds.

namespace ztrain {

namespace {

/// The model parameters one optimizer parameter holds.
struct Holder {
  ShardedModule* owner = nullptr;
  size_t group = 0;
  std::vector<NamedParameterRef> refs;  // in layout order for a group; one for a plain parameter
};

std::unordered_map<const void*, Holder> holders(torch::nn::Module& model) {
  std::unordered_map<const void*, Holder> out;
  for (const auto& r : named_parameter_refs(model)) {
    const auto& t = r.owner ? r.owner->groups()[r.group].shard : r.tensor;
    auto& h = out[t.unsafeGetTensorImpl()];
    h.owner = r.owner;
    h.group = r.group;
    h.refs.push_back(r);
  }
  return out;
}

const Holder& holder_of(const std::unordered_map<const void*, Holder>& all, const torch::Tensor& p) {
  auto it = all.find(p.unsafeGetTensorImpl());
  ZTRAIN_CHECK(it != all.end(), "optimizer state: the optimizer holds a parameter of shape ", p.sizes(),
               " that is not one of the model's (pass the model the optimizer was built on)");
  return it->second;
}

std::vector<torch::Tensor> optimizer_params(const torch::optim::Optimizer& opt) {
  std::vector<torch::Tensor> out;
  for (const auto& g : opt.param_groups()) {
    for (const auto& p : g.params()) out.push_back(p);
  }
  return out;
}

/// What parameter p's state tensor t is written from or read into: for a sharded module's
/// parameter one flat tensor (the writer gathers a shared source once), for a plain one the
/// parameter's shape. A view of t.
torch::Tensor state_source(const Holder& h, const torch::Tensor& p, const torch::Tensor& t) {
  return h.refs.front().owner ? t.reshape(-1) : t.reshape(p.sizes());
}

detail::ShardedEntry entry_for(const NamedParameterRef& r, const std::string& state, const torch::Tensor& source) {
  return detail::entry_of(r, r.name + "." + state, source);
}

/// What a save writes: the entries of every state tensor and the file's metadata.
struct StateFile {
  std::vector<detail::ShardedEntry> entries;
  ckpt::Metadata metadata;
};

StateFile state_file(torch::nn::Module& model, torch::optim::Optimizer& optimizer, const SaveOptions& options) {
  const auto all = holders(model);
  StateFile out;
  nlohmann::json steps = nlohmann::json::object();
  for (const auto& p : optimizer_params(optimizer)) {
    const auto& h = holder_of(all, p);
    // Every rank must describe the same entries: a state created lazily on a step counts
    // everywhere, because all ranks step the same parameters.
    auto s = optim::state_of(optimizer, p);
    for (const auto& [name, t] : s.tensors) {
      ZTRAIN_CHECK(t.numel() == p.numel(), "optimizer state '", name, "' has ", t.numel(), " elements, its parameter ",
                   p.numel());
      const auto source = state_source(h, p, t);
      for (const auto& r : h.refs) out.entries.push_back(entry_for(r, name, source));
    }
    if (s.step) {
      for (const auto& r : h.refs) steps[r.name] = *s.step;
    }
  }
  auto* context = detail::context_for(model, options.context);
  if (context && context->pp().size() > 1) {  // the file's metadata is world rank 0's: every stage's steps
    for (const auto& part : context->pp().all_gather_bytes(steps.dump())) steps.update(nlohmann::json::parse(part));
  }
  out.metadata = options.metadata;
  out.metadata["format"] = "ztrain-optimizer";
  out.metadata["steps"] = steps.dump();
  return out;
}

}  // namespace

void save_optimizer_state(torch::nn::Module& model, torch::optim::Optimizer& optimizer, const std::string& path,
                          const SaveOptions& options) {
  auto file = state_file(model, optimizer, options);
  detail::write_sharded(path, file.entries, file.metadata, options.parallel,
                        detail::comms_of(detail::context_for(model, options.context)));
}

namespace detail {

std::function<void(const SaveComms&)> optimizer_state_writer(torch::nn::Module& model,
                                                              torch::optim::Optimizer& optimizer,
                                                              const std::string& path, const SaveOptions& options) {
  auto file = state_file(model, optimizer, options);
  auto copy = std::make_shared<EntrySnapshot>(snapshot(file.entries));
  return [path, copy, metadata = std::move(file.metadata), parallel = options.parallel](const SaveComms& comms) {
    write_sharded(path, copy->entries, metadata, parallel, comms);
  };
}

}  // namespace detail

PendingSave save_optimizer_state_async(torch::nn::Module& model, torch::optim::Optimizer& optimizer,
                                       const std::string& path, const SaveOptions& options) {
  detail::wait_for_background_save();  // one copy in memory at a time
  return detail::start_background_save(detail::context_for(model, options.context), path,
                                       detail::optimizer_state_writer(model, optimizer, path, options));
}

void load_optimizer_state(torch::nn::Module& model, torch::optim::Optimizer& optimizer, const std::string& path) {
  ckpt::SafetensorsReader reader(path);
  const auto all = holders(model);
  const auto& meta = reader.metadata();
  ZTRAIN_CHECK(meta.count("format") && meta.at("format") == "ztrain-optimizer", "load_optimizer_state: '", path,
               "' is not an optimizer state file (its metadata lacks format=ztrain-optimizer)");
  const auto steps = nlohmann::json::parse(meta.count("steps") ? meta.at("steps") : "{}");
  for (const auto& p : optimizer_params(optimizer)) {
    const auto& h = holder_of(all, p);
    optim::ParameterState s;
    // The states saved for this parameter: those of its first model parameter.
    const std::string prefix = h.refs.front().name + ".";
    for (const auto& info : reader.entries()) {
      if (info.name.rfind(prefix, 0) != 0) continue;
      const auto state = info.name.substr(prefix.size());
      if (state.find('.') != std::string::npos) continue;  // another parameter's name continues here
      auto t = torch::zeros({p.numel()}, torch::TensorOptions().dtype(info.dtype));
      for (const auto& r : h.refs) detail::read_sharded(reader, entry_for(r, state, state_source(h, p, t)));
      s.tensors[state] = t.view(p.sizes());
    }
    if (steps.contains(h.refs.front().name)) s.step = steps.at(h.refs.front().name).get<int64_t>();
    if (!s.tensors.empty()) optim::set_state(optimizer, p, std::move(s));
  }
}

}  // namespace ztrain
