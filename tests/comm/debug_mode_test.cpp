// Debug mode: mismatched collectives raise an error naming the ranks and what each called,
// instead of hanging or silently mixing data.
#include "test_util.h"

#include <ztrain/comm/backend.h>

namespace debug_mode_test {

using ztrain::test::error_message;

namespace {
std::unique_ptr<ztrain::Communicator> debug_comm(const char* name) {
  auto comm = ztrain::runtime().world().dup(name);
  comm->set_debug(true);
  return comm;
}
}  // namespace

TEST(DebugMode, AgreeingCollectivesPass) {
  auto comm = debug_comm("agree");
  auto t = torch::ones({17});
  comm->all_reduce(t);
  comm->barrier();
  auto out = comm->all_gather(torch::ones({3}));
  EXPECT_EQ(t[0].item<float>(), comm->size());
  EXPECT_EQ(out.numel(), 3 * comm->size());
}

TEST(DebugMode, DifferentOperationsNameTheRanks) {
  auto comm = debug_comm("ops");
  ASSERT_GE(comm->size(), 2) << "a mismatch needs two ranks";
  auto msg = error_message([&] {
    if (comm->rank() == 0) {
      comm->all_reduce(torch::ones({1024}));
    } else {
      comm->all_gather(torch::ones({512}));
    }
  });
  EXPECT_NE(msg.find("collective mismatch on communicator 'ops'"), std::string::npos) << msg;
  EXPECT_NE(msg.find("rank 0 called all_reduce(Float, 1024 elements, sum)"), std::string::npos) << msg;
  const std::string others = comm->size() == 2 ? "rank 1" : comm->size() == 3 ? "ranks 1,2" : "ranks 1,2,3";
  EXPECT_NE(msg.find(others + " called all_gather(Float, 512 elements)"), std::string::npos) << msg;
  // The check itself completed on every rank, so the communicator still works.
  auto t = torch::ones({1});
  comm->all_reduce(t);
  EXPECT_EQ(t.item<float>(), comm->size());
}

TEST(DebugMode, DifferentSizesDtypesAndRootsAreCaught) {
  auto comm = debug_comm("sizes");
  ASSERT_GE(comm->size(), 2) << "a mismatch needs two ranks";
  const bool last = comm->rank() == comm->size() - 1;
  auto msg = error_message([&] { comm->all_reduce(torch::ones({last ? 9 : 8})); });
  EXPECT_NE(msg.find(c10::str("rank ", comm->size() - 1, " called all_reduce(Float, 9 elements")), std::string::npos) << msg;
  msg = error_message([&] { comm->all_reduce(torch::ones({8}, last ? torch::kFloat64 : torch::kFloat32)); });
  EXPECT_NE(msg.find("all_reduce(Double, 8 elements"), std::string::npos) << msg;
  msg = error_message([&] { comm->broadcast(torch::ones({4}), last ? 1 : 0); });
  EXPECT_NE(msg.find("root 1"), std::string::npos) << msg;
  msg = error_message([&] { comm->all_reduce(torch::ones({4}), last ? ztrain::ReduceOp::kMax : ztrain::ReduceOp::kSum); });
  EXPECT_NE(msg.find("all_reduce(Float, 4 elements, max)"), std::string::npos) << msg;
}

TEST(DebugMode, DifferentRingThresholdsAreCaught) {
  // Ranks configured differently would pick different algorithms for the same call and stall.
  auto& world = ztrain::runtime().world();
  ASSERT_GE(world.size(), 2) << "a mismatch needs two ranks";
  auto owner = ztrain::make_world_communicator("mpi", {.name = "thresholds", .timeout = world.timeout(), .debug = true,
                                                       .ring_threshold_bytes = world.rank() == 0 ? 1024 : 4096});
  auto& comm = *owner;
  auto msg = error_message([&] { comm.all_reduce(torch::ones({512}), ztrain::ReduceOp::kSum); });
  EXPECT_NE(msg.find("rank 0 called all_reduce(Float, 512 elements, sum) as collective #1 with rings from 1024 bytes"),
            std::string::npos) << msg;
}

TEST(DebugMode, OnByDefaultFromTheEnvironmentOrOptions) {
  // The runtime's communicators follow InitOptions::debug_collectives / ZTRAIN_DEBUG_COLLECTIVES;
  // ctest runs this test once with the variable set.
  const char* env = std::getenv("ZTRAIN_DEBUG_COLLECTIVES");
  const bool expected = env && std::string(env) != "0";
  EXPECT_EQ(ztrain::runtime().world().debug(), expected);
  EXPECT_EQ(ztrain::runtime().dp().debug(), expected);
}

}  // namespace debug_mode_test
