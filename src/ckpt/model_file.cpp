#include <ztrain/ckpt/model_file.h>

#include <ztrain/error.h>
#include <ztrain/runtime/init.h>
#include <ztrain/zero/sharded_module.h>

#include <sys/stat.h>

#include <set>

namespace ztrain {

namespace {

bool any_sharded(const std::vector<NamedParameterRef>& refs) {
  for (const auto& r : refs) {
    if (r.owner) return true;
  }
  return false;
}

/// The part of a parameter this rank writes in parallel mode: its shard's pieces of sharded
/// parameters (at levels 0–1 the same ranges, taken from the replicated full buffer) and, on
/// rank 0, the plain parameters.
void write_own_part(ckpt::SafetensorsWriter& w, const NamedParameterRef& ref, int rank) {
  if (!ref.owner) {
    if (rank == 0) w.write(ref.name, ref.tensor.detach());
    return;
  }
  const auto& g = ref.owner->groups()[ref.group];
  const bool sharded = ref.owner->zero_level() >= 2;
  const auto& entry = g.layout.entries()[ref.entry];
  for (const auto& piece : g.layout.pieces(rank)) {
    if (piece.entry != ref.entry) continue;
    const auto n = piece.end - piece.begin;
    auto src = sharded ? g.shard.detach().narrow(0, piece.shard_offset, n)
                       : g.full.narrow(0, entry.offset + piece.begin, n);
    w.write_range(ref.name, piece.begin, src);
  }
}

void save_parallel(const std::vector<NamedParameterRef>& refs, ckpt::SafetensorsWriter* owner,
                   const std::string& temp_path, const std::vector<ckpt::TensorSpec>& specs,
                   const ckpt::Metadata& metadata, Communicator& dp) {
  std::optional<ckpt::SafetensorsWriter> other;
  if (!owner) other.emplace(ckpt::SafetensorsWriter::open_existing(temp_path, specs, metadata));
  auto& w = owner ? *owner : *other;
  for (const auto& ref : refs) write_own_part(w, ref, dp.rank());
  w.flush();
  auto counts = torch::tensor(w.written_numel(), torch::kInt64);
  dp.all_reduce(counts);
  if (owner) owner->commit(std::vector<int64_t>(counts.data_ptr<int64_t>(), counts.data_ptr<int64_t>() + counts.numel()));
}

void save_gathered(const std::vector<NamedParameterRef>& refs, ckpt::SafetensorsWriter* owner) {
  ShardedModule* current = nullptr;
  bool release_current = false;
  for (const auto& ref : refs) {
    if (ref.owner && ref.owner != current) {
      if (release_current) current->release();
      current = ref.owner;
      release_current = !current->is_gathered();
      current->gather();
    }
    if (!owner) continue;
    if (!ref.owner) {
      owner->write(ref.name, ref.tensor.detach());
    } else {
      const auto& g = ref.owner->groups()[ref.group];
      const auto& e = g.layout.entries()[ref.entry];
      owner->write(ref.name, g.full.narrow(0, e.offset, e.numel).view(e.shape));
    }
  }
  if (release_current) current->release();
  if (owner) owner->commit();
}

bool visible(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0;
}

}  // namespace

void save(torch::nn::Module& model, const std::string& path, const SaveOptions& options) {
  const auto refs = named_parameter_refs(model);
  std::vector<ckpt::TensorSpec> specs;
  for (const auto& r : refs) specs.push_back({r.name, r.dtype, r.shape});
  auto metadata = options.metadata;
  metadata["format"] = "pt";
  torch::NoGradGuard no_grad;

  if (!is_initialized()) {
    ZTRAIN_CHECK(!any_sharded(refs), "save: the model has sharded modules but init_distributed was not called");
    ckpt::SafetensorsWriter w(path, specs, metadata);
    save_gathered(refs, &w);
    return;
  }
  auto& dp = runtime().dp();
  // Rank 0 creates the file; a failure there is every rank's failure.
  std::optional<ckpt::SafetensorsWriter> owner;
  std::string error;
  if (dp.rank() == 0) {
    try {
      owner.emplace(path, specs, metadata);
    } catch (const std::exception& e) {
      error = e.what();
    }
  }
  error = dp.broadcast_bytes(error, 0);
  ZTRAIN_CHECK(error.empty(), error);
  const auto temp_path = dp.broadcast_bytes(owner ? owner->temp_path() : std::string(), 0);
  auto seen = torch::tensor({visible(temp_path) ? 1 : 0}, torch::kInt32);
  dp.all_reduce(seen, ReduceOp::kMin);
  ZTRAIN_CHECK(seen.item<int>() == 1 || options.parallel != true, "save: parallel writing was requested but not every rank sees '",
               temp_path, "' (a path on a filesystem the ranks do not share)");
  if (options.parallel.value_or(seen.item<int>() == 1)) {
    save_parallel(refs, owner ? &*owner : nullptr, temp_path, specs, metadata, dp);
  } else {
    save_gathered(refs, owner ? &*owner : nullptr);
  }
  dp.barrier();  // the file is published when save returns on any rank
}

void load(torch::nn::Module& model, const std::string& path, const LoadOptions& options) {
  ckpt::SafetensorsReader reader(path);
  const auto refs = named_parameter_refs(model);
  std::set<std::string> expected;
  std::vector<std::string> missing;
  for (const auto& r : refs) {
    expected.insert(r.name);
    if (!reader.contains(r.name)) missing.push_back(r.name);
  }
  ZTRAIN_CHECK(missing.empty(), "load: '", path, "' has no tensor '", missing.front(), "' (", missing.size(),
               " of the model's parameters are missing)");
  if (options.strict) {
    for (const auto& info : reader.entries()) {
      ZTRAIN_CHECK(expected.count(info.name), "load: '", path, "' holds '", info.name,
                   "', which the model does not have (LoadOptions{.strict = false} ignores it)");
    }
  }
  const int rank = any_sharded(refs) ? runtime().dp().rank() : 0;
  torch::NoGradGuard no_grad;
  for (const auto& ref : refs) {
    const auto& info = reader.info(ref.name);
    ZTRAIN_CHECK(info.shape == ref.shape, "load: '", ref.name, "' in '", path, "' has shape ",
                 c10::IntArrayRef(info.shape), ", the model's parameter ", c10::IntArrayRef(ref.shape));
    if (!ref.owner) {
      ref.tensor.copy_(reader.read(ref.name));
      continue;
    }
    const auto& g = ref.owner->groups()[ref.group];
    const auto& e = g.layout.entries()[ref.entry];
    if (ref.owner->zero_level() < 2) {
      g.full.narrow(0, e.offset, e.numel).copy_(reader.read(ref.name).reshape(-1));
      continue;
    }
    for (const auto& piece : g.layout.pieces(rank)) {
      if (piece.entry != ref.entry) continue;
      const auto n = piece.end - piece.begin;
      g.shard.narrow(0, piece.shard_offset, n).copy_(reader.read_range(ref.name, piece.begin, n));
    }
  }
}

}  // namespace ztrain
