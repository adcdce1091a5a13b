// Collectives against a reference every rank computes locally: rank r's input is a pure function
// of (r, dtype, size), so each rank knows every other rank's contribution. The tensors live on
// the runtime's device (a CUDA device in the .cuda variants, which the MPI backend stages
// through the host); host-shared buffers are host memory, so their tests run on the CPU only.
#include "test_util.h"

#include <ztrain/comm/communicator.h>
#include <ztrain/comm/host_shared.h>
#include <ztrain/comm/backend.h>
#include <ztrain/comm/mpi/transport.h>

namespace communicator_test {

using ztrain::ReduceOp;
using ztrain::test::error_message;
using ztrain::test::tensors_equal;
using ztrain::test::kDtypes;
using ztrain::test::kSizes;

namespace {


ztrain::Communicator& world() { return ztrain::runtime().world(); }
torch::Device device() { return ztrain::runtime().device(); }

// Integer-valued in [-8, 8) (in [0, 16) for uint8, 0/1 for bool): sums over four ranks stay
// exact in every dtype, so sum, max and min must match bit for bit whatever order the
// transport reduces in.
// `offset` starts the pattern part-way, so a slice of a long input can be rebuilt on its own.
// The pattern repeats every kPeriod elements (i * 7 % 16 every 16, i * i % 5 every 5), so inputs
// and references are one period, tiled: every rank builds every rank's input for its reference,
// which at 1 << 20 elements and four ranks would otherwise outweigh the collectives tested.
constexpr int64_t kPeriod = 80;

torch::Tensor tiled(const torch::Tensor& period, int64_t n, int64_t offset) {
  const int64_t start = offset % kPeriod;
  return period.repeat({(start + n) / kPeriod + 1}).narrow(0, start, n).contiguous();
}

torch::Tensor input_of(int rank, c10::ScalarType dtype, int64_t n, int64_t offset = 0) {
  auto i = torch::arange(kPeriod, torch::kInt64);
  auto v = (i * 7 + rank * 13 + (i * i) % 5) % 16;
  if (dtype == torch::kBool) return tiled((v + rank) % 3 == 0, n, offset);
  if (dtype != torch::kUInt8) v = v - 8;
  return tiled(v.to(dtype), n, offset);
}

// Random values for the rounding tests of 16-bit floats.
torch::Tensor random_of(int rank, c10::ScalarType dtype, int64_t n, int64_t = 0) {
  auto g = at::detail::createCPUGenerator(1234 + rank);
  return torch::randn({n}, g, torch::kFloat32).to(dtype);
}

torch::Tensor reference_reduce(c10::ScalarType dtype, int64_t n, ReduceOp op, int size,
                               torch::Tensor (*make)(int, c10::ScalarType, int64_t, int64_t) = input_of,
                               int64_t offset = 0) {
  if (make == input_of && n > kPeriod) {  // elementwise over periodic inputs: periodic
    return tiled(reference_reduce(dtype, kPeriod, op, size, input_of, 0), n, offset);
  }
  auto acc = make(0, dtype, n, offset).to(torch::kFloat64);
  for (int r = 1; r < size; ++r) {
    auto x = make(r, dtype, n, offset).to(torch::kFloat64);
    acc = op == ReduceOp::kMax ? torch::maximum(acc, x) : op == ReduceOp::kMin ? torch::minimum(acc, x) : acc + x;
  }
  if (op == ReduceOp::kAvg) acc = acc / size;
  if (dtype == torch::kBool) return acc.ne(0);  // max/sum: logical or; min: logical and
  if (dtype == torch::kUInt8) return acc.remainder(256).to(dtype);  // uint8 sums wrap, as in torch
  return acc.to(dtype);
}

std::vector<ReduceOp> ops_for(c10::ScalarType dtype) {
  if (c10::isFloatingType(dtype)) return {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMax, ReduceOp::kMin};
  return {ReduceOp::kSum, ReduceOp::kMax, ReduceOp::kMin};
}

// Where a check puts the buffers that peers read: left as allocated, or in host-shared memory.
using Place = torch::Tensor (*)(const torch::Tensor&);
torch::Tensor on_device(const torch::Tensor& t) { return t.to(device()); }
torch::Tensor host_shared(const torch::Tensor& t) { return ztrain::host_shared_empty(t.sizes(), t.options()).copy_(t); }
#define SKIP_UNLESS_ON_THE_HOST() \
  if (device().type() != torch::kCPU) GTEST_SKIP() << "host-shared buffers are host memory"

std::string label(c10::ScalarType dtype, int64_t n, const char* extra = "") {
  return c10::str(dtype, " n=", n, " ", extra);
}


// The checks take the communicator and sizes so they can run on the default communicator (MPI's
// collectives below the ring threshold, rings above it) and on ones forced to either path.
void check_all_reduce(ztrain::Communicator& c, const std::vector<int64_t>& sizes, Place place = on_device) {
  for (auto dtype : kDtypes) {
    for (auto n : sizes) {
      for (auto op : ops_for(dtype)) {
        auto t = place(input_of(c.rank(), dtype, n));
        c.all_reduce(t, op);
        auto expected = reference_reduce(dtype, n, op, c.size());
        // kAvg divides in the dtype: the quotient is exact to the dtype's rounding.
        double rtol = op == ReduceOp::kAvg && dtype == torch::kBFloat16 ? 1e-2
                      : op == ReduceOp::kAvg && dtype == torch::kFloat16 ? 1e-3 : 0;
        EXPECT_TRUE(tensors_equal(t, expected, rtol)) << c.name() << " " << label(dtype, n, ztrain::to_string(op));
      }
    }
  }
}

// `place` puts the input, `place_output` the output given to the first call; a second call
// allocates its output.
void check_all_gather(ztrain::Communicator& c, const std::vector<int64_t>& sizes, Place place = on_device,
                      Place place_output = on_device) {
  for (auto dtype : kDtypes) {
    for (auto n : sizes) {
      auto in = place(input_of(c.rank(), dtype, n));
      std::vector<torch::Tensor> parts;
      for (int r = 0; r < c.size(); ++r) parts.push_back(input_of(r, dtype, n));
      auto expected = torch::cat(parts);
      // Every element starts different from its result, so a slice left unwritten shows.
      auto out = place_output(dtype == torch::kBool ? expected.logical_not() : expected + 1);
      c.all_gather(in, out);
      EXPECT_TRUE(tensors_equal(out, expected)) << c.name() << " " << label(dtype, n);
      EXPECT_TRUE(tensors_equal(c.all_gather(in), expected)) << c.name() << " " << label(dtype, n, "allocating");
    }
  }
}

void check_reduce_scatter(ztrain::Communicator& c, const std::vector<int64_t>& sizes, Place place = on_device) {
  for (auto dtype : kDtypes) {
    for (auto n : sizes) {
      for (auto op : ops_for(dtype)) {
        auto in = place(input_of(c.rank(), dtype, n * c.size()));
        auto out = torch::empty({n}, in.options());
        c.reduce_scatter(in, out, op);
        auto expected = reference_reduce(dtype, n, op, c.size(), input_of, c.rank() * n);
        double rtol = op == ReduceOp::kAvg && dtype == torch::kBFloat16 ? 1e-2
                      : op == ReduceOp::kAvg && dtype == torch::kFloat16 ? 1e-3 : 0;
        EXPECT_TRUE(tensors_equal(out, expected, rtol)) << c.name() << " " << label(dtype, n, ztrain::to_string(op));
      }
    }
  }
}

}  // namespace

TEST(Communicator, AllReduceEveryDtypeSizeAndOp) { check_all_reduce(world(), kSizes); }
TEST(Communicator, AllGatherEveryDtypeAndSize) { check_all_gather(world(), kSizes); }
TEST(Communicator, ReduceScatterEveryDtypeSizeAndOp) { check_reduce_scatter(world(), kSizes); }

TEST(Communicator, RingsAtSmallAndUnevenSizes) {
  auto ring_owner = ztrain::make_world_communicator("mpi", {.name = "ring", .timeout = world().timeout(),
                                                       .ring_threshold_bytes = 1});
  auto& ring = *ring_owner;
  // The last two cut segments into 256 KiB chunks (65536 floats) whose counts differ between
  // neighbours at 2 and 3 ranks: 65536 and 65537 elements.
  const std::vector<int64_t> sizes = {0, 1, 2, 3, 17, 1023, 2 * 65536 + 1, 3 * 65536 + 1};
  check_all_reduce(ring, sizes);
  check_all_gather(ring, sizes);
  check_reduce_scatter(ring, sizes);
}

TEST(Communicator, MpiCollectivesAtLargeSizes) {
  auto mpi_owner = ztrain::make_world_communicator("mpi", {.name = "mpi", .timeout = world().timeout(),
                                                      .ring_threshold_bytes = INT64_MAX});
  auto& mpi = *mpi_owner;
  check_all_reduce(mpi, {1 << 20});
  check_all_gather(mpi, {1 << 20});
  check_reduce_scatter(mpi, {1 << 20});
}

TEST(Communicator, HostSharedBuffersAreReadInPlace) {
  SKIP_UNLESS_ON_THE_HOST();
  // From the first byte on, so that every size below takes the host-shared path; 1 << 20
  // elements exercise the streaming kernels.
  auto c_owner = ztrain::make_world_communicator("mpi", {.name = "shared", .timeout = world().timeout(),
                                                    .ring_threshold_bytes = 1});
  auto& c = *c_owner;
  const std::vector<int64_t> sizes = {0, 1, 2, 3, 17, 1023, 2 * 65536 + 1, 1 << 20};
  check_all_reduce(c, sizes, host_shared);
  check_all_gather(c, sizes, host_shared);                 // members read the shared inputs
  check_all_gather(c, sizes, on_device, host_shared);          // members write into the shared outputs
  check_all_gather(c, sizes, host_shared, host_shared);
  check_reduce_scatter(c, sizes, host_shared);
  // Every call with a shared buffer and data took the path, on every rank (none at all on one
  // rank): 7 sizes with data × (28 dtype-op pairs of all_reduce + 8 dtypes × (2 + 1 + 2)
  // all_gathers + 28 of reduce_scatter).
  EXPECT_EQ(c.stats().host_shared_calls, c.size() > 1 ? 7 * (28 + 40 + 28) : 0);
  // They met three times each in host-shared memory, not through the transport, and once each
  // the 7 × 8 allocating all_gathers of private inputs, which found no buffer shared by all; a
  // barrier meets once.
  const int64_t meetings = c.size() > 1 ? 3 * c.stats().host_shared_calls + 7 * 8 : 0;
  EXPECT_EQ(c.stats().host_meetings, meetings);
  c.barrier();
  EXPECT_EQ(c.stats().host_meetings, meetings + (c.size() > 1 ? 1 : 0));
}

TEST(Communicator, HostSharedPathNeedsEveryRanksBuffer) {
  SKIP_UNLESS_ON_THE_HOST();
  auto c_owner = ztrain::make_world_communicator("mpi", {.name = "mixed", .timeout = world().timeout(),
                                                    .ring_threshold_bytes = 1});
  auto& c = *c_owner;
  // Rank 0's buffers are private: every rank must take the transport, and agree on it.
  Place place = c.rank() == 0 ? on_device : host_shared;
  check_all_reduce(c, {1023}, place);
  check_all_gather(c, {1023}, place, place);
  check_reduce_scatter(c, {1023}, place);
  EXPECT_EQ(c.stats().host_shared_calls, 0);
  // Switched off, shared buffers everywhere take the transport too.
  auto off_owner = ztrain::make_world_communicator("mpi", {.name = "off", .timeout = world().timeout(),
                                                      .ring_threshold_bytes = 1, .host_shared = false});
  auto& off = *off_owner;
  check_all_reduce(off, {1023}, host_shared);
  off.barrier();
  EXPECT_EQ(off.stats().host_shared_calls, 0);
  EXPECT_EQ(off.stats().host_meetings, 0);
}

TEST(Communicator, HostSharedAllGatherInPlace) {
  SKIP_UNLESS_ON_THE_HOST();
  auto& c = world();
  const int64_t n = 1 << 18;  // 1 MiB per rank: above the default threshold
  auto out = ztrain::host_shared_empty({n * c.size()}, torch::kFloat32).fill_(-1);
  auto own = out.narrow(0, c.rank() * n, n);
  own.copy_(input_of(c.rank(), torch::kFloat32, n));
  auto before = c.stats().host_shared_calls;
  c.all_gather(own, out);
  std::vector<torch::Tensor> parts;
  for (int r = 0; r < c.size(); ++r) parts.push_back(input_of(r, torch::kFloat32, n));
  EXPECT_TRUE(tensors_equal(out, torch::cat(parts)));
  EXPECT_EQ(c.stats().host_shared_calls - before, c.size() > 1 ? 1 : 0);
}

TEST(Communicator, SixteenBitSumsRoundLikeTheirDtype) {
  // Random operands: each pairwise sum is formed in fp32 and rounded to nearest, so the result
  // is within a few units in the last place of the exact sum.
  auto& c = world();
  for (auto [dtype, tol] : {std::pair{torch::kBFloat16, 2e-2}, std::pair{torch::kFloat16, 3e-3}}) {
    for (auto n : kSizes) {
      auto t = random_of(c.rank(), dtype, n).to(device());
      c.all_reduce(t, ReduceOp::kSum);
      auto exact = reference_reduce(dtype, n, ReduceOp::kSum, c.size(), random_of).to(torch::kFloat64);
      auto err = (t.to(torch::kCPU, torch::kFloat64) - exact).abs();
      auto scale = torch::zeros_like(exact);
      for (int r = 0; r < c.size(); ++r) scale += random_of(r, dtype, n).to(torch::kFloat64).abs();
      EXPECT_TRUE((err <= tol * scale + 1e-6).all().item<bool>()) << label(dtype, n);
    }
  }
}

TEST(Communicator, AllGatherInPlaceFromOwnSlice) {
  auto& c = world();
  const int64_t n = 1023;
  auto out = torch::full({n * c.size()}, -1.0f, device());
  auto own = out.narrow(0, c.rank() * n, n);
  own.copy_(input_of(c.rank(), torch::kFloat32, n));
  c.all_gather(own, out);
  std::vector<torch::Tensor> parts;
  for (int r = 0; r < c.size(); ++r) parts.push_back(input_of(r, torch::kFloat32, n));
  EXPECT_TRUE(tensors_equal(out, torch::cat(parts)));
}

TEST(Communicator, ReduceScatterOfFlagsIsLogical) {
  auto& c = world();
  auto flags = on_device(input_of(c.rank(), torch::kBool, 17 * c.size()));
  auto any = c.reduce_scatter(flags, ReduceOp::kMax);
  auto expected = input_of(0, torch::kBool, 17 * c.size());
  for (int r = 1; r < c.size(); ++r) expected = expected.logical_or(input_of(r, torch::kBool, 17 * c.size()));
  EXPECT_TRUE(tensors_equal(any, expected.narrow(0, c.rank() * 17, 17)));
}

TEST(Communicator, BroadcastFromEveryRoot) {
  auto& c = world();
  for (auto dtype : kDtypes) {
    for (auto n : kSizes) {
      for (int root = 0; root < c.size(); ++root) {
        auto t = on_device(input_of(c.rank(), dtype, n));
        c.broadcast(t, root);
        EXPECT_TRUE(tensors_equal(t, input_of(root, dtype, n))) << label(dtype, n) << " root " << root;
      }
    }
  }
}

TEST(Communicator, BytesAndObjects) {
  auto& c = world();
  auto mine = std::string(c.rank() * 3, static_cast<char>('a' + c.rank()));
  auto all = c.all_gather_bytes(mine);
  ASSERT_EQ(static_cast<int>(all.size()), c.size());
  for (int r = 0; r < c.size(); ++r) EXPECT_EQ(all[r], std::string(r * 3, static_cast<char>('a' + r)));
  for (int root = 0; root < c.size(); ++root) {
    EXPECT_EQ(c.broadcast_bytes(c.rank() == root ? "hello from the root" : "", root), "hello from the root");
  }
  struct Meta { int64_t step; double lr; };
  auto metas = c.all_gather_object(Meta{c.rank() * 10, 0.5 * c.rank()});
  for (int r = 0; r < c.size(); ++r) {
    EXPECT_EQ(metas[r].step, r * 10);
    EXPECT_EQ(metas[r].lr, 0.5 * r);
  }
  EXPECT_EQ(c.broadcast_object(Meta{c.rank() + 100, 1.0}, c.size() - 1).step, c.size() - 1 + 100);
  EXPECT_EQ(c.all_reduce_scalar(static_cast<int64_t>(c.rank() + 1)), static_cast<int64_t>(c.size() * (c.size() + 1) / 2));
  EXPECT_EQ(c.all_reduce_scalar(static_cast<double>(c.rank()), ReduceOp::kMax), c.size() - 1.0);
}

TEST(Communicator, StatsCountBytesHandedToTheTransport) {
  auto& c = world();
  auto comm = c.dup("stats");
  comm->all_reduce(torch::zeros({100}, device()));
  comm->all_gather(torch::zeros({10}, device()));
  comm->reduce_scatter(torch::zeros({8 * comm->size()}, torch::dtype(torch::kFloat64).device(device())));
  auto s = comm->stats();
  EXPECT_EQ(s.all_reduce_bytes, 400);
  EXPECT_EQ(s.all_gather_bytes, 40);
  EXPECT_EQ(s.reduce_scatter_bytes, 64 * comm->size());
  EXPECT_EQ(s.total_bytes(), 400 + 40 + 64 * comm->size());
  comm->reset_stats();
  EXPECT_EQ(comm->stats().total_bytes(), 0);
}

TEST(Communicator, SplitFormsGroupsByColor) {
  auto& c = world();
  auto half = c.split(c.rank() % 2, c.rank(), "parity");
  EXPECT_EQ(half->size(), (c.size() + 1 - c.rank() % 2) / 2);
  EXPECT_EQ(half->world_rank_of(half->rank()), c.rank());
  auto t = torch::tensor({static_cast<int64_t>(c.rank())}, device());
  half->all_reduce(t);
  int64_t expected = 0;
  for (int r = c.rank() % 2; r < c.size(); r += 2) expected += r;
  EXPECT_EQ(t.item<int64_t>(), expected);
}

// A transport with nothing but point-to-point transfers (MPI's own collectives switched off):
// the communicator builds every collective from them — what a new backend gets without
// writing an algorithm.
TEST(Communicator, EveryCollectiveFromPointToPointAlone) {
  ztrain::Communicator c(ztrain::MpiTransport::adopt(MPI_COMM_WORLD, {.native_collectives = false}),
                         {.name = "p2p", .timeout = world().timeout()});
  // The ring sizes are the world tests' (the rings are point-to-point already); these are the
  // sizes a backend's own collectives would otherwise carry.
  const std::vector<int64_t> sizes = {0, 1, 17, 1023, 70000};
  check_all_reduce(c, sizes);
  check_all_gather(c, sizes);
  check_reduce_scatter(c, sizes);
  for (auto dtype : kDtypes) {
    for (int root = 0; root < c.size(); ++root) {
      auto t = on_device(input_of(c.rank(), dtype, 1023));
      c.broadcast(t, root);
      EXPECT_TRUE(tensors_equal(t, input_of(root, dtype, 1023))) << label(dtype, 1023) << " root " << root;
    }
  }
  c.barrier();
  const auto all = c.all_gather_bytes(std::string(c.rank() + 1, 'x'));
  for (int r = 0; r < c.size(); ++r) EXPECT_EQ(all[r], std::string(r + 1, 'x'));
  EXPECT_EQ(c.broadcast_bytes(c.rank() == 0 ? "root" : "", 0), "root");
  auto pairs = c.split(c.rank() / 2, c.rank(), "p2p.pairs");
  EXPECT_EQ(pairs->all_reduce_scalar(int64_t{1}), std::min(2, c.size() - c.rank() / 2 * 2));
  EXPECT_EQ(c.stats().host_shared_calls, 0);
}

// ---- bad input: every rank makes the same mistake, so nobody is left waiting --------------

TEST(CommunicatorErrors, NonContiguousTensorIsRejectedNotCopied) {
  auto t = torch::zeros({4, 6}).t();
  auto msg = error_message([&] { world().all_reduce(t); });
  EXPECT_NE(msg.find("must be contiguous"), std::string::npos) << msg;
  EXPECT_NE(msg.find("all_reduce"), std::string::npos) << msg;
}

TEST(CommunicatorErrors, WrongOutputSizeIsRejected) {
  auto& c = world();
  auto msg = error_message([&] { c.all_gather(torch::zeros({5}), torch::zeros({5 * c.size() + 1})); });
  EXPECT_NE(msg.find("output must hold"), std::string::npos) << msg;
  msg = error_message([&] { c.reduce_scatter(torch::zeros({5 * c.size() + 1}), torch::zeros({5})); });
  EXPECT_NE(msg.find("input must hold"), std::string::npos) << msg;
  msg = error_message([&] { c.all_gather(torch::zeros({5}), torch::zeros({5 * c.size()}, torch::kFloat64)); });
  EXPECT_NE(msg.find("input is Float but output is Double"), std::string::npos) << msg;
  if (c.size() > 1) {
    msg = error_message([&] { c.reduce_scatter(torch::zeros({5 * c.size() + 1})); });
    EXPECT_NE(msg.find("does not divide"), std::string::npos) << msg;
  }
  if (device().type() != torch::kCPU) {
    msg = error_message([&] { c.all_gather(torch::zeros({5}, device()), torch::zeros({5 * c.size()})); });
    EXPECT_NE(msg.find("but output on cpu"), std::string::npos) << msg;
  }
}

TEST(CommunicatorErrors, UnsupportedRequestsAreRejected) {
  auto& c = world();
  auto msg = error_message([&] { c.all_reduce(torch::zeros({3}, torch::kInt32), ReduceOp::kAvg); });
  EXPECT_NE(msg.find("kAvg needs a floating dtype"), std::string::npos) << msg;
  msg = error_message([&] { c.all_reduce(torch::zeros({3}, torch::kComplexFloat)); });
  EXPECT_NE(msg.find("is not supported"), std::string::npos) << msg;
  msg = error_message([&] { c.broadcast(torch::zeros({3}), c.size()); });
  EXPECT_NE(msg.find("is not a rank"), std::string::npos) << msg;
  msg = error_message([&] { c.send(torch::zeros({3}), c.rank()); });
  EXPECT_NE(msg.find("must be another rank"), std::string::npos) << msg;
  msg = error_message([&] { c.all_reduce(torch::Tensor()); });
  EXPECT_NE(msg.find("undefined"), std::string::npos) << msg;
  // The communicator is still usable after rejected input.
  auto t = torch::ones({2}, device());
  c.all_reduce(t);
  EXPECT_EQ(t[0].item<float>(), static_cast<float>(c.size()));
}

}  // namespace communicator_test
