#include <ztrain/zero/flat_param.h>

#include <ztrain/error.h>

#include <c10/core/ScalarType.h>

#include <algorithm>
#include <numeric>

namespace ztrain {
namespace {
int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }
}  // namespace

FlatParamLayout::FlatParamLayout(const std::vector<std::pair<std::string, std::vector<int64_t>>>& params,
                                 c10::ScalarType dtype, int world_size, int64_t shard_align_bytes)
    : dtype_(dtype), world_size_(world_size) {
  ZTRAIN_CHECK(world_size >= 1, "FlatParamLayout: world_size must be at least 1, got ", world_size);
  ZTRAIN_CHECK(shard_align_bytes > 0 && shard_align_bytes % kAlignBytes == 0,
               "FlatParamLayout: shards align to a multiple of ", kAlignBytes, " bytes, got ", shard_align_bytes);
  const int64_t align = std::max<int64_t>(1, kAlignBytes / static_cast<int64_t>(c10::elementSize(dtype)));
  int64_t offset = 0;
  for (const auto& [name, shape] : params) {
    ZTRAIN_CHECK(!index_.count(name), "FlatParamLayout: parameter '", name, "' appears twice; each "
                 "parameter may be placed once (is a module registered under two names?)");
    int64_t numel = 1;
    for (auto d : shape) {
      ZTRAIN_CHECK(d >= 0, "FlatParamLayout: parameter '", name, "' has a negative dimension");
      numel *= d;
    }
    offset = round_up(offset, align);
    index_[name] = entries_.size();
    entries_.push_back({name, shape, offset, numel});
    offset += numel;
    used_ += numel;
  }
  // Every shard starts on a boundary: pad to a multiple of world_size · its alignment.
  const int64_t shard_align = std::max<int64_t>(1, shard_align_bytes / static_cast<int64_t>(c10::elementSize(dtype)));
  total_ = round_up(offset, static_cast<int64_t>(world_size) * shard_align);
}

const FlatParamEntry& FlatParamLayout::find(const std::string& name) const {
  auto it = index_.find(name);
  ZTRAIN_CHECK(it != index_.end(), "FlatParamLayout: no parameter named '", name, "'");
  return entries_[it->second];
}

std::pair<int64_t, int64_t> FlatParamLayout::shard_range(int rank) const {
  ZTRAIN_CHECK(rank >= 0 && rank < world_size_, "FlatParamLayout: rank ", rank, " outside world of ",
               world_size_);
  return {rank * shard_numel(), (rank + 1) * shard_numel()};
}

std::vector<ShardPiece> FlatParamLayout::pieces(int rank) const {
  auto [lo, hi] = shard_range(rank);
  std::vector<ShardPiece> out;
  for (size_t i = 0; i < entries_.size(); ++i) {
    const auto& e = entries_[i];
    const int64_t begin = std::max(lo, e.offset), end = std::min(hi, e.offset + e.numel);
    if (begin < end) out.push_back({i, begin - e.offset, end - e.offset, begin - lo});
  }
  return out;
}

}  // namespace ztrain
