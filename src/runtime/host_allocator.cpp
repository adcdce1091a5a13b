#include "host_allocator.h"

#include "../host_memory.h"

#include <ztrain/error.h>
#include <ztrain/torch_compat.h>

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <map>
#include <mutex>
#include <unordered_map>
#include <utility>
#include <vector>

// Why a cache
// -----------
// A training step allocates the same large tensors every time: logits, activations, gathered
// blocks, gradients. glibc serves an allocation above its mmap threshold (at most 32 MiB) with a
// fresh mapping and unmaps it when it is freed, and one below it from a heap it trims, so each
// step the kernel maps, zeroes and charges those pages anew, one fault per 4 KiB page. GPT-2
// 124M at batch 2 × 256 on one rank took about 210 thousand more page faults and 0.8 s more
// system time per step of 7–8 s that way (docs/benchmarks.md). Keeping freed blocks and handing
// them out again takes the kernel out of the steady state; the bound keeps what is held for reuse
// from growing without limit. Before new memory is mapped, cached blocks are given back where the
// host or the process's memory cgroup would otherwise have less than kHostMemoryMargin left, and
// when a mapping fails the cache is emptied and the mapping retried: what the cache holds gives
// way to what the model needs.
// A cached block serves a request of up to its own size and at least 8/9 of it.
//
// Why huge pages
// --------------
// A large tensor on 4 KiB pages costs one page-table walk per 4 KiB touched. Part of that cost
// falls on the cross-process copy Open MPI uses for large messages on one host (CMA,
// process_vm_readv, which pins the peer's pages one by one), and on memcpy and streaming kernels
// through TLB misses. On 2 MiB pages, two ranks' simultaneous exchanges ran up to 1.5× faster on
// the machine we measured, varying from run to run (bench/transport_probe, docs/benchmarks.md).
// Linux backs a range with transparent huge pages only where it covers whole aligned 2 MiB
// pages and, under the common "madvise" policy, only after madvise(MADV_HUGEPAGE) before the
// first touch, so this must happen where the memory is allocated, for every large tensor. A
// block of 2 MiB or more starts on a huge page and is advised; its size stays rounded to 4 KiB
// pages, so the part past its last whole huge page stays on small pages and the block takes no
// more memory than on small pages. Sizes rounded up to whole huge pages instead had cost a
// 3.3 M-parameter GPT 12–16% of its peak RSS (docs/benchmarks.md, "Huge pages by default").

namespace ztrain::detail {
namespace {

void* map_pages(size_t bytes, bool huge) {
  if (!huge || bytes < kHugePageBytes) {
    void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    return p == MAP_FAILED ? nullptr : p;
  }
  // Map one huge page more and trim the range to start on a huge page.
  const size_t span = bytes + kHugePageBytes;
  void* raw = mmap(nullptr, span, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (raw == MAP_FAILED) return nullptr;
  auto* begin = static_cast<char*>(raw);
  auto* p = reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(begin) + kHugePageBytes - 1) & ~(kHugePageBytes - 1));
  if (p > begin) munmap(begin, p - begin);
  if (begin + span > p + bytes) munmap(p + bytes, begin + span - (p + bytes));
  // Only advice: where the kernel has transparent huge pages off, memory stays on 4 KiB pages.
  madvise(p, bytes, MADV_HUGEPAGE);
  return p;
}

class LargeBlocks {
 public:
  void configure(const HostAllocatorOptions& options) {
    std::vector<std::pair<void*, size_t>> victims;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      // Blocks mapped the other way would not honour the new alignment.
      if (options.huge_pages != huge_) evict_locked(0, victims);
      limit_ = std::max<int64_t>(options.cache_bytes, 0);
      huge_ = options.huge_pages;
      evict_locked(limit_, victims);
    }
    unmap(victims);
  }

