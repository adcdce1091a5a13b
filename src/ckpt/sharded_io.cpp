#include "sharded_io.h"

#include <ztrain/error.h>
#include <ztrain/runtime/parallel_context.h>

#include <sys/stat.h>

#include <sstream>
#include <unordered_map>

namespace ztrain::detail {

namespace {

bool any_sharded(const std::vector<ShardedEntry>& entries) {
  for (const auto& e : entries) {
    if (e.layout) return true;
  }
  return false;
}

/// Element offset of piece `p` of entry `e` in its source.
int64_t source_offset(const ShardedEntry& e, const ShardPiece& p) {
  if (e.sharded_source) return p.shard_offset;
  return e.layout->entries()[e.entry].offset + p.begin;  // the whole flat buffer
}

/// The pieces of `e` this rank holds (every rank splits replicated entries the same way).
std::vector<ShardPiece> own_pieces(const ShardedEntry& e, int rank) {
  std::vector<ShardPiece> out;
  for (const auto& p : e.layout->pieces(rank)) {
    if (p.entry == e.entry) out.push_back(p);
  }
  return out;
}

/// The values of entries on this tp rank, in their parameters' (slice) shapes. Sharded
/// sources are all-gathered over dp, one flat buffer at a time (consecutive entries of one
/// group share it), so this is collective over dp for them.
class DpGatherer {
 public:
  explicit DpGatherer(Communicator* dp) : dp_(dp) {}

  torch::Tensor local(const ShardedEntry& e) {
    if (!e.layout) return e.source.detach();
    const auto& layout = *e.layout;
    if (!e.sharded_source || !dp_) {
      full_ = e.source.detach();
    } else if (!from_.defined() || !from_.is_same(e.source)) {
      full_ = torch::empty({layout.total_numel()}, e.source.options());
      dp_->all_gather(e.source.detach(), full_);
    }
    from_ = e.source;
    const auto& entry = layout.entries()[e.entry];
    return full_.narrow(0, entry.offset, entry.numel).view(entry.shape);
  }

