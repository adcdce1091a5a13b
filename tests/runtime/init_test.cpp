// Initialisation, in the order a program meets it: calls before init fail clearly, a rejected
// configuration can be corrected, the runtime then answers every query, and a second init fails.
// The tests depend on running in this order (gtest keeps definition order).
#include "test_util.h"

#include <ztrain/comm/backend.h>

#include "../../src/runtime/cpu_binding.h"

#include <torch/cuda.h>

#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <thread>

namespace init_test {

using namespace std::chrono_literals;
using ztrain::test::error_message;

TEST(Init, CallsBeforeInitNameInitDistributed) {
  EXPECT_FALSE(ztrain::is_initialized());
  for (auto msg : {error_message([] { ztrain::runtime(); }), error_message([] { ztrain::rank(); }),
                   error_message([] { ztrain::synchronize(); }),
                   error_message([] { ztrain::sum_loss(torch::ones({})); })}) {
    EXPECT_NE(msg.find("call ztrain::init_distributed()"), std::string::npos) << msg;
  }
}

TEST(Init, RejectsTopologiesThatDoNotDivideTheWorld) {
  const int world = ztrain::test::expected_world_size();
  auto msg = error_message([&] { ztrain::init_distributed({.tp_size = world + 1}); });
  EXPECT_NE(msg.find("does not divide the world size " + std::to_string(world)), std::string::npos) << msg;
  msg = error_message([&] { ztrain::init_distributed({.tp_size = 1, .pp_size = world + 1}); });
  EXPECT_NE(msg.find("pp_size (" + std::to_string(world + 1) + ")"), std::string::npos) << msg;
  msg = error_message([&] { ztrain::init_distributed({.pp_size = 0}); });
  EXPECT_NE(msg.find("pp_size must be at least 1"), std::string::npos) << msg;
  msg = error_message([&] { ztrain::init_distributed({.threads = 0}); });
  EXPECT_NE(msg.find("threads must be at least 1"), std::string::npos) << msg;
  msg = error_message([&] { ztrain::init_distributed({.timeout = -1ms}); });
  EXPECT_NE(msg.find("timeout must be positive"), std::string::npos) << msg;
  msg = error_message([&] { ztrain::init_distributed({.host_cache_bytes = -1}); });
  EXPECT_NE(msg.find("host_cache_bytes must be >= 0, got -1"), std::string::npos) << msg;
  setenv("ZTRAIN_HOST_CACHE_BYTES", "2GiB", 1);
  msg = error_message([&] { ztrain::init_distributed(); });
  unsetenv("ZTRAIN_HOST_CACHE_BYTES");
  EXPECT_NE(msg.find("ZTRAIN_HOST_CACHE_BYTES=2GiB must be a number of bytes >= 0"), std::string::npos) << msg;
  EXPECT_FALSE(ztrain::is_initialized());
}

TEST(Init, RejectsDevicesItCannotRunOnNamingTheAlternative) {
  auto msg = error_message([&] { ztrain::init_distributed({.device = c10::Device(c10::kMeta)}); });
  EXPECT_NE(msg.find("InitOptions::device: ztrain runs on cpu or cuda devices, got meta"), std::string::npos) << msg;
  msg = error_message([&] { ztrain::init_distributed({.device = c10::Device(c10::kCPU, 1)}); });
  EXPECT_NE(msg.find("there is one CPU device, got cpu:1"), std::string::npos) << msg;
  setenv("ZTRAIN_DEVICE", "gpu0", 1);
  msg = error_message([&] { ztrain::init_distributed(); });
  EXPECT_NE(msg.find("ZTRAIN_DEVICE: 'gpu0' is not a device; use cpu, cuda or cuda:N"), std::string::npos) << msg;
  const int gpus = static_cast<int>(torch::cuda::device_count());
  if (gpus == 0) {
    setenv("ZTRAIN_DEVICE", "cuda", 1);
    msg = error_message([&] { ztrain::init_distributed(); });
    EXPECT_NE(msg.find("ZTRAIN_DEVICE: cuda was asked for, but this process sees no CUDA device"), std::string::npos)
        << msg;
    EXPECT_NE(msg.find("or use device cpu"), std::string::npos) << msg;
  }
  unsetenv("ZTRAIN_DEVICE");
  msg = error_message([&] { ztrain::init_distributed({.device = c10::Device(c10::kCUDA, gpus)}); });
  EXPECT_NE(msg.find(gpus == 0 ? "sees no CUDA device" : "does not exist"), std::string::npos) << msg;
  EXPECT_FALSE(ztrain::is_initialized());
}

TEST(Init, RejectsBackendsItCannotRunNamingTheAlternative) {
  auto msg = error_message([&] { ztrain::init_distributed({.backend = "gloo"}); });
  EXPECT_NE(msg.find("unknown communicator backend 'gloo'; this build has: mpi"), std::string::npos) << msg;
  setenv("ZTRAIN_BACKEND", "nccl", 1);
  msg = error_message([&] { ztrain::init_distributed({.device = c10::Device(c10::kCPU)}); });
  unsetenv("ZTRAIN_BACKEND");
  const auto backends = ztrain::communicator_backends();
  if (std::find(backends.begin(), backends.end(), "nccl") != backends.end()) {
    EXPECT_NE(msg.find("the nccl backend moves CUDA tensors, but this rank's device is cpu"), std::string::npos)
        << msg;
    EXPECT_NE(msg.find("or use the mpi backend"), std::string::npos) << msg;
  } else {
    EXPECT_NE(msg.find("the nccl backend is not in this build of ztrain"), std::string::npos) << msg;
  }
  EXPECT_FALSE(ztrain::is_initialized());
}

std::vector<int> g_cpus_before_init;  // as the launcher started this rank

TEST(Init, BuildsTheTopologyAndItsCommunicators) {
  const int world = ztrain::test::expected_world_size();
  g_cpus_before_init = ztrain::detail::allowed_cpus();
  const int tp = world % 2 == 0 ? 2 : 1;
  setenv("ZTRAIN_TIMEOUT_S", "42", 1);
  setenv("ZTRAIN_DEBUG_COLLECTIVES", "1", 1);
  setenv("ZTRAIN_HOST_CACHE_BYTES", "123456789", 1);
  auto& rt = ztrain::init_distributed({.seed = 5, .tp_size = tp, .threads = 1});
  unsetenv("ZTRAIN_DEBUG_COLLECTIVES");
  unsetenv("ZTRAIN_HOST_CACHE_BYTES");
  ASSERT_TRUE(ztrain::is_initialized());
  EXPECT_EQ(rt.world_size(), world);
  EXPECT_EQ(ztrain::world_size(), world);
  EXPECT_EQ(ztrain::rank(), rt.rank());
  EXPECT_EQ(rt.timeout(), 42s);
  // Made under the startup deadline (at least 60 s), then given the configured one.
  auto& ctx = rt.context();
  for (auto* c : {&ctx.world(), &ctx.tp(), &ctx.dp(), &ctx.pp(), &ctx.stage()}) EXPECT_EQ(c->timeout(), 42s) << c->name();
  EXPECT_EQ(ctx.gather_stream().communicator().timeout(), 42s);
  EXPECT_TRUE(rt.debug_collectives());
  EXPECT_EQ(rt.host_cache_bytes(), 123456789);
  EXPECT_TRUE(rt.world().debug());
  EXPECT_EQ(rt.threads(), 1);
  EXPECT_EQ(at::get_num_threads(), 1);
  EXPECT_EQ(rt.local_size(), world);  // every rank of the test runs on this host
  EXPECT_EQ(rt.seed(), 5u);
  EXPECT_EQ(rt.device(), c10::Device(c10::kCPU));  // neither InitOptions::device nor ZTRAIN_DEVICE set
  EXPECT_EQ(rt.context().device(), rt.device());

  const auto& t = rt.topology();
  EXPECT_EQ(t.tp_size(), tp);
  EXPECT_EQ(t.dp_size(), world / tp);
  auto check = [&](ztrain::Communicator& c, const std::vector<int>& members, int my_index, const char* name) {
    EXPECT_EQ(c.name(), name);
    ASSERT_EQ(c.size(), static_cast<int>(members.size())) << name;
    EXPECT_EQ(c.rank(), my_index) << name;
    for (int i = 0; i < c.size(); ++i) EXPECT_EQ(c.world_rank_of(i), members[i]) << name;
    // The communicator really connects those ranks: the sum of their world ranks.
    auto s = torch::tensor({static_cast<int64_t>(rt.rank())});
    c.all_reduce(s);
    EXPECT_EQ(s.item<int64_t>(), std::accumulate(members.begin(), members.end(), int64_t{0})) << name;
  };
  std::vector<int> everyone(world);
  std::iota(everyone.begin(), everyone.end(), 0);
  check(rt.world(), everyone, rt.rank(), "world");
  check(rt.tp(), t.tp_group(rt.rank()), rt.tp_rank(), "tp");
  check(rt.dp(), t.dp_group(rt.rank()), rt.dp_rank(), "dp");
  check(rt.pp(), t.pp_group(rt.rank()), rt.pp_rank(), "pp");
  check(rt.stage(), t.stage_group(rt.rank()), rt.rank(), "stage");
}

TEST(Init, PinsTheRanksGivenTheSameCpusToSharesOfThem) {
  // bind_cores is on by default. The ranks given the same CPUs (here: all, started unbound, or
  // none alike, each bound by its launcher) split them where each can have one (threads = 1).
  auto& rt = ztrain::runtime();
  const auto before = g_cpus_before_init;
  const auto befores = rt.world().all_gather_bytes(ztrain::detail::cpu_list_string(before));
  const int alike = static_cast<int>(std::count(befores.begin(), befores.end(), befores[rt.rank()]));
  const bool expect_pinned = alike >= 2 && static_cast<int>(before.size()) >= alike;
  ASSERT_EQ(!rt.cpus().empty(), expect_pinned) << alike << " ranks given CPUs " << befores[rt.rank()];
  // What the threads may use now: the share where pinned, else what the launcher gave.
  const auto expected = expect_pinned ? rt.cpus() : before;
  EXPECT_EQ(ztrain::detail::allowed_cpus(), expected);
  std::vector<int> seen_by_new_thread;
  std::thread([&] { seen_by_new_thread = ztrain::detail::allowed_cpus(); }).join();
  EXPECT_EQ(seen_by_new_thread, expected);
  if (!expect_pinned) return;
  // The alike ranks' shares are disjoint and together make up the CPUs they were given.
  const auto shares = rt.world().all_gather_bytes(ztrain::detail::cpu_list_string(rt.cpus()));
  std::vector<int> together;
  for (int r = 0; r < rt.world_size(); ++r) {
    if (befores[r] != befores[rt.rank()]) continue;
    std::stringstream list(shares[r]);
    for (std::string range; std::getline(list, range, ',');) {
      const auto dash = range.find('-');
      const int first = std::stoi(range.substr(0, dash));
      const int last = dash == std::string::npos ? first : std::stoi(range.substr(dash + 1));
      for (int c = first; c <= last; ++c) together.push_back(c);
    }
  }
  std::sort(together.begin(), together.end());
  EXPECT_EQ(together, before);
}

namespace {
// Kilobytes of the kernel's transparent huge pages in this process.
int64_t anon_huge_kb() {
  std::ifstream in("/proc/self/smaps_rollup");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("AnonHugePages:", 0) == 0) return std::stoll(line.substr(14));
  }
  return -1;
}
bool thp_available() {
  std::ifstream in("/sys/kernel/mm/transparent_hugepage/enabled");
  std::string policy;
  std::getline(in, policy);
  return policy.find("[never]") == std::string::npos && !policy.empty();
}
}  // namespace

