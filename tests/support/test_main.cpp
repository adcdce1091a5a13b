// The main() of every test program: initialises the runtime, checks that the launcher gave the
// world size the test was registered for, and keeps the output of ranks other than 0 to their
// failures, each line prefixed with the rank. With ZTRAIN_TEST_NO_INIT=1 (tests registered
// NO_INIT: tests of initialisation) it runs the tests and nothing else.
#include "test_util.h"

#include <gtest/gtest.h>

#include <cstdlib>
#include <iostream>
#include <string>

namespace {

class RankFailurePrinter : public testing::EmptyTestEventListener {
 public:
  explicit RankFailurePrinter(int rank) : rank_(rank) {}
  void OnTestPartResult(const testing::TestPartResult& r) override {
    if (r.failed()) {
      std::cerr << "[rank " << rank_ << "] " << (r.file_name() ? r.file_name() : "?") << ":" << r.line_number()
                << ": " << r.summary() << std::endl;
    }
  }

 private:
  int rank_;
};

}  // namespace

int main(int argc, char** argv) {
  testing::InitGoogleTest(&argc, argv);
  try {
    if (const char* no_init = std::getenv("ZTRAIN_TEST_NO_INIT"); no_init && std::string(no_init) == "1") {
      return RUN_ALL_TESTS();
    }
    ztrain::init_distributed();
    const int expected = ztrain::test::expected_world_size();
    if (ztrain::world_size() != expected) {
      std::cerr << "test registered for " << expected << " ranks but launched with " << ztrain::world_size()
                << "; run it through ctest or with mpirun -np " << expected << std::endl;
      return 1;
    }
    if (ztrain::rank() != 0) {
      auto& listeners = testing::UnitTest::GetInstance()->listeners();
      delete listeners.Release(listeners.default_result_printer());
      listeners.Append(new RankFailurePrinter(ztrain::rank()));
    }
    return RUN_ALL_TESTS();
  } catch (const std::exception& e) {
    std::cerr << "test main: " << e.what() << std::endl;
    return 1;
  }
}
