#pragma once
// Helpers shared by the tests.

#include <ztrain/ztrain.h>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <string_view>
#include <vector>

namespace ztrain::test {

/// The sizes and dtypes every communication test covers: empty, one element, odd, tail-length
/// and large (which takes the ring algorithms).
inline const std::vector<int64_t> kSizes = {0, 1, 17, 1023, 1 << 20};
inline const std::vector<c10::ScalarType> kDtypes = {torch::kFloat32, torch::kFloat64, torch::kBFloat16,
                                                     torch::kFloat16, torch::kInt32,   torch::kInt64,
                                                     torch::kUInt8,   torch::kBool};

/// A fresh directory path under the temporary directory, named by rank 0 from `stem` and its
/// process id and the same on every rank (collective over the world); not created.
inline std::string shared_temp_dir(const std::string& stem) {
  std::string dir;
  if (runtime().rank() == 0) {
    dir = (std::filesystem::temp_directory_path() / c10::str("ztrain_", stem, "_", ::getpid())).string();
    std::filesystem::remove_all(dir);
  }
  return runtime().world().broadcast_bytes(dir, 0);
}

/// Whether this process runs a test of one of `suites` (a TEST_P suite under any instantiation
/// prefix). A directory's tests share one program, each launch selecting its own file's suites
/// (cmake/ZtrainTesting.cmake): a file's global environment sets up only for its own tests.
inline bool runs_any_suite(const std::vector<std::string_view>& suites) {
  const auto* unit = ::testing::UnitTest::GetInstance();
  for (int i = 0; i < unit->total_test_suite_count(); ++i) {
    const auto* suite = unit->GetTestSuite(i);
    if (suite->test_to_run_count() == 0) continue;
    const std::string_view name = suite->name();
    for (const auto wanted : suites) {
      if (name == wanted || (name.ends_with(wanted) && name.size() > wanted.size() &&
                             name[name.size() - wanted.size() - 1] == '/')) {
        return true;
      }
    }
  }
  return false;
}

/// The world size the test was registered for (ZTRAIN_TEST_WORLD_SIZE, set by ztrain_add_test).
inline int expected_world_size() {
  const char* v = std::getenv("ZTRAIN_TEST_WORLD_SIZE");
  return v ? std::atoi(v) : 1;
}

/// Mappings in this process of other processes' host-shared blocks (comm/host_shared.h): their
/// memory files are named after their owner's pid; peers map the owner's directory of blocks
/// read-only and its blocks writable.
inline int peer_host_shared_mappings() {
  const std::string own = "ztrain-host-shared-" + std::to_string(getpid()) + " ";
  std::ifstream maps("/proc/self/maps");
  int n = 0;
  for (std::string line; std::getline(maps, line);) {
    n += line.find("ztrain-host-shared-") != std::string::npos && line.find(own) == std::string::npos &&
         line.find(" rw-s ") != std::string::npos;
  }
  return n;
}

/// Runs `fn` and returns the message of the ztrain::Error it throws; fails the test if it
/// throws nothing or something else.
template <class F>
std::string error_message(F&& fn) {
  try {
    fn();
  } catch (const ztrain::Error& e) {
    return e.what();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "expected ztrain::Error, got another exception: " << e.what();
    return {};
  }
  ADD_FAILURE() << "expected ztrain::Error, nothing was thrown";
  return {};
}

/// Element-wise equality with a readable report of the first difference.
inline ::testing::AssertionResult tensors_equal(const torch::Tensor& a, const torch::Tensor& b,
                                                double rtol = 0, double atol = 0) {
  if (a.sizes() != b.sizes()) {
    return ::testing::AssertionFailure() << "shapes differ: " << a.sizes() << " vs " << b.sizes();
  }
  if (a.scalar_type() != b.scalar_type()) {
    return ::testing::AssertionFailure() << "dtypes differ: " << a.scalar_type() << " vs " << b.scalar_type();
  }
  if (a.numel() == 0) return ::testing::AssertionSuccess();
  auto x = a.to(torch::kCPU, torch::kFloat64).reshape(-1), y = b.to(torch::kCPU, torch::kFloat64).reshape(-1);
  auto bad = (x - y).abs() > (atol + rtol * y.abs());
  if (a.scalar_type() == torch::kBool) bad = a.cpu().reshape(-1) != b.cpu().reshape(-1);
  if (!bad.any().item<bool>()) return ::testing::AssertionSuccess();
  auto i = bad.nonzero()[0].item<int64_t>();
  return ::testing::AssertionFailure() << bad.sum().item<int64_t>() << " of " << a.numel()
                                       << " elements differ; first at " << i << ": " << x[i].item<double>()
                                       << " vs " << y[i].item<double>();
}

}  // namespace ztrain::test
