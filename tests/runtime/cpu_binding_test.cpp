// Shares of a host's CPUs for its ranks (src/runtime/cpu_binding.h): cut by physical core so a
// core's hardware threads stay together, by CPU where the cores are fewer than the shares,
// disjoint and covering every CPU; none where the CPUs are fewer than the shares.
#include "test_util.h"

#include "../../src/runtime/cpu_binding.h"

#include <atomic>
#include <numeric>
#include <set>
#include <thread>

namespace cpu_binding_test {

using ztrain::detail::cpu_list_string;

// Share `index` of `shares`, none where there is no such share.
std::vector<int> cpu_share(const std::vector<int>& cpus, int index, int shares, const std::function<int(int)>& core) {
  const auto all = ztrain::detail::cpu_shares(cpus, shares, core);
  return index < static_cast<int>(all.size()) ? all[index] : std::vector<int>{};
}

std::vector<int> range(int first, int last) {  // [first, last]
  std::vector<int> v(last - first + 1);
  std::iota(v.begin(), v.end(), first);
  return v;
}

std::vector<int> joined(std::vector<int> a, const std::vector<int>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

TEST(CpuBinding, HardwareThreadsOfACoreStayTogether) {
  // 8 cores of 2 threads, the kernel's usual numbering: CPU c and c + 8 share core c.
  const auto cpus = range(0, 15);
  auto core = [](int cpu) { return cpu % 8; };
  EXPECT_EQ(cpu_share(cpus, 0, 2, core), joined(range(0, 3), range(8, 11)));
  EXPECT_EQ(cpu_share(cpus, 1, 2, core), joined(range(4, 7), range(12, 15)));
  // 8 cores in 3 shares: 2, 3 and 3 cores.
  EXPECT_EQ(cpu_share(cpus, 0, 3, core), (std::vector<int>{0, 1, 8, 9}));
  EXPECT_EQ(cpu_share(cpus, 1, 3, core), (std::vector<int>{2, 3, 4, 10, 11, 12}));
  EXPECT_EQ(cpu_share(cpus, 2, 3, core), (std::vector<int>{5, 6, 7, 13, 14, 15}));
}

TEST(CpuBinding, FewerCoresThanSharesCutsByCpu) {
  const auto cpus = range(0, 3);
  auto core = [](int cpu) { return cpu / 2; };  // 2 cores of 2 threads
  for (int i = 0; i < 4; ++i) EXPECT_EQ(cpu_share(cpus, i, 4, core), std::vector<int>{i});
  EXPECT_EQ(cpu_share(cpus, 1, 2, core), (std::vector<int>{2, 3}));
}

TEST(CpuBinding, FewerCpusThanSharesGivesNone) {
  auto core = [](int cpu) { return cpu; };
  EXPECT_TRUE(cpu_share(range(0, 1), 0, 3, core).empty());
  EXPECT_TRUE(cpu_share({}, 0, 1, core).empty());
  EXPECT_TRUE(cpu_share(range(0, 3), 4, 4, core).empty());  // no such share
}

TEST(CpuBinding, CpusOfUnknownCoreCountAsCoresOfTheirOwn) {
  const std::vector<int> cpus{2, 3, 6, 7};
  EXPECT_EQ(cpu_share(cpus, 0, 2, [](int) { return -1; }), (std::vector<int>{2, 3}));
  EXPECT_EQ(cpu_share(cpus, 1, 2, [](int) { return -1; }), (std::vector<int>{6, 7}));
}

TEST(CpuBinding, SharesAreDisjointAndCoverEveryCpu) {
  for (int n : {1, 2, 3, 5, 8, 12, 16, 56}) {
    for (int threads_per_core : {1, 2}) {
      const auto cpus = range(100, 100 + n * threads_per_core - 1);  // not starting at 0
      auto core = [&](int cpu) { return (cpu - 100) % n; };
      for (int m = 1; m <= n * threads_per_core; ++m) {
        std::set<int> seen;
        size_t least = cpus.size(), most = 0;
        for (int i = 0; i < m; ++i) {
          const auto share = cpu_share(cpus, i, m, core);
          ASSERT_FALSE(share.empty()) << n << " cores, " << m << " shares";
          least = std::min(least, share.size());
          most = std::max(most, share.size());
          for (int c : share) EXPECT_TRUE(seen.insert(c).second) << c << " twice, " << n << " cores, " << m << " shares";
        }
        EXPECT_EQ(seen.size(), cpus.size()) << n << " cores, " << m << " shares";
        EXPECT_LE(most - least, static_cast<size_t>(threads_per_core)) << n << " cores, " << m << " shares";
      }
    }
  }
}

TEST(CpuBinding, ListsReadAsTheKernelWritesThem) {
  EXPECT_EQ(cpu_list_string(joined(range(0, 3), range(8, 11))), "0-3,8-11");
  EXPECT_EQ(cpu_list_string({5}), "5");
  EXPECT_EQ(cpu_list_string({1, 3, 4}), "1,3-4");
  EXPECT_EQ(cpu_list_string({}), "");
}

TEST(CpuBinding, PinningCoversThreadsRunningAndThreadsToCome) {
  const auto before = ztrain::detail::allowed_cpus();
  ASSERT_FALSE(before.empty());
  std::vector<int> seen_by_old;
  std::atomic<bool> pinned{false};
  std::thread old([&] {
    while (!pinned) std::this_thread::yield();
    seen_by_old = ztrain::detail::allowed_cpus();
  });
  std::string error;
  ASSERT_TRUE(ztrain::detail::pin_process_threads({before.back()}, error)) << error;
  pinned = true;
  old.join();
  std::vector<int> seen_by_new;
  std::thread([&] { seen_by_new = ztrain::detail::allowed_cpus(); }).join();
  EXPECT_EQ(ztrain::detail::allowed_cpus(), std::vector<int>{before.back()});
  EXPECT_EQ(seen_by_old, std::vector<int>{before.back()});
  EXPECT_EQ(seen_by_new, std::vector<int>{before.back()});
  ASSERT_TRUE(ztrain::detail::pin_process_threads(before, error)) << error;
  EXPECT_EQ(ztrain::detail::allowed_cpus(), before);
}

}  // namespace cpu_binding_test
