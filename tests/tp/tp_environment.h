#pragma once
// The runtime of the tensor-parallel tests: tp size ZTRAIN_TEST_TP (default: the whole world).

#include "test_util.h"

namespace ztrain::test {

inline int requested_tp() {
  const char* v = std::getenv("ZTRAIN_TEST_TP");
  return v ? std::atoi(v) : expected_world_size();
}

/// Initialises the runtime for the tests of `suites` when this launch runs some.
class TensorParallelEnvironment : public ::testing::Environment {
 public:
  explicit TensorParallelEnvironment(std::vector<std::string_view> suites) : suites_(std::move(suites)) {}
  void SetUp() override {
    if (!runs_any_suite(suites_)) return;
    init_distributed({.seed = 5, .tp_size = requested_tp()});
    ASSERT_EQ(world_size(), expected_world_size()) << "launch with mpirun -np " << expected_world_size();
    ASSERT_EQ(runtime().tp().size(), requested_tp());
  }

 private:
  std::vector<std::string_view> suites_;
};

}  // namespace ztrain::test
