#include <ztrain/runtime/topology.h>

#include <ztrain/error.h>

namespace ztrain {

Topology::Topology(int world_size, int tp_size, int pp_size) : world_(world_size), tp_(tp_size), pp_(pp_size) {
  ZTRAIN_CHECK(world_size >= 1, "world size must be at least 1, got ", world_size);
  ZTRAIN_CHECK(tp_size >= 1, "tp_size must be at least 1, got ", tp_size);
  ZTRAIN_CHECK(pp_size >= 1, "pp_size must be at least 1, got ", pp_size);
  ZTRAIN_CHECK(world_size % (tp_size * pp_size) == 0, "tp_size (", tp_size, ") × pp_size (", pp_size,
               ") = ", tp_size * pp_size, " does not divide the world size ", world_size,
               "; launch a multiple of ", tp_size * pp_size, " ranks or change the sizes");
  dp_ = world_size / (tp_size * pp_size);
}

void Topology::check_rank(int rank) const {
  ZTRAIN_CHECK(rank >= 0 && rank < world_, "rank ", rank, " is outside the world of ", world_, " ranks");
}

Coord Topology::coord(int rank) const {
  check_rank(rank);
  return {rank / (tp_ * dp_), (rank / tp_) % dp_, rank % tp_};
}

int Topology::rank_of(Coord c) const {
  ZTRAIN_CHECK(c.pp >= 0 && c.pp < pp_ && c.dp >= 0 && c.dp < dp_ && c.tp >= 0 && c.tp < tp_,
               "coordinate (pp ", c.pp, ", dp ", c.dp, ", tp ", c.tp, ") is outside the topology (pp ", pp_,
               ", dp ", dp_, ", tp ", tp_, ")");
  return (c.pp * dp_ + c.dp) * tp_ + c.tp;
}

std::vector<int> Topology::group_along(int rank, int Coord::*axis, int size) const {
  auto c = coord(rank);
  std::vector<int> out;
  for (c.*axis = 0; c.*axis < size; ++(c.*axis)) out.push_back(rank_of(c));
  return out;
}

std::vector<int> Topology::tp_group(int rank) const { return group_along(rank, &Coord::tp, tp_); }
std::vector<int> Topology::dp_group(int rank) const { return group_along(rank, &Coord::dp, dp_); }
std::vector<int> Topology::pp_group(int rank) const { return group_along(rank, &Coord::pp, pp_); }

std::vector<int> Topology::stage_group(int rank) const {
  auto c = coord(rank);
  std::vector<int> out;
  for (int r = c.pp * dp_ * tp_; r < (c.pp + 1) * dp_ * tp_; ++r) out.push_back(r);
  return out;
}

}  // namespace ztrain
