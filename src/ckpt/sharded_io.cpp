#include "sharded_io.h"

#include <ztrain/error.h>
#include <ztrain/runtime/init.h>

#include <sys/stat.h>

namespace ztrain::detail {

namespace {

bool any_sharded(const std::vector<ShardedEntry>& entries) {
  for (const auto& e : entries) {
    if (e.owner) return true;
  }
  return false;
}

/// Element offset of entry `e` in a source laid out like the group's shard, for piece `p`.
int64_t source_offset(const ShardedEntry& e, const ShardPiece& p) {
  if (e.owner->zero_level() >= 1) return p.shard_offset;
  return e.owner->groups()[e.group].layout.entries()[e.entry].offset + p.begin;  // level 0: full
}

/// The pieces of `e` this rank holds (every rank splits level-0 entries the same way).
std::vector<ShardPiece> own_pieces(const ShardedEntry& e, int rank) {
  std::vector<ShardPiece> out;
  for (const auto& p : e.owner->groups()[e.group].layout.pieces(rank)) {
    if (p.entry == e.entry) out.push_back(p);
  }
  return out;
}

void write_parallel(ckpt::SafetensorsWriter& w, const std::vector<ShardedEntry>& entries, int rank) {
  for (const auto& e : entries) {
    if (!e.owner) {
      if (rank == 0) w.write(e.name, e.source.detach());
      continue;
    }
    for (const auto& p : own_pieces(e, rank)) {
      w.write_range(e.name, p.begin, e.source.detach().narrow(0, source_offset(e, p), p.end - p.begin));
    }
  }
}

/// Rank 0 writes everything; sharded sources are all-gathered to full buffers one at a time.
void write_gathered(ckpt::SafetensorsWriter* w, const std::vector<ShardedEntry>& entries, Communicator* dp) {
  torch::Tensor gathered_from, full;
  for (const auto& e : entries) {
    if (!e.owner) {
      if (w) w->write(e.name, e.source.detach());
      continue;
    }
    const auto& layout = e.owner->groups()[e.group].layout;
    if (e.owner->zero_level() == 0 || !dp) {
      full = e.source.detach();
    } else if (!gathered_from.defined() || !gathered_from.is_same(e.source)) {
      full = torch::empty({layout.total_numel()}, e.source.options());
      dp->all_gather(e.source.detach(), full);
    }
    gathered_from = e.source;
    const auto& entry = layout.entries()[e.entry];
    if (w) w->write(e.name, full.narrow(0, entry.offset, entry.numel).view(e.shape));
  }
}

bool visible(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0;
}

}  // namespace

void write_sharded(const std::string& path, const std::vector<ShardedEntry>& entries, ckpt::Metadata metadata,
                   std::optional<bool> parallel) {
  std::vector<ckpt::TensorSpec> specs;
  for (const auto& e : entries) specs.push_back({e.name, e.dtype, e.shape});
  torch::NoGradGuard no_grad;
  if (!is_initialized()) {
    ZTRAIN_CHECK(!any_sharded(entries), "save '", path, "': sharded modules need init_distributed");
    ckpt::SafetensorsWriter w(path, specs, metadata);
    write_gathered(&w, entries, nullptr);
    w.commit();
    return;
  }
  auto& dp = runtime().dp();
  std::optional<ckpt::SafetensorsWriter> owner;  // rank 0 creates and commits the file
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
  const bool all_see = seen.item<int>() == 1;
  ZTRAIN_CHECK(all_see || parallel != true, "save: parallel writing was requested but not every rank sees '", temp_path,
               "' (a path on a filesystem the ranks do not share)");
  if (parallel.value_or(all_see)) {
    std::optional<ckpt::SafetensorsWriter> mine;
    if (!owner) mine.emplace(ckpt::SafetensorsWriter::open_existing(temp_path, specs, metadata));
    auto& w = owner ? *owner : *mine;
    write_parallel(w, entries, dp.rank());
    w.flush();
    auto counts = torch::tensor(w.written_numel(), torch::kInt64);
    dp.all_reduce(counts);
    if (owner) owner->commit(std::vector<int64_t>(counts.data_ptr<int64_t>(), counts.data_ptr<int64_t>() + counts.numel()));
  } else {
    write_gathered(owner ? &*owner : nullptr, entries, &dp);
    if (owner) owner->commit();
  }
  dp.barrier();  // the file is published when save returns on any rank
}

void read_sharded(const ckpt::SafetensorsReader& reader, const ShardedEntry& e) {
  ZTRAIN_CHECK(reader.contains(e.name), "load: '", reader.path(), "' has no tensor '", e.name, "'");
  const auto& info = reader.info(e.name);
  ZTRAIN_CHECK(info.shape == e.shape, "load: '", e.name, "' in '", reader.path(), "' has shape ",
               c10::IntArrayRef(info.shape), ", the model's ", c10::IntArrayRef(e.shape));
  torch::NoGradGuard no_grad;
  if (!e.owner) {
    e.source.copy_(reader.read(e.name));
    return;
  }
  const auto& entry = e.owner->groups()[e.group].layout.entries()[e.entry];
  if (e.owner->zero_level() == 0) {
    e.source.narrow(0, entry.offset, entry.numel).copy_(reader.read(e.name).reshape(-1));
    return;
  }
  for (const auto& p : own_pieces(e, runtime().dp().rank())) {
    e.source.narrow(0, p.shard_offset, p.end - p.begin).copy_(reader.read_range(e.name, p.begin, p.end - p.begin));
  }
}

}  // namespace ztrain::detail
