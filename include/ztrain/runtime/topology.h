#pragma once
/// Rank layout: world = pp × dp × tp, tensor-parallel fastest (neighbouring ranks, which share a
/// host, form a tp group), then data-parallel, then pipeline stages.
///
///   rank = (pp_rank * dp_size + dp_rank) * tp_size + tp_rank
///
/// Pure arithmetic, no communication: usable before and without MPI.
///
///   ztrain::Topology t(8, /*tp_size=*/2, /*pp_size=*/2);   // dp_size() == 2
///   auto c = t.coord(5);                                    // {pp 1, dp 0, tp 1}

#include <vector>

namespace ztrain {

struct Coord {
  int pp = 0;
  int dp = 0;
  int tp = 0;
  bool operator==(const Coord&) const = default;
};

class Topology {
 public:
  /// Throws ztrain::Error unless tp_size * pp_size divides world_size.
  Topology(int world_size, int tp_size = 1, int pp_size = 1);

  int world_size() const { return world_; }
  int tp_size() const { return tp_; }
  int dp_size() const { return dp_; }
  int pp_size() const { return pp_; }

  Coord coord(int rank) const;
  int rank_of(Coord c) const;

  /// World ranks of the groups `rank` belongs to, in group-rank order.
  std::vector<int> tp_group(int rank) const;
  std::vector<int> dp_group(int rank) const;
  std::vector<int> pp_group(int rank) const;
  /// The dp × tp ranks of `rank`'s pipeline stage.
  std::vector<int> stage_group(int rank) const;

 private:
  void check_rank(int rank) const;
  // Ranks that share `rank`'s coordinates except along `axis`, in order along it.
  std::vector<int> group_along(int rank, int Coord::*axis, int size) const;
  int world_, tp_, dp_, pp_;
};

}  // namespace ztrain