TEST(Init, LargeTensorsStartOnHugePages) {
  ASSERT_TRUE(ztrain::runtime().huge_pages());  // on by default
  constexpr int64_t kMiB = 1 << 20;
  for (int64_t bytes : {2 * kMiB, 3 * kMiB + 5, 64 * kMiB}) {
    auto t = torch::empty({bytes}, torch::kUInt8);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(t.data_ptr()) % (2 * kMiB), 0u) << bytes << " bytes";
  }
  auto small = torch::full({1000}, 3.0);  // below 2 MiB: libtorch's own allocator, as before
  EXPECT_EQ(small.sum().item<double>(), 3000.0);
  if (!thp_available()) GTEST_SKIP() << "transparent huge pages are off on this kernel";
  const auto before = anon_huge_kb();
  auto big = torch::ones({16 * kMiB}, torch::kUInt8);  // touched: the kernel backs it now
  const auto after = anon_huge_kb();
  EXPECT_GE(after - before, 8 * 1024) << "at least half of a 16 MiB tensor should sit on huge pages";
  EXPECT_EQ(big.sum().item<int64_t>(), 16 * kMiB);
}

TEST(Init, SecondInitIsAnError) {
  auto msg = error_message([] { ztrain::init_distributed(); });
  EXPECT_NE(msg.find("already called"), std::string::npos) << msg;
}

