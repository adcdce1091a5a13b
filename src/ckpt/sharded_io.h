#pragma once
// Writing and reading safetensors entries whose values are spread over the data-parallel
// ranks the way a sharded module spreads its parameters, and over the tensor-parallel ranks
// as slices of full tensors. Shared by model files and optimizer state files.

#include <ztrain/ckpt/safetensors.h>
#include <ztrain/zero/sharded_module.h>

#include <optional>
#include <string>
#include <vector>

namespace ztrain::detail {

/// One file entry: the full tensor `name` [shape] of parameter (owner, group, entry). `source`
/// holds this rank's part laid out like the group's shard — owner->groups()[group].shard (the
/// full buffer at level 0) or an optimizer state shaped like it. Without an owner, `source` is
/// the whole tensor (the same on every dp rank). With `split` (set only when the tp group has
/// several ranks) the parameter is this tp rank's slice and `shape` the unsplit one.
struct ShardedEntry {
  std::string name;
  c10::ScalarType dtype;
  std::vector<int64_t> shape;
  ShardedModule* owner = nullptr;
  size_t group = 0;
  size_t entry = 0;
  torch::Tensor source;
  std::optional<tp::Split> split;
};

/// The entry of parameter `r` whose values are `source` (as ShardedEntry::source).
ShardedEntry entry_of(const NamedParameterRef& r, std::string name, const torch::Tensor& source);

/// Writes every entry to `path` (collective over the world when a runtime exists). `parallel`
/// as SaveOptions::parallel.
void write_sharded(const std::string& path, const std::vector<ShardedEntry>& entries, ckpt::Metadata metadata,
                   std::optional<bool> parallel);

/// Fills `e.source` from the file: the elements this rank holds (padding untouched). Converts
/// dtypes. Throws ztrain::Error naming the entry and the file on a missing entry or a shape
/// mismatch.
void read_sharded(const ckpt::SafetensorsReader& reader, const ShardedEntry& e);

}  // namespace ztrain::detail
