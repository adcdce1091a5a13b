#pragma once
// Writing and reading safetensors entries whose values are spread over the data-parallel
// ranks the way a sharded module spreads its parameters, and over the tensor-parallel ranks
// as slices of full tensors. Shared by model files and optimizer state files.

#include <ztrain/ckpt/safetensors.h>
#include <ztrain/zero/sharded_module.h>

#include <deque>
#include <optional>
#include <string>
#include <vector>

namespace ztrain::detail {

/// One file entry: the full tensor `name` [shape] of entry `entry` of a sharded module's group
/// laid out by `layout`. `source` holds this rank's part laid out like what the optimizer
/// updates — this rank's shard when `sharded_source` (the level's policy shards the optimizer
/// state), else the whole flat buffer — the group's tensor itself or an optimizer state shaped
/// like it. Without a layout, `source` is the whole tensor of a plain parameter (the same on
/// every dp rank). With `split` (set only when the tp group has several ranks) the parameter is
/// this tp rank's slice of `tp_group` and `shape` the unsplit one.
struct ShardedEntry {
  std::string name;
  c10::ScalarType dtype;
  std::vector<int64_t> shape;
  const FlatParamLayout* layout = nullptr;
  bool sharded_source = false;
  size_t entry = 0;
  torch::Tensor source;
  std::optional<TensorSplit> split;
  Communicator* tp_group = nullptr;
  /// This rank's place in the dp group the layout shards over.
  int dp_rank = 0;
};

/// The entry of parameter `r` whose values are `source` (as ShardedEntry::source).
ShardedEntry entry_of(const NamedParameterRef& r, std::string name, const torch::Tensor& source);

/// Entries that depend on nothing outside themselves: every source copied once (entries that
/// shared a source share its copy) and every layout copied, so the tensors and modules they
/// were taken from may change or go away while the copy is written.
struct EntrySnapshot {
  std::vector<ShardedEntry> entries;
  std::deque<FlatParamLayout> layouts;  // what entries[i].layout points to
};
EntrySnapshot snapshot(const std::vector<ShardedEntry>& entries);

/// The communicators a save runs its collectives on: the model's context's for a save on the
/// thread that trains, its background context's for one on a background thread (so the two
/// never interleave collectives on one communicator). All null without a context: one process
/// writes alone.
struct SaveComms {
  Communicator* world = nullptr;
  Communicator* dp = nullptr;
  Communicator* tp = nullptr;
  Communicator* pp = nullptr;
};
/// The world, dp, tp and pp communicators of `context` (all null for none).
SaveComms comms_of(ParallelContext* context);
/// `given`, else the context `model`'s records name (context_of).
inline ParallelContext* context_for(torch::nn::Module& model, ParallelContext* given) {
  return given ? given : context_of(model);
}

/// Writes every entry to `path`, collective over `comms.world`, all-gathering ZeRO shards over
/// `comms.dp` and tensor-parallel slices over `comms.tp`. The ranks of one pipeline stage
/// must call with the same entry names, shapes and dtypes; each stage passes its own, and the
/// file holds their union, a name several stages hold (a tied parameter, equal on all of them)
/// taken from the lowest. The file is published atomically on rank 0 of the world and visible
/// to every rank when this returns. `parallel` as SaveOptions::parallel.
void write_sharded(const std::string& path, const std::vector<ShardedEntry>& entries, ckpt::Metadata metadata,
                   std::optional<bool> parallel, const SaveComms& comms);

/// The union of every pipeline stage's `names` (collective over `pp`; just `names` without one).
std::vector<std::string> names_of_all_stages(const std::vector<std::string>& names, Communicator* pp);

/// Throws ztrain::Error when the file lacks entry `e` or holds it with another shape.
void check_entry(const ckpt::SafetensorsReader& reader, const ShardedEntry& e);

/// Collective over `world`: throws ztrain::Error, on every rank, with the first failing rank's
/// `error` when any rank's is not empty (just `error` without a world).
void throw_if_any_failed(const std::string& error, Communicator* world);

/// Fills `e.source` from the file: the elements this rank holds (padding untouched). Converts
/// dtypes. Throws ztrain::Error naming the entry and the file on a missing entry or a shape
/// mismatch.
void read_sharded(const ckpt::SafetensorsReader& reader, const ShardedEntry& e);

}  // namespace ztrain::detail
