// The CPU allocator for large tensors (src/runtime/host_allocator.h): freed blocks come back to
// the next allocation that fits them, the cache keeps to its bound by dropping the least
// recently freed, small tensors are libtorch's as before, raw allocations work both ways, and
// huge pages align large blocks without making them larger.
#include "test_util.h"

#include "../../src/host_memory.h"
#include "../../src/runtime/host_allocator.h"

#include <c10/core/CPUAllocator.h>

#include <unistd.h>

namespace host_allocator_test {

using ztrain::detail::host_allocator_stats;
using ztrain::detail::install_host_allocator;
constexpr int64_t kMiB = 1 << 20;

void* data(const torch::Tensor& t) { return t.data_ptr(); }

TEST(HostAllocator, NothingIsInstalledWhenNothingIsAsked) {
  auto* before = c10::GetCPUAllocator();
  install_host_allocator({.cache_bytes = 0, .huge_pages = false});
  EXPECT_EQ(c10::GetCPUAllocator(), before);
}

TEST(HostAllocator, AFreedBlockServesTheNextAllocationThatFitsIt) {
  install_host_allocator({.cache_bytes = 64 * kMiB});
  const auto start = host_allocator_stats();
  void* first = nullptr;
  {
    auto t = torch::full({4 * kMiB / 4}, 7.0f);
    first = data(t);
  }
  EXPECT_EQ(host_allocator_stats().cached_bytes, start.cached_bytes + 4 * kMiB);
  auto same = torch::empty({4 * kMiB / 4}, torch::kFloat);  // the same size: the same block
  EXPECT_EQ(data(same), first);
  auto stats = host_allocator_stats();
  EXPECT_EQ(stats.hits, start.hits + 1);
  EXPECT_EQ(stats.misses, start.misses + 1);
  EXPECT_EQ(stats.cached_bytes, start.cached_bytes);
  same = torch::Tensor();
  // A slightly smaller request reuses it too; one under 8/9 of it maps its own.
  auto smaller = torch::empty({4 * kMiB - 256 * 1024}, torch::kUInt8);
  EXPECT_EQ(data(smaller), first);
  smaller = torch::Tensor();
  auto much_smaller = torch::empty({3 * kMiB}, torch::kUInt8);
  EXPECT_EQ(host_allocator_stats().misses, start.misses + 2);
  EXPECT_EQ(host_allocator_stats().cached_bytes, start.cached_bytes + 4 * kMiB);
  smaller = torch::empty({4 * kMiB - 256 * 1024}, torch::kUInt8);
  EXPECT_EQ(data(smaller), first);
  // The memory holds what is written, like any other.
  smaller.fill_(3);
  EXPECT_EQ(smaller.sum().item<int64_t>(), 3 * smaller.numel());
}

TEST(HostAllocator, TheCacheKeepsToItsBoundDroppingTheLeastRecentlyFreed) {
  install_host_allocator({.cache_bytes = 8 * kMiB});
  ztrain::detail::release_cached_host_memory();
  auto a = torch::empty({4 * kMiB}, torch::kUInt8);
  auto b = torch::empty({5 * kMiB}, torch::kUInt8);
  auto c = torch::empty({6 * kMiB}, torch::kUInt8);
  void* pc = data(c);
  const auto mapped = host_allocator_stats().mapped_bytes;
  a = torch::Tensor();
  b = torch::Tensor();
  EXPECT_EQ(host_allocator_stats().cached_bytes, 5 * kMiB) << "a and b would pass the bound: a, freed first, goes";
  EXPECT_EQ(host_allocator_stats().mapped_bytes, mapped - 4 * kMiB);
  c = torch::Tensor();
  EXPECT_EQ(host_allocator_stats().cached_bytes, 6 * kMiB);
  EXPECT_EQ(host_allocator_stats().mapped_bytes, mapped - 9 * kMiB);
  const auto misses = host_allocator_stats().misses;
  EXPECT_EQ(data(torch::empty({6 * kMiB}, torch::kUInt8)), pc);
  EXPECT_EQ(host_allocator_stats().misses, misses);
  auto again = torch::empty({4 * kMiB}, torch::kUInt8);  // a is gone: mapped anew
  EXPECT_EQ(host_allocator_stats().misses, misses + 1);
  again = torch::Tensor();
  // A block larger than the bound is unmapped when freed.
  const auto before = host_allocator_stats();
  { auto big = torch::empty({16 * kMiB}, torch::kUInt8); }
  EXPECT_EQ(host_allocator_stats().mapped_bytes, before.mapped_bytes);
  EXPECT_LE(host_allocator_stats().cached_bytes, 8 * kMiB);
  ztrain::detail::release_cached_host_memory();
  EXPECT_EQ(host_allocator_stats().cached_bytes, 0);
}

TEST(HostAllocator, KnowsTheMemoryLeft) {
  const auto left = ztrain::detail::host_memory_left();
  EXPECT_GT(left, 0);
  EXPECT_LE(left, static_cast<int64_t>(sysconf(_SC_PHYS_PAGES)) * sysconf(_SC_PAGESIZE));
}

TEST(HostAllocator, CachedBlocksGiveWayWhereMemoryRunsShort) {
  ztrain::detail::fake_host_memory_left(int64_t{1} << 40);
  install_host_allocator({.cache_bytes = 256 * kMiB});
  ztrain::detail::release_cached_host_memory();
  { auto a = torch::empty({8 * kMiB}, torch::kUInt8), b = torch::empty({8 * kMiB}, torch::kUInt8); }
  ASSERT_EQ(host_allocator_stats().cached_bytes, 16 * kMiB);
  { auto c = torch::empty({4 * kMiB}, torch::kUInt8); }  // plenty left: the cache stays
  EXPECT_EQ(host_allocator_stats().cached_bytes, 20 * kMiB);
  // 2 MiB short of the margin after a new 2 MiB block: the least recently freed block goes.
  ztrain::detail::fake_host_memory_left(512 * kMiB);
  auto d = torch::empty({2 * kMiB}, torch::kUInt8);
  EXPECT_EQ(host_allocator_stats().cached_bytes, 12 * kMiB);
  // Nothing left at all: every cached block goes before the mapping.
  ztrain::detail::fake_host_memory_left(0);
  auto e = torch::empty({3 * kMiB}, torch::kUInt8);
  EXPECT_EQ(host_allocator_stats().cached_bytes, 0);
  ztrain::detail::fake_host_memory_left(-1);
  install_host_allocator({.cache_bytes = 64 * kMiB});
}

TEST(HostAllocator, SmallTensorsAndRawAllocationsWorkBothWays) {
  install_host_allocator({.cache_bytes = 64 * kMiB});
  ztrain::detail::release_cached_host_memory();
  const auto start = host_allocator_stats();
  auto small = torch::full({1000}, 2.0);
  EXPECT_EQ(small.sum().item<double>(), 2000.0);
  EXPECT_EQ(host_allocator_stats().misses + host_allocator_stats().hits, start.misses + start.hits);
  auto* allocator = c10::GetCPUAllocator();
  for (size_t bytes : {size_t{100}, size_t{3 * kMiB}}) {
    void* p = allocator->raw_allocate(bytes);
    ASSERT_NE(p, nullptr);
    std::memset(p, 1, bytes);
    allocator->raw_deallocate(p);
  }
  EXPECT_EQ(host_allocator_stats().misses, start.misses + 1);
}

TEST(HostAllocator, HugePagesAlignEveryLargeBlockEvenFromTheCache) {
  install_host_allocator({.cache_bytes = 64 * kMiB});
  { auto unaligned = torch::empty({3 * kMiB + 4096}, torch::kUInt8); }
  install_host_allocator({.cache_bytes = 64 * kMiB, .huge_pages = true});
  EXPECT_EQ(host_allocator_stats().cached_bytes, 0) << "blocks mapped without huge pages are dropped";
  for (int64_t bytes : {2 * kMiB, 3 * kMiB + 5, 64 * kMiB}) {
    auto t = torch::empty({bytes}, torch::kUInt8);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(t.data_ptr()) % (2 * kMiB), 0u) << bytes << " bytes";
  }
  install_host_allocator({.cache_bytes = ztrain::detail::default_host_cache_bytes()});
}

TEST(HostAllocator, HugePagesTakeNoMoreMemory) {
  install_host_allocator({.cache_bytes = 0, .huge_pages = true});
  const int64_t page = sysconf(_SC_PAGESIZE);
  for (int64_t bytes : {kMiB + 5, 3 * kMiB + 5}) {  // below and above a huge page
    const auto before = host_allocator_stats().mapped_bytes;
    auto t = torch::empty({bytes}, torch::kUInt8);
    EXPECT_EQ(host_allocator_stats().mapped_bytes - before, (bytes + page - 1) / page * page) << bytes << " bytes";
  }
  install_host_allocator({.cache_bytes = ztrain::detail::default_host_cache_bytes()});
}

}  // namespace host_allocator_test