  void* allocate(size_t nbytes) {
    size_t bytes = 0;
    bool huge = false, check_memory = false;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      huge = huge_;
      bytes = (nbytes + page_bytes() - 1) / page_bytes() * page_bytes();
      auto it = by_size_.lower_bound(bytes);
      if (it != by_size_.end() && it->first <= bytes + bytes / 8) {
        void* p = it->second;
        auto& block = blocks_.at(p);
        by_age_.erase(block.freed_at);
        by_size_.erase(it);
        cached_ -= static_cast<int64_t>(block.bytes);
        ++hits_;
        return p;
      }
      ++misses_;
      check_memory = cached_ > 0;
    }
    // New memory: where the host or this process's memory cgroup is short of it, cached blocks
    // are given back first, so that what the cache holds gives way to what the model needs.
    if (check_memory) {
      const int64_t shortfall = static_cast<int64_t>(bytes) + kHostMemoryMargin - host_memory_left();
      if (shortfall > 0) {
        std::vector<std::pair<void*, size_t>> victims;
        {
          std::lock_guard<std::mutex> lock(mutex_);
          evict_locked(std::max<int64_t>(cached_ - shortfall, 0), victims);
        }
        unmap(victims);
      }
    }
    void* p = map_pages(bytes, huge);
    if (p == nullptr) {
      release_cached();
      p = map_pages(bytes, huge);
    }
    std::lock_guard<std::mutex> lock(mutex_);
    ZTRAIN_CHECK(p != nullptr, "ztrain: out of memory allocating ", nbytes, " bytes for a CPU tensor (",
                 mapped_, " bytes held by large CPU tensors already)");
    blocks_.emplace(p, Block{bytes, 0});
    mapped_ += static_cast<int64_t>(bytes);
    return p;
  }

  // False: `p` is not a large block.
  bool release(void* p) {
    std::vector<std::pair<void*, size_t>> victims;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      auto it = blocks_.find(p);
      if (it == blocks_.end()) return false;
      auto& block = it->second;
      if (static_cast<int64_t>(block.bytes) > limit_) {  // would only flush the cache
        victims.emplace_back(p, block.bytes);
        mapped_ -= static_cast<int64_t>(block.bytes);
        blocks_.erase(it);
      } else {
        block.freed_at = ++clock_;
        by_size_.emplace(block.bytes, p);
        by_age_.emplace(block.freed_at, p);
        cached_ += static_cast<int64_t>(block.bytes);
        evict_locked(limit_, victims);
      }
    }
    unmap(victims);
    return true;
  }

  void release_cached() {
    std::vector<std::pair<void*, size_t>> victims;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      evict_locked(0, victims);
    }
    unmap(victims);
  }

  HostAllocatorStats stats() {
    std::lock_guard<std::mutex> lock(mutex_);
    return {cached_, mapped_, hits_, misses_};
  }

 private:
  struct Block {
    size_t bytes;
    uint64_t freed_at;  // the clock when last freed; meaningful while cached
  };

  static size_t page_bytes() {
    static const size_t bytes = static_cast<size_t>(sysconf(_SC_PAGESIZE));
    return bytes;
  }

  // Takes the least recently freed blocks out until at most `bound` bytes stay cached.
  void evict_locked(int64_t bound, std::vector<std::pair<void*, size_t>>& victims) {
    while (cached_ > bound) {
      auto oldest = by_age_.begin();
      void* p = oldest->second;
      const size_t bytes = blocks_.at(p).bytes;
      auto [first, last] = by_size_.equal_range(bytes);
      by_size_.erase(std::find_if(first, last, [p](const auto& entry) { return entry.second == p; }));
      by_age_.erase(oldest);
      blocks_.erase(p);
      cached_ -= static_cast<int64_t>(bytes);
      mapped_ -= static_cast<int64_t>(bytes);
      victims.emplace_back(p, bytes);
    }
  }

  // Outside the lock: unmapping a large range takes a while.
  static void unmap(const std::vector<std::pair<void*, size_t>>& victims) {
    for (const auto& [p, bytes] : victims) munmap(p, bytes);
  }

  std::mutex mutex_;
  std::unordered_map<void*, Block> blocks_;  // every large block, in use or cached
  std::multimap<size_t, void*> by_size_;     // the cached ones by size
  std::map<uint64_t, void*> by_age_;         // the cached ones, least recently freed first
  uint64_t clock_ = 0;
  int64_t limit_ = 0, cached_ = 0, mapped_ = 0, hits_ = 0, misses_ = 0;
  bool huge_ = false;
};

// Never destroyed: tensors may be freed after main returns.
LargeBlocks& large_blocks() {
  static auto* blocks = new LargeBlocks;
  return *blocks;
}

c10::DeleterFnPtr g_small_deleter = nullptr;

// Frees either kind, so that raw_deleter() holds for every pointer this allocator hands out.
void free_host(void* p) {
  if (large_blocks().release(p)) return;
  if (g_small_deleter != nullptr) {
    g_small_deleter(p);
  } else {
    std::free(p);
  }
}

class CachingHostAllocator final : public HostAllocator {
 public:
  explicit CachingHostAllocator(c10::Allocator* small) : small_(small) {}

  c10::DataPtr allocate_bytes(size_t nbytes) const override {
    if (nbytes < kLargeHostBytes) return small_->allocate(nbytes);
    void* p = large_blocks().allocate(nbytes);
    return {p, p, &free_host, c10::Device(c10::DeviceType::CPU)};
  }

  c10::DeleterFnPtr raw_deleter() const override { return &free_host; }

 private:
  c10::Allocator* small_;
};

}  // namespace

void install_host_allocator(const HostAllocatorOptions& options) {
  static std::once_flag once;
  static bool installed = false;
  // Neither a cache nor huge pages: libtorch's own allocator, unless an earlier call replaced it.
  if (options.cache_bytes <= 0 && !options.huge_pages && !installed) return;
  large_blocks().configure(options);
  std::call_once(once, [] {
    installed = true;
    auto* small = c10::GetCPUAllocator();
    g_small_deleter = small->raw_deleter();
    // Lives for the process: libtorch keeps a plain pointer to it, and tensors may outlive main.
    static CachingHostAllocator allocator(small);
    c10::SetCPUAllocator(&allocator, /*priority=*/1);
  });
}

HostAllocatorStats host_allocator_stats() { return large_blocks().stats(); }

void release_cached_host_memory() { large_blocks().release_cached(); }

int64_t default_host_cache_bytes() {
  const int64_t memory = static_cast<int64_t>(sysconf(_SC_PHYS_PAGES)) * sysconf(_SC_PAGESIZE);
  return std::min<int64_t>(memory / 8, int64_t{4} << 30);
}

}  // namespace ztrain::detail
