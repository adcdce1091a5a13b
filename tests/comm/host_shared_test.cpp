// Host-shared memory: allocation, the streaming kernels against scalar references, and peers
// letting go of blocks their owner freed. The collectives on host-shared buffers are checked
// against references in communicator_test.
#include "test_util.h"

#include "../../src/comm/host_shared_detail.h"
#include "../../src/host_memory.h"

#include <ztrain/comm/host_shared.h>

#include <numeric>

namespace host_shared_test {

using ztrain::test::error_message;
using ztrain::test::peer_host_shared_mappings;

namespace {

const std::vector<size_t> kCopyBytes = {0, 1, 63, 64, 4095, (256 << 10) - 1, (256 << 10) + 13, (1 << 20) + 77,
                                        (4 << 20) + 4096 * 3 + 5};

}  // namespace

TEST(HostShared, TensorsAreContiguousCpuAndRecognised) {
  auto t = ztrain::host_shared_empty({3, 5}, torch::dtype(torch::kFloat64).requires_grad(true));
  EXPECT_EQ(t.sizes(), (std::vector<int64_t>{3, 5}));
  EXPECT_EQ(t.scalar_type(), torch::kFloat64);
  EXPECT_TRUE(t.is_contiguous());
  EXPECT_TRUE(t.requires_grad());
  EXPECT_TRUE(ztrain::is_host_shared(t));
  EXPECT_TRUE(ztrain::is_host_shared(t.detach().narrow(0, 1, 2)));
  EXPECT_FALSE(ztrain::is_host_shared(torch::empty({3, 5})));
  EXPECT_FALSE(ztrain::is_host_shared(ztrain::host_shared_empty({0})));
  EXPECT_FALSE(ztrain::is_host_shared(torch::Tensor()));
  auto msg = error_message([] { ztrain::host_shared_empty({2}, torch::device(torch::kCUDA)); });
  EXPECT_NE(msg.find("CPU memory"), std::string::npos) << msg;
}

TEST(HostShared, FreedBlocksAreNoLongerRecognised) {
  const void* data = nullptr;
  {
    auto t = ztrain::host_shared_empty({1024});
    data = t.data_ptr();
    EXPECT_TRUE(ztrain::detail::find_host_shared(data, 4096).has_value());
    EXPECT_FALSE(ztrain::detail::find_host_shared(data, 4097).has_value());  // past the block
  }
  EXPECT_FALSE(ztrain::detail::find_host_shared(data, 1).has_value());
}

TEST(HostShared, StreamCopyEqualsMemcpy) {
  for (size_t bytes : kCopyBytes) {
    for (size_t misalign : {0, 1, 60}) {
      std::vector<uint8_t> src(bytes + 64), dst(bytes + 64, 0xAB);
      std::iota(src.begin(), src.end(), static_cast<uint8_t>(bytes));
      ztrain::detail::stream_copy(dst.data() + misalign, src.data() + 3, bytes);
      ASSERT_EQ(std::memcmp(dst.data() + misalign, src.data() + 3, bytes), 0) << bytes << " bytes at +" << misalign;
      EXPECT_EQ(dst[misalign + bytes], 0xAB) << "wrote past the end: " << bytes << " bytes at +" << misalign;
      if (misalign > 0) {
        EXPECT_EQ(dst[misalign - 1], 0xAB) << "wrote before the start";
      }
    }
  }
}

TEST(HostShared, StreamCopyToAllEqualsMemcpyIntoEach) {
  const size_t kMisalign[] = {0, 1, 60};  // destination d starts at kMisalign[d]
  for (size_t bytes : kCopyBytes) {
    for (int n : {1, 2, 3}) {
      std::vector<uint8_t> src(bytes + 64);
      std::iota(src.begin(), src.end(), static_cast<uint8_t>(bytes));
      std::vector<std::vector<uint8_t>> dsts(n, std::vector<uint8_t>(bytes + 64, 0xAB));
      std::vector<char*> ptrs;
      for (int d = 0; d < n; ++d) ptrs.push_back(reinterpret_cast<char*>(dsts[d].data() + kMisalign[d]));
      ztrain::detail::stream_copy_to_all(ptrs.data(), n, reinterpret_cast<const char*>(src.data() + 3), bytes);
      for (int d = 0; d < n; ++d) {
        const size_t at = kMisalign[d];
        ASSERT_EQ(std::memcmp(dsts[d].data() + at, src.data() + 3, bytes), 0) << bytes << " bytes into " << d;
        EXPECT_EQ(dsts[d][at + bytes], 0xAB) << "wrote past the end: " << bytes << " bytes into " << d;
        if (at > 0) {
          EXPECT_EQ(dsts[d][at - 1], 0xAB) << "wrote before the start of " << d;
        }
      }
    }
  }
}

// A divisor (kAvg's mean) divides each sum as libtorch's division by a scalar does.
TEST(HostShared, SumsEqualTheScalarSumInOrder) {
  for (int n : {1, 2, 3, 4}) {
    for (int divisor : {1, 2, 3}) {
      for (int64_t count : {0, 1, 3, 5, 17, 65536 + 3, 262144 + 1}) {
        for (int64_t misalign : {0, 1, 3}) {
          std::vector<torch::Tensor> srcs;
          std::vector<const float*> ptrs;
          for (int k = 0; k < n; ++k) {
            // Values of very different magnitudes: any other summation order rounds differently.
            srcs.push_back(torch::randn({count}, at::detail::createCPUGenerator(k)) * std::pow(1e3, k));
            ptrs.push_back(srcs.back().data_ptr<float>());
          }
          auto expected = torch::empty({count});
          for (int64_t i = 0; i < count; ++i) {
            float acc = ptrs[0][i];
            for (int k = 1; k < n; ++k) acc += ptrs[k][i];
            expected.data_ptr<float>()[i] = acc;
          }
          if (divisor > 1) expected.div_(divisor);
          auto dst = torch::empty({count + misalign}).narrow(0, misalign, count);
          ztrain::detail::stream_sum(dst.data_ptr<float>(), ptrs.data(), n, count, divisor);
          ASSERT_TRUE(torch::equal(dst, expected))
              << n << " sources / " << divisor << ", " << count << " floats at +" << misalign;
          // In place into the first source, as reduce_scatter into its own slice of the input.
          auto first = srcs[0].clone();
          ptrs[0] = first.data_ptr<float>();
          ztrain::detail::stream_sum(first.data_ptr<float>(), ptrs.data(), n, count, divisor);
          ASSERT_TRUE(torch::equal(first, expected)) << "in place: " << n << " sources, " << count << " floats";
          // Into every source, as all_reduce stores its segment's sum to every member.
          std::vector<torch::Tensor> all;
          std::vector<float*> buffers;
          for (const auto& src : srcs) {
            all.push_back(torch::empty({count + misalign}).narrow(0, misalign, count).copy_(src));
            buffers.push_back(all.back().data_ptr<float>());
          }
          ztrain::detail::sum_to_all(buffers.data(), n, count, divisor);
          for (int k = 0; k < n; ++k) {
            ASSERT_TRUE(torch::equal(all[k], expected)) << "to all, buffer " << k << ": " << n << " sources, " << count;
          }
        }
      }
    }
  }
}

// bfloat16 sums round after every addition, as libtorch's add of two bfloat16 tensors: the
// kernels equal a chain of at::add bit for bit, and the means a division of that by a scalar,
// ties to even, infinities and NaN (as 0x7FC0) among the values, on every path (short, lines,
// streamed, in place, to all).
TEST(HostShared, BFloat16SumsEqualLibtorchsAddInOrder) {
  using ztrain::detail::stream_sum;
  using ztrain::detail::sum_to_all;
  using BF = c10::BFloat16;
  const auto bf16 = torch::dtype(torch::kBFloat16);
  for (int n : {1, 2, 3}) {
    for (int divisor : {1, 2, 3}) {
      for (int64_t count : {0, 1, 7, 33, 65536 + 5, 262144 + 3}) {
        for (int64_t misalign : {0, 1}) {
          std::vector<torch::Tensor> srcs;
          std::vector<const BF*> ptrs;
          for (int k = 0; k < n; ++k) {
            auto gen = at::detail::createCPUGenerator(10 + k);
            auto src = (torch::randn({count}, gen) * std::pow(300.0, k)).to(torch::kBFloat16);
            if (count > 40) {
              // Ties: 1 + 2^-8 is halfway between two bfloat16 (1 and 1 + 2^-7) in a sum with 1.
              src.narrow(0, 0, 8).fill_(k == 0 ? 1.0 : 0.00390625);
              src[9] = k == 0 ? std::numeric_limits<float>::infinity() : 1.0f;
              src[10] = k == n - 1 ? std::nanf("") : 2.0f;
              src[11] = k == 0 ? 3.0e38f : 3.0e38f;  // overflows to infinity
            }
            srcs.push_back(src);
            ptrs.push_back(srcs.back().data_ptr<BF>());
          }
          auto expected = srcs[0].clone();
          for (int k = 1; k < n; ++k) expected = at::add(expected, srcs[k]);
          if (divisor > 1) expected = expected.div(divisor);
          // Every NaN as the kernels write it (libtorch's own NaN bits differ between its paths).
          expected.masked_fill_(expected.isnan(), std::nanf(""));
          const auto same = [&](const torch::Tensor& got) {
            return torch::equal(got.view(torch::kInt16), expected.view(torch::kInt16));
          };
          auto dst = torch::empty({count + misalign}, bf16).narrow(0, misalign, count);
          stream_sum(dst.data_ptr<BF>(), ptrs.data(), n, count, divisor);
          ASSERT_TRUE(same(dst)) << n << " sources / " << divisor << ", " << count << " values at +" << misalign;
          auto first = srcs[0].clone();
          ptrs[0] = first.data_ptr<BF>();
          stream_sum(first.data_ptr<BF>(), ptrs.data(), n, count, divisor);
          ASSERT_TRUE(same(first)) << "in place: " << n << " sources, " << count << " values";
          std::vector<torch::Tensor> all;
          std::vector<BF*> buffers;
          for (const auto& src : srcs) {
            all.push_back(torch::empty({count + misalign}, bf16).narrow(0, misalign, count).copy_(src));
            buffers.push_back(all.back().data_ptr<BF>());
          }
          sum_to_all(buffers.data(), n, count, divisor);
          for (int k = 0; k < n; ++k) {
            ASSERT_TRUE(same(all[k])) << "to all, buffer " << k << ": " << n << " sources, " << count;
          }
        }
      }
    }
  }
}

TEST(HostShared, FreedBlocksOfTheSameSizeAreReused) {
  const void* first = nullptr;
  { first = ztrain::host_shared_empty({1000}).data_ptr(); }
  auto again = ztrain::host_shared_empty({1000});  // the same number of pages
  EXPECT_EQ(again.data_ptr(), first);
  EXPECT_TRUE(ztrain::is_host_shared(again));
}

TEST(HostShared, PeersUnmapBlocksTheirOwnerFreed) {
  auto& c = ztrain::runtime().world();
  auto reduce_fresh_block = [&](int64_t numel) {
    auto t = ztrain::host_shared_empty({numel}).fill_(1);
    c.all_reduce(t);
    EXPECT_EQ(t[0].item<float>(), static_cast<float>(c.size()));
  };
  reduce_fresh_block(1 << 16);  // 256 KiB, the default threshold; maps the peers' directories too
  const int before = peer_host_shared_mappings();
  EXPECT_EQ(before, c.size() - 1);  // that block of each peer
  // Push that block out of its owner's pool of freed blocks: more blocks freed than it keeps.
  {
    std::vector<torch::Tensor> others;
    for (int i = 0; i < 40; ++i) others.push_back(ztrain::host_shared_empty({10}));
  }
  // The next collective unmaps it in the peers before mapping the new block.
  reduce_fresh_block(1 << 17);
  EXPECT_EQ(peer_host_shared_mappings(), before);
  EXPECT_EQ(c.stats().host_shared_calls, c.size() > 1 ? 2 : 0);
}

TEST(HostShared, PooledBlocksGiveWayWhereMemoryRunsShort) {
  auto& c = ztrain::runtime().world();
  const size_t mib = 1 << 20;
  auto pooled = [] { return ztrain::detail::pooled_host_shared_bytes(); };
  auto empty = [](size_t bytes) { return ztrain::host_shared_empty({static_cast<int64_t>(bytes / 4)}); };
  auto reduce_fresh_block = [&](size_t bytes) {
    auto t = empty(bytes).fill_(1);
    c.all_reduce(t);
    EXPECT_EQ(t[0].item<float>(), static_cast<float>(c.size()));
  };
  // Nothing left: a new block takes the pool's place (what earlier tests left there).
  ztrain::detail::fake_host_memory_left(0);
  reduce_fresh_block(mib);
  EXPECT_EQ(pooled(), mib);
  const int mapped = peer_host_shared_mappings();
  EXPECT_EQ(mapped, c.size() - 1);  // each peer's 1 MiB block: their pools went, so did their mappings
  // Plenty left: freed blocks stay for reuse.
  ztrain::detail::fake_host_memory_left(int64_t{1} << 40);
  { auto a = empty(2 * mib), b = empty(3 * mib); }
  { auto d = empty(4 * mib); }
  EXPECT_EQ(pooled(), 10 * mib);
  // 1 MiB short of the margin beside a new 5 MiB block: the oldest pooled block (1 MiB) goes.
  ztrain::detail::fake_host_memory_left(ztrain::detail::kHostMemoryMargin + 4 * mib);
  auto e = empty(5 * mib);
  EXPECT_EQ(pooled(), 9 * mib);
  // Nothing left again: the whole pool goes, and the peers let go of their mappings of it.
  ztrain::detail::fake_host_memory_left(0);
  reduce_fresh_block(7 * mib);
  ztrain::detail::fake_host_memory_left(-1);
  EXPECT_EQ(pooled(), 7 * mib);
  EXPECT_EQ(peer_host_shared_mappings(), mapped);  // each peer's 7 MiB block instead of its 1 MiB one
}

TEST(HostShared, PeerTrafficCountsTheBytesMovedThroughPeers) {
  auto& c = ztrain::runtime().world();
  const int n = c.size();
  const int64_t numel = 12 << 14;  // 768 KiB: above the default threshold, divisible by 1–4 ranks
  const int64_t bytes = numel * 4;
  auto& moved = ztrain::detail::peer_traffic();
  const int64_t gathered = moved.all_gather, reduced = moved.reduction;
  auto part = ztrain::host_shared_empty({numel / n}).fill_(1);
  auto whole = ztrain::host_shared_empty({numel}).fill_(1);
  c.all_gather(part, torch::empty({numel}));  // reads the peers' inputs
  EXPECT_EQ(moved.all_gather - gathered, (n - 1) * bytes / n);
  c.all_gather(torch::ones({numel / n}), ztrain::host_shared_empty({numel}));  // writes the peers' outputs
  EXPECT_EQ(moved.all_gather - gathered, 2 * (n - 1) * bytes / n);
  c.reduce_scatter(whole, torch::empty({numel / n}));
  EXPECT_EQ(moved.reduction - reduced, (n - 1) * bytes / n);
  c.all_reduce(whole);
  // all_reduce reads (n−1)/n from peers and writes as much to them.
  EXPECT_EQ(moved.reduction - reduced, 3 * (n - 1) * bytes / n);
  EXPECT_TRUE(whole.eq(n).all().item<bool>());
}

TEST(HostShared, MembersWithBuffersOfDifferentSizesGetAnError) {
  auto& c = ztrain::runtime().world();
  if (c.size() == 1) GTEST_SKIP() << "needs peers";
  // Large enough for the host-shared path; rank 0 passes one element more than the others.
  const int64_t numel = (int64_t{1} << 18) + (c.rank() == 0 ? 1 : 0);
  auto x = ztrain::host_shared_empty({numel}).fill_(1);
  const auto message = error_message([&] { c.all_reduce(x); });
  EXPECT_NE(message.find("all_reduce on communicator 'world': the members' buffers differ in size (rank 0 1048580, "
                         "rank 1 1048576"),
            std::string::npos)
      << message;
  EXPECT_TRUE(x.eq(1).all().item<bool>());  // nothing was written
  c.barrier();  // the communicator is still usable
}

TEST(HostShared, AViewOfTheMembersPartsMapsThemEndToEnd) {
  auto& c = ztrain::runtime().world();
  const int n = c.size(), r = c.rank();
  const int64_t numel = 2 * ztrain::host_shared_page_bytes() / 4;  // two pages of floats
  auto part = ztrain::host_shared_empty({numel}).fill_(r);
  auto view = ztrain::host_shared_view_of_members(c, part);
  ASSERT_TRUE(view.defined());
  ASSERT_EQ(view.numel(), n * numel);
  for (int m = 0; m < n; ++m) EXPECT_TRUE(view.narrow(0, m * numel, numel).eq(m).all().item<bool>()) << "part " << m;
  c.barrier();  // everyone has looked before anyone writes
  // A write through the view is the next member's part; a member's own write shows in every view.
  const int next = (r + 1) % n;
  view.narrow(0, next * numel + 1, 1).fill_(100 + r);
  part[numel - 1] = -r;
  c.barrier();
  EXPECT_EQ(part[1].item<float>(), 100 + (r + n - 1) % n);
  for (int m = 0; m < n; ++m) EXPECT_EQ(view[m * numel + numel - 1].item<float>(), -m) << "part " << m;
  // The view stays valid after the part's own tensor has gone, until the view goes.
  part = torch::Tensor();
  c.barrier();
  EXPECT_EQ(view[r * numel].item<float>(), r);
  c.barrier();
}

TEST(HostShared, AViewOfPartsThatAreNotWholePagesIsRefusedEverywhere) {
  auto& c = ztrain::runtime().world();
  const int64_t page_floats = ztrain::host_shared_page_bytes() / 4;
  // The last member's part starts inside a page, the others' on one: none of them gets a view.
  const bool last = c.rank() == c.size() - 1;
  auto block = ztrain::host_shared_empty({page_floats + 16});
  auto part = block.narrow(0, last ? 16 : 0, page_floats);
  EXPECT_FALSE(ztrain::host_shared_view_of_members(c, part).defined());
  EXPECT_FALSE(ztrain::host_shared_view_of_members(c, torch::zeros({page_floats})).defined());  // not host-shared
  if (c.size() > 1) {
    auto sized = ztrain::host_shared_empty({(c.rank() == 0 ? 2 : 1) * page_floats});
    const auto message = error_message([&] { ztrain::host_shared_view_of_members(c, sized); });
    EXPECT_NE(message.find("the members' parts differ (rank 0 " + std::to_string(8 * page_floats) + " bytes of Float"),
              std::string::npos)
        << message;
  }
  c.barrier();  // the communicator is still usable
}

}  // namespace host_shared_test