TEST(Init, DefaultGeneratorDiffersAcrossReplicasAndAgreesAcrossTensorParallelRanks) {
  auto& rt = ztrain::runtime();
  auto draw = torch::rand({4}, torch::kFloat64);
  auto all = rt.world().all_gather(draw).view({rt.world_size(), 4});
  for (int r = 0; r < rt.world_size(); ++r) {
    auto c = rt.topology().coord(r);
    bool same_replica = c.dp == rt.dp_rank() && c.pp == rt.pp_rank();
    EXPECT_EQ(torch::equal(all[r], draw), same_replica) << "rank " << r;
  }
}

TEST(Init, SumLossIsTheMeanOverDataParallelRanks) {
  auto& rt = ztrain::runtime();
  auto loss = torch::tensor(static_cast<float>(rt.dp_rank() + 1));
  auto mean = ztrain::sum_loss(loss);
  EXPECT_EQ(mean.dim(), 0);
  EXPECT_EQ(mean.scalar_type(), torch::kFloat32);
  EXPECT_FLOAT_EQ(mean.item<float>(), (rt.topology().dp_size() + 1) / 2.0f);
  auto msg = error_message([] { ztrain::sum_loss(torch::ones({2})); });
  EXPECT_NE(msg.find("expected a scalar loss"), std::string::npos) << msg;
}

TEST(Init, PrintRankPrintsOnOneRankOnly) {
  testing::internal::CaptureStdout();
  ztrain::print_rank("step ", 3, " loss ", 1.5);
  ztrain::print_on(ztrain::world_size() - 1, "last");
  auto out = testing::internal::GetCapturedStdout();
  std::string expected;
  if (ztrain::rank() == 0) expected += "step 3 loss 1.5\n";
  if (ztrain::rank() == ztrain::world_size() - 1) expected += "last\n";
  EXPECT_EQ(out, expected);
  ztrain::synchronize();
}

}  // namespace init_test