 private:
  Communicator* dp_;
  torch::Tensor from_, full_;
};

/// Who takes part in a save: every rank with a runtime, one rank without. The leader of a
/// pipeline stage (its first dp and tp rank) writes the stage's whole tensors.
struct Party {
  Communicator* dp = nullptr;
  Communicator* tp = nullptr;
  Communicator* pp = nullptr;
  bool leader = true;
};

/// The unsplit value of a tensor-parallel entry (collective over dp and tp).
torch::Tensor unsplit(DpGatherer& gatherer, const ShardedEntry& e, const Party& party) {
  return assemble(gatherer.local(e), *e.split, *party.tp);
}

/// Each rank writes the pieces it holds: dp shards of the first tp rank's replicas directly,
/// tensor-parallel entries (not contiguous in the file) assembled on the stage's leader.
void write_parallel(ckpt::SafetensorsWriter& w, const std::vector<ShardedEntry>& entries, const Party& party) {
  DpGatherer gatherer(party.dp);
  for (const auto& e : entries) {
    if (e.split) {
      auto full = unsplit(gatherer, e, party);
      if (party.leader) w.write(e.name, full);
    } else if (party.tp->rank() != 0) {
      continue;  // a replica of what tp rank 0 writes
    } else if (!e.layout) {
      if (party.leader) w.write(e.name, e.source.detach());
    } else {
      for (const auto& p : own_pieces(e, party.dp->rank())) {
        w.write_range(e.name, p.begin, e.source.detach().narrow(0, source_offset(e, p), p.end - p.begin));
      }
    }
  }
}

/// Only `w`'s rank (world rank 0) writes; everything is gathered to it one entry at a time:
/// within each stage, then from the leaders of the later stages (`later`: what each of them
/// writes, in their order) over the pipeline group.
void write_gathered(ckpt::SafetensorsWriter* w, const std::vector<ShardedEntry>& entries, const Party& party,
                    const std::vector<std::vector<ckpt::TensorSpec>>& later = {}) {
  DpGatherer gatherer(party.dp);
  const bool first_tp_rank = !party.tp || party.tp->rank() == 0;
  const int stage = party.pp ? party.pp->rank() : 0;
  for (const auto& e : entries) {
    torch::Tensor value;
    if (e.split) {
      value = unsplit(gatherer, e, party);
    } else if (first_tp_rank) {
      value = gatherer.local(e);
    }
    if (w) {
      w->write(e.name, value.reshape(e.shape));
    } else if (stage > 0 && party.leader) {
      party.pp->send(value.reshape(e.shape).contiguous(), 0);
    }
  }
  if (!w) return;
  for (size_t s = 0; s < later.size(); ++s) {
    for (const auto& spec : later[s]) {
      auto value = torch::empty(spec.shape, torch::TensorOptions().dtype(spec.dtype));
      party.pp->recv(value, static_cast<int>(s) + 1);
      w->write(spec.name, value);
    }
  }
}

/// The specs of every pipeline stage's entries, in stage order (collective over `pp`).
std::vector<std::vector<ckpt::TensorSpec>> specs_of_all_stages(Communicator& pp, const std::vector<ckpt::TensorSpec>& mine) {
  std::string bytes;
  for (const auto& s : mine) {
    bytes += s.name + '\0' + std::to_string(static_cast<int>(s.dtype));
    for (auto d : s.shape) bytes += ' ' + std::to_string(d);
    bytes += '\0';
  }
  std::vector<std::vector<ckpt::TensorSpec>> out;
  for (const auto& part : pp.all_gather_bytes(bytes)) {
    auto& specs = out.emplace_back();
    for (size_t at = 0; at < part.size();) {
      const auto name_end = part.find('\0', at), end = part.find('\0', name_end + 1);
      std::istringstream fields(part.substr(name_end + 1, end - name_end - 1));
      int dtype = 0;
      fields >> dtype;
      std::vector<int64_t> shape;
      for (int64_t d; fields >> d;) shape.push_back(d);
      specs.push_back({part.substr(at, name_end - at), static_cast<c10::ScalarType>(dtype), std::move(shape)});
      at = end + 1;
    }
  }
  return out;
}

/// What a save across pipeline stages writes: the file's specs (every stage's, a name held by
/// several taken from the lowest), this stage's entries left to write, and what each later
/// stage writes.
struct StagePlan {
  std::vector<ckpt::TensorSpec> specs;
  std::vector<ShardedEntry> entries;
  std::vector<std::vector<ckpt::TensorSpec>> later;
};

StagePlan plan_stages(Communicator& pp, const std::vector<ShardedEntry>& entries, const std::vector<ckpt::TensorSpec>& mine) {
  StagePlan plan;
  struct Owner {
    size_t stage, spec;
  };
  std::unordered_map<std::string, Owner> owners;
  const auto all = specs_of_all_stages(pp, mine);
  plan.later.resize(all.size() - 1);
  for (size_t s = 0; s < all.size(); ++s) {
    for (const auto& spec : all[s]) {
      auto [it, fresh] = owners.emplace(spec.name, Owner{s, plan.specs.size()});
      if (!fresh) {
        const auto& first = plan.specs[it->second.spec];
        ZTRAIN_CHECK(first.dtype == spec.dtype && first.shape == spec.shape, "save: '", spec.name,
                     "' is held by pipeline stages ", it->second.stage, " and ", s, " with different shapes or dtypes");
        continue;
      }
      plan.specs.push_back(spec);
      if (s > 0) plan.later[s - 1].push_back(spec);
    }
  }
  for (const auto& e : entries) {
    if (owners.at(e.name).stage == static_cast<size_t>(pp.rank())) plan.entries.push_back(e);
  }
  return plan;
}

bool visible(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0;
}

}  // namespace

ShardedEntry entry_of(const NamedParameterRef& r, std::string name, const torch::Tensor& source) {
  return {.name = std::move(name), .dtype = source.scalar_type(), .shape = r.full_shape(),
          .layout = r.owner ? &r.owner->groups()[r.group].layout : nullptr,
          .sharded_source = r.owner && r.owner->policy().shards_optimizer_state, .entry = r.entry, .source = source,
          .split = r.tp_split(), .tp_group = r.tp_split() ? r.tp_group : nullptr,
          .dp_rank = r.owner ? r.owner->context().dp().rank() : 0};
}

EntrySnapshot snapshot(const std::vector<ShardedEntry>& entries) {
  torch::NoGradGuard no_grad;
  EntrySnapshot out;
  std::unordered_map<const void*, torch::Tensor> sources;
  std::unordered_map<const FlatParamLayout*, const FlatParamLayout*> layouts;
  for (auto e : entries) {
    auto& copy = sources[e.source.unsafeGetTensorImpl()];
    // In host memory, whatever the device: a save in the background holds no device memory.
    if (!copy.defined()) copy = e.source.detach().to(torch::kCPU, /*non_blocking=*/false, /*copy=*/true);
    e.source = copy;
    if (e.layout) {
      auto& l = layouts[e.layout];
      if (!l) l = &out.layouts.emplace_back(*e.layout);
      e.layout = l;
    }
    out.entries.push_back(std::move(e));
  }
  return out;
}

SaveComms comms_of(ParallelContext* context) {
  if (!context) return {};
  return {.world = &context->world(), .dp = &context->dp(), .tp = &context->tp(), .pp = &context->pp()};
}

std::vector<std::string> names_of_all_stages(const std::vector<std::string>& names, Communicator* pp) {
  if (!pp || pp->size() == 1) return names;
  std::string bytes;
  for (const auto& n : names) bytes += n + '\0';
  std::vector<std::string> out;
  for (const auto& part : pp->all_gather_bytes(bytes)) {
    for (size_t at = 0, end; at < part.size(); at = end + 1) {
      end = part.find('\0', at);
      out.push_back(part.substr(at, end - at));
    }
  }
  return out;
}

void write_sharded(const std::string& path, const std::vector<ShardedEntry>& entries, ckpt::Metadata metadata,
                   std::optional<bool> parallel, const SaveComms& comms) {
  std::vector<ckpt::TensorSpec> specs;
  for (const auto& e : entries) specs.push_back({e.name, e.dtype, e.shape});
  torch::NoGradGuard no_grad;
  if (!comms.world) {
    ZTRAIN_CHECK(!any_sharded(entries), "save '", path, "': sharded modules need init_distributed");
    ckpt::SafetensorsWriter w(path, specs, metadata);
    write_gathered(&w, entries, {});
    w.commit();
    return;
  }
  ZTRAIN_INTERNAL_ASSERT(comms.dp && comms.tp && comms.pp, "write_sharded: a world communicator without dp, tp and pp ones");
  auto& world = *comms.world;
  const Party party{.dp = comms.dp, .tp = comms.tp, .pp = comms.pp,
                    .leader = comms.dp->rank() == 0 && comms.tp->rank() == 0};
  StagePlan plan{.specs = std::move(specs), .entries = entries, .later = {}};
  if (comms.pp->size() > 1) plan = plan_stages(*comms.pp, entries, plan.specs);
  specs = plan.specs;
  std::optional<ckpt::SafetensorsWriter> owner;  // world rank 0 creates and commits the file
  std::string error;
  if (world.rank() == 0) {
    try {
      owner.emplace(path, specs, metadata);
    } catch (const std::exception& e) {
      error = e.what();
    }
  }
  error = world.broadcast_bytes(error, 0);
  ZTRAIN_CHECK(error.empty(), error);
  const auto temp_path = world.broadcast_bytes(owner ? owner->temp_path() : std::string(), 0);
  auto seen = torch::tensor({visible(temp_path) ? 1 : 0}, torch::kInt32);
  world.all_reduce(seen, ReduceOp::kMin);
  const bool all_see = seen.item<int>() == 1;
  ZTRAIN_CHECK(all_see || parallel != true, "save: parallel writing was requested but not every rank sees '", temp_path,
               "' (a path on a filesystem the ranks do not share)");
  if (parallel.value_or(all_see)) {
    std::optional<ckpt::SafetensorsWriter> mine;
    if (!owner) mine.emplace(ckpt::SafetensorsWriter::open_existing(temp_path, specs, metadata));
    auto& w = owner ? *owner : *mine;
    write_parallel(w, plan.entries, party);
    w.flush();
    auto counts = torch::tensor(w.written_numel(), torch::kInt64);
    world.all_reduce(counts);
    if (owner) owner->commit(std::vector<int64_t>(counts.data_ptr<int64_t>(), counts.data_ptr<int64_t>() + counts.numel()));
  } else {
    write_gathered(owner ? &*owner : nullptr, plan.entries, party, plan.later);
    if (owner) owner->commit();
  }
  world.barrier();  // the file is published when save returns on any rank
}

void check_entry(const ckpt::SafetensorsReader& reader, const ShardedEntry& e) {
  ZTRAIN_CHECK(reader.contains(e.name), "load: '", reader.path(), "' has no tensor '", e.name, "'");
  const auto& info = reader.info(e.name);
  ZTRAIN_CHECK(info.shape == e.shape, "load: '", e.name, "' in '", reader.path(), "' has shape ",
               c10::IntArrayRef(info.shape), ", the model's ", c10::IntArrayRef(e.shape));
}

void throw_if_any_failed(const std::string& error, Communicator* world) {
  if (!world) {
    ZTRAIN_CHECK(error.empty(), error);
    return;
  }
  const auto all = world->all_gather_bytes(error);
  for (size_t r = 0; r < all.size(); ++r) {
    ZTRAIN_CHECK(all[r].empty(), all[r], static_cast<int>(r) == world->rank() ? "" : c10::str(" (on rank ", r, ")"));
  }
}

void read_sharded(const ckpt::SafetensorsReader& reader, const ShardedEntry& e) {
  check_entry(reader, e);
  torch::NoGradGuard no_grad;
  torch::Tensor local;  // a tensor-parallel entry: this tp rank's slice, flat
  if (e.split) local = slice(reader.read(e.name), *e.split, e.tp_group->rank(), e.tp_group->size()).view(-1);
  if (!e.layout) {
    e.source.copy_(local.defined() ? local.view_as(e.source) : reader.read(e.name));
    return;
  }
  const auto& entry = e.layout->entries()[e.entry];
  if (!e.sharded_source) {
    e.source.narrow(0, entry.offset, entry.numel).copy_(local.defined() ? local : reader.read(e.name).reshape(-1));
    return;
  }
  for (const auto& p : own_pieces(e, e.dp_rank)) {
    const int64_t n = p.end - p.begin;
    e.source.narrow(0, p.shard_offset, n).copy_(local.defined() ? local.narrow(0, p.begin, n)
                                                                  : reader.read_range(e.name, p.begin, n));
  }
}

}  // namespace ztrain::detail
