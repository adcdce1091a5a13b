// Options that the environment turns off: run with ZTRAIN_HUGE_PAGES=0 (tests/runtime/CMakeLists.txt).
#include "test_util.h"

#include "../../src/runtime/host_allocator.h"

namespace init_env_test {

TEST(InitEnvironment, HugePagesOffWhenZtrainHugePagesIs0) {
  auto& rt = ztrain::init_distributed({.threads = 1});
  EXPECT_FALSE(rt.huge_pages());
  // Large tensors still go through the allocator's cache: a freed block serves the next one.
  const auto before = ztrain::detail::host_allocator_stats();
  { auto freed = torch::empty({3 << 20}, torch::kUInt8); }
  auto again = torch::empty({3 << 20}, torch::kUInt8);
  EXPECT_GE(ztrain::detail::host_allocator_stats().hits, before.hits + 1);
}

}  // namespace init_env_test
