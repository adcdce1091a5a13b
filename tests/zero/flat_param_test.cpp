#include "test_util.h"

#include <ztrain/zero/flat_param.h>

namespace flat_param_test {

using ztrain::FlatParamLayout;
using ztrain::ShardPiece;

namespace {
using Params = std::vector<std::pair<std::string, std::vector<int64_t>>>;
const Params kMixed = {{"a.weight", {5, 3}}, {"a.bias", {5}}, {"tiny", {1}}, {"empty", {0}}, {"b.weight", {7, 9}}};
}  // namespace

TEST(FlatParamLayout, AlignsEveryParameterAndPadsToEqualAlignedShards) {
  for (auto dtype : {torch::kFloat32, torch::kBFloat16, torch::kFloat64}) {
    const int64_t align = 64 / c10::elementSize(dtype);
    for (int world : {1, 2, 3, 4, 7}) {
      FlatParamLayout layout(kMixed, dtype, world);
      EXPECT_EQ(layout.used_numel(), 15 + 5 + 1 + 0 + 63);
      EXPECT_EQ(layout.total_numel() % (world * align), 0);
      EXPECT_EQ(layout.shard_numel() % align, 0);
      int64_t end = 0;
      for (const auto& e : layout.entries()) {
        EXPECT_EQ(e.offset % align, 0) << e.name;
        EXPECT_GE(e.offset, end) << e.name << " overlaps the previous parameter";
        end = e.offset + e.numel;
      }
      EXPECT_LE(end, layout.total_numel());
      EXPECT_LT(layout.total_numel() - end, world * align) << "more padding than needed";
    }
  }
}

TEST(FlatParamLayout, ShardPiecesCoverEveryElementExactlyOnce) {
  for (int world : {1, 2, 3, 4, 5, 16, 64}) {
    FlatParamLayout layout(kMixed, torch::kFloat32, world);
    std::vector<std::vector<int>> hits(layout.entries().size());
    for (size_t i = 0; i < hits.size(); ++i) hits[i].assign(layout.entries()[i].numel, 0);
    for (int r = 0; r < world; ++r) {
      auto [lo, hi] = layout.shard_range(r);
      EXPECT_EQ(hi - lo, layout.shard_numel());
      for (const auto& p : layout.pieces(r)) {
        const auto& e = layout.entries()[p.entry];
        EXPECT_EQ(lo + p.shard_offset, e.offset + p.begin) << e.name << " rank " << r;
        EXPECT_LE(p.shard_offset + (p.end - p.begin), layout.shard_numel());
        for (int64_t k = p.begin; k < p.end; ++k) ++hits[p.entry][k];
      }
    }
    for (size_t i = 0; i < hits.size(); ++i) {
      for (int h : hits[i]) ASSERT_EQ(h, 1) << layout.entries()[i].name << " at world " << world;
    }
  }
}

TEST(FlatParamLayout, SmallParametersLeaveSomeShardsWithoutThem) {
  FlatParamLayout layout({{"tiny", {1}}}, torch::kFloat32, 4);
  EXPECT_EQ(layout.shard_numel(), 16);
  EXPECT_EQ(layout.pieces(0), (std::vector<ShardPiece>{{0, 0, 1, 0}}));
  for (int r = 1; r < 4; ++r) EXPECT_TRUE(layout.pieces(r).empty()) << r;
}

TEST(FlatParamLayout, ShardsRebuildTheParameters) {
  // Scatter real tensors through the table and read them back from every rank's pieces.
  FlatParamLayout layout(kMixed, torch::kFloat32, 3);
  std::vector<torch::Tensor> params;
  auto flat = torch::zeros({layout.total_numel()});
  for (const auto& e : layout.entries()) {
    params.push_back(torch::randn(e.shape));
    flat.narrow(0, e.offset, e.numel).copy_(params.back().reshape(-1));
  }
  auto shards = flat.chunk(3);
  for (size_t i = 0; i < params.size(); ++i) {
    auto rebuilt = torch::full({layout.entries()[i].numel}, std::nanf(""));
    for (int r = 0; r < 3; ++r) {
      for (const auto& p : layout.pieces(r)) {
        if (p.entry != i) continue;
        rebuilt.narrow(0, p.begin, p.end - p.begin).copy_(shards[r].narrow(0, p.shard_offset, p.end - p.begin));
      }
    }
    EXPECT_TRUE(torch::equal(rebuilt.view(params[i].sizes()), params[i])) << layout.entries()[i].name;
  }
}

TEST(FlatParamLayout, BadInputIsNamed) {
  auto msg = ztrain::test::error_message([] { FlatParamLayout({{"w", {2}}, {"w", {3}}}, torch::kFloat32, 2); });
  EXPECT_NE(msg.find("'w' appears twice"), std::string::npos) << msg;
  msg = ztrain::test::error_message([] { FlatParamLayout({{"w", {2}}}, torch::kFloat32, 0); });
  EXPECT_NE(msg.find("world_size must be at least 1"), std::string::npos) << msg;
  FlatParamLayout layout({{"w", {2}}}, torch::kFloat32, 2);
  msg = ztrain::test::error_message([&] { layout.find("v"); });
  EXPECT_NE(msg.find("no parameter named 'v'"), std::string::npos) << msg;
  EXPECT_EQ(layout.find("w").numel, 2);
}

}  // namespace flat_param_test
