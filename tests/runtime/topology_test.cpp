#include "test_util.h"

#include <ztrain/runtime/rng.h>
#include <ztrain/runtime/topology.h>

#include <set>

namespace topology_test {

using ztrain::Coord;
using ztrain::Topology;

TEST(Topology, TensorParallelIsFastestThenDataThenPipeline) {
  Topology t(8, 2, 2);
  EXPECT_EQ(t.dp_size(), 2);
  EXPECT_EQ(t.coord(0), (Coord{0, 0, 0}));
  EXPECT_EQ(t.coord(1), (Coord{0, 0, 1}));
  EXPECT_EQ(t.coord(2), (Coord{0, 1, 0}));
  EXPECT_EQ(t.coord(5), (Coord{1, 0, 1}));
  EXPECT_EQ(t.coord(7), (Coord{1, 1, 1}));
  for (int r = 0; r < 8; ++r) EXPECT_EQ(t.rank_of(t.coord(r)), r);
}

TEST(Topology, GroupsPartitionTheWorld) {
  for (auto [world, tp, pp] : {std::tuple{12, 2, 3}, std::tuple{6, 3, 1}, std::tuple{4, 1, 4}, std::tuple{1, 1, 1}}) {
    Topology t(world, tp, pp);
    std::set<std::vector<int>> tps, dps, pps, stages;
    for (int r = 0; r < world; ++r) {
      auto g = t.tp_group(r);
      EXPECT_EQ(static_cast<int>(g.size()), tp);
      EXPECT_EQ(g[t.coord(r).tp], r);
      tps.insert(g);
      auto d = t.dp_group(r);
      EXPECT_EQ(static_cast<int>(d.size()), t.dp_size());
      EXPECT_EQ(d[t.coord(r).dp], r);
      dps.insert(d);
      auto p = t.pp_group(r);
      EXPECT_EQ(static_cast<int>(p.size()), pp);
      EXPECT_EQ(p[t.coord(r).pp], r);
      pps.insert(p);
      stages.insert(t.stage_group(r));
      for (int m : t.stage_group(r)) EXPECT_EQ(t.coord(m).pp, t.coord(r).pp);
    }
    EXPECT_EQ(static_cast<int>(tps.size()), world / tp);
    EXPECT_EQ(static_cast<int>(dps.size()), world / t.dp_size());
    EXPECT_EQ(static_cast<int>(pps.size()), world / pp);
    EXPECT_EQ(static_cast<int>(stages.size()), pp);
  }
}

TEST(Topology, RejectsSizesThatDoNotDivide) {
  auto msg = ztrain::test::error_message([] { Topology(6, 4, 1); });
  EXPECT_NE(msg.find("does not divide the world size 6"), std::string::npos) << msg;
  msg = ztrain::test::error_message([] { Topology(4, 1, 3); });
  EXPECT_NE(msg.find("pp_size (3)"), std::string::npos) << msg;
  msg = ztrain::test::error_message([] { Topology(4, 0, 1); });
  EXPECT_NE(msg.find("tp_size must be at least 1"), std::string::npos) << msg;
  msg = ztrain::test::error_message([] { Topology(4, 2, 1).coord(4); });
  EXPECT_NE(msg.find("outside the world"), std::string::npos) << msg;
}

TEST(Rng, StreamsDifferWhereRanksMustDifferAndAgreeElsewhere) {
  using namespace ztrain::rng;
  EXPECT_EQ(data_parallel_seed(7, {0, 1, 0}), data_parallel_seed(7, {0, 1, 1}));  // tp shares
  EXPECT_NE(data_parallel_seed(7, {0, 0, 0}), data_parallel_seed(7, {0, 1, 0}));  // dp differs
  EXPECT_NE(data_parallel_seed(7, {0, 0, 0}), data_parallel_seed(7, {1, 0, 0}));  // pp differs
  EXPECT_NE(rank_seed(7, {0, 1, 0}), rank_seed(7, {0, 1, 1}));
  EXPECT_NE(shared_seed(7), shared_seed(8));
  EXPECT_NE(data_parallel_seed(7, {0, 0, 0}), rank_seed(7, {0, 0, 0}));
  EXPECT_NE(derive(1, {2, 3}), derive(1, {3, 2}));
}

}  // namespace topology_test
