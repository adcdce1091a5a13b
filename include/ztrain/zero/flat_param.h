#pragma once
/// The layout of a flat parameter buffer and its shards.
///
/// Parameters of one dtype are placed one after another in a flat buffer, each starting on a
/// 64-byte boundary; the total is padded so that it splits into `world_size` equal shards that
/// each start on a 64-byte boundary too (vectorised optimizers read whole cache lines), or on a
/// coarser boundary when asked (whole pages, for shards that peers map). Rank r
/// owns elements [r·P, (r+1)·P). A parameter may span several shards, and a shard may hold no
/// element of a small parameter. The table maps every parameter's fully qualified name to its
/// (offset, shape): the basis of sharded checkpoints and of resharding to another world size.
///
/// Pure arithmetic, no communication and no storage.
///
///   ztrain::FlatParamLayout layout({{"fc.weight", {4, 3}}, {"fc.bias", {4}}}, torch::kFloat32, 2);
///   layout.find("fc.bias").offset;        // 16: 12 elements rounded up to 64 bytes
///   layout.shard_numel();                 // 16: 32 elements padded, two shards
///   layout.pieces(1);                     // fc.bias's elements [0, 4) at shard offset 0

#include <c10/core/ScalarType.h>

#include <cstdint>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace ztrain {

/// One parameter's place in the flat buffer.
struct FlatParamEntry {
  std::string name;
  std::vector<int64_t> shape;
  int64_t offset = 0;  // in elements, from the start of the flat buffer
  int64_t numel = 0;
};

/// The part of one parameter that lies in one shard: the parameter's (flattened) elements
/// [begin, end) are at [shard_offset, shard_offset + end - begin) of the shard.
struct ShardPiece {
  size_t entry = 0;  // index into FlatParamLayout::entries()
  int64_t begin = 0;
  int64_t end = 0;
  int64_t shard_offset = 0;
  bool operator==(const ShardPiece&) const = default;
};

class FlatParamLayout {
 public:
  static constexpr int64_t kAlignBytes = 64;

  /// Throws ztrain::Error on a repeated name, a negative dimension, world_size < 1, or a
  /// `shard_align_bytes` that is not a multiple of kAlignBytes.
  FlatParamLayout(const std::vector<std::pair<std::string, std::vector<int64_t>>>& params,
                  c10::ScalarType dtype, int world_size, int64_t shard_align_bytes = kAlignBytes);

  c10::ScalarType dtype() const { return dtype_; }
  int world_size() const { return world_size_; }
  /// Elements of the padded flat buffer (a multiple of world_size()).
  int64_t total_numel() const { return total_; }
  /// Elements per shard.
  int64_t shard_numel() const { return total_ / world_size_; }
  /// Elements that belong to parameters (the rest is alignment and padding).
  int64_t used_numel() const { return used_; }

  const std::vector<FlatParamEntry>& entries() const { return entries_; }
  /// The entry named `name`; throws ztrain::Error naming it when absent.
  const FlatParamEntry& find(const std::string& name) const;
  bool contains(const std::string& name) const { return index_.count(name) != 0; }

  /// [begin, end) of rank's shard in the flat buffer.
  std::pair<int64_t, int64_t> shard_range(int rank) const;
  /// Every parameter piece in rank's shard, in offset order.
  std::vector<ShardPiece> pieces(int rank) const;

 private:
  c10::ScalarType dtype_;
  int world_size_;
  int64_t total_ = 0;
  int64_t used_ = 0;
  std::vector<FlatParamEntry> entries_;
  std::unordered_map<std::string, size_t> index_;
};

}  // namespace ztrain
