// Point-to-point transfers, against inputs every rank can rebuild, on the runtime's device (a
// CUDA device in the .cuda variants: the MPI backend stages through the host). Registered for
// 2-4 ranks.
#include "test_util.h"

#include <ztrain/comm/communicator.h>

namespace point_to_point_test {

using ztrain::test::error_message;
using ztrain::test::tensors_equal;
using ztrain::test::kDtypes;
using ztrain::test::kSizes;

namespace {


ztrain::Communicator& world() { return ztrain::runtime().world(); }

torch::Tensor input_of(int rank, c10::ScalarType dtype, int64_t n) {
  auto v = (torch::arange(n, torch::kInt64) * 7 + rank * 13) % 16;
  return (dtype == torch::kBool ? (v % 3 == 0) : v.to(dtype)).to(ztrain::runtime().device());
}

std::string label(c10::ScalarType dtype, int64_t n) { return c10::str(dtype, " n=", n); }

}  // namespace

TEST(PointToPoint, SendRecvAroundTheRing) {
  auto& c = world();
  ASSERT_GE(c.size(), 2) << "point-to-point needs two ranks";
  const int next = (c.rank() + 1) % c.size(), prev = (c.rank() + c.size() - 1) % c.size();
  for (auto dtype : kDtypes) {
    for (auto n : kSizes) {
      auto out = input_of(c.rank(), dtype, n);
      auto in = torch::empty_like(out);
      // Even ranks send first, odd ranks receive first: no reliance on buffering.
      if (c.rank() % 2 == 0) {
        c.send(out, next, 3);
        c.recv(in, prev, 3);
      } else {
        c.recv(in, prev, 3);
        c.send(out, next, 3);
      }
      EXPECT_TRUE(tensors_equal(in, input_of(prev, dtype, n))) << label(dtype, n);
    }
  }
}

TEST(PointToPoint, RecvOfTheWrongSizeIsReported) {
  auto& c = world();
  ASSERT_GE(c.size(), 2) << "point-to-point needs two ranks";
  auto comm = c.dup("p2p-size");  // a mismatch may leave the communicator unusable
  const auto device = ztrain::runtime().device();
  if (comm->rank() == 0) comm->send(torch::ones({5}, device), 1, 9);
  if (comm->rank() == 1) {
    auto msg = error_message([&] { comm->recv(torch::empty({7}, device), 0, 9); });
    EXPECT_NE(msg.find("expected 7 elements"), std::string::npos) << msg;
    EXPECT_NE(msg.find("held 5"), std::string::npos) << msg;
  }
  c.barrier();
}

}  // namespace point_to_point_test
