// Options that the environment turns off: run with ZTRAIN_HUGE_PAGES=0 (tests/runtime/CMakeLists.txt).
#include "test_util.h"

namespace init_env_test {

TEST(InitEnvironment, HugePagesOffWhenZtrainHugePagesIs0) {
  auto& rt = ztrain::init_distributed({.threads = 1});
  EXPECT_FALSE(rt.huge_pages());
  // Large tensors still come from the allocator's cache: the same block again after a free.
  const void* first = torch::empty({3 << 20}, torch::kUInt8).data_ptr();
  EXPECT_EQ(torch::empty({3 << 20}, torch::kUInt8).data_ptr(), first);
}

}  // namespace init_env_test
