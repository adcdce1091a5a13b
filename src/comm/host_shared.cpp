#include <ztrain/comm/host_shared.h>

#include "host_shared_detail.h"

#include "../bf16_avx2.h"
#include "../host_memory.h"

#include <ztrain/comm/communicator.h>
#include <ztrain/error.h>
#include <ztrain/torch_compat.h>

#include <ATen/EmptyTensor.h>
#include <c10/core/Allocator.h>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <iostream>
#include <map>
#include <mutex>
#include <sstream>
#include <type_traits>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

// How it works
// ------------
// Every block is its own memory file (memfd_create), mapped shared by its owner. A peer on the
// same host maps it by opening /proc/<owner pid>/fd/<fd>, which the kernel allows to processes
// that may inspect the owner (the same user, as MPI ranks are). The owner also keeps a
// directory, one more memory file of kSlots ids, in which every live block has a slot: a peer
// that has mapped a block keeps the mapping while the block's id stays in its slot and unmaps it
// once the slot holds anything else, so freed memory does not live on in peers. Blocks stay
// mapped in peers between collectives: mapping per call cost a third of the bandwidth at 16 MiB.

namespace ztrain::detail {
namespace {

constexpr int kSlots = 1 << 16;  // blocks beyond this many live at once are not shareable
constexpr size_t kDirectoryBytes = kSlots * sizeof(uint64_t);
constexpr size_t kPageBytes = 4096;
// Freed blocks kept for reuse (see Registry::release), at most this many and bytes.
constexpr size_t kPoolBlocks = 32;
constexpr size_t kPoolBytes = size_t{1} << 30;

std::string errno_text() { return std::strerror(errno); }

int create_memory_file(size_t bytes) {
  // Named after the owner, so that /proc/PID/maps tells a peer's blocks from the process's own.
  const auto name = "ztrain-host-shared-" + std::to_string(getpid());
  const int fd = memfd_create(name.c_str(), MFD_CLOEXEC);
  ZTRAIN_CHECK(fd >= 0, "host_shared_empty: cannot create a shared memory file: ", errno_text(),
               errno == EMFILE ? " (every block holds a file descriptor; raise `ulimit -n`)" : "");
  if (ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
    const auto why = errno_text();
    close(fd);
    ZTRAIN_CHECK(false, "host_shared_empty: cannot size a shared memory file to ", bytes, " bytes: ", why);
  }
  return fd;
}

void* map_file(int fd, size_t bytes, int protection) {
  void* p = mmap(nullptr, bytes, protection, MAP_SHARED, fd, 0);
  return p == MAP_FAILED ? nullptr : p;
}

uint64_t load_slot(const uint64_t* directory, int slot) { return __atomic_load_n(directory + slot, __ATOMIC_ACQUIRE); }

// ---- this process's blocks -------------------------------------------------------------------

struct Block {
  char* base = nullptr;
  size_t bytes = 0;
  int fd = -1;
  int slot = -1;  // -1: the directory was full, so peers cannot see this block
  uint64_t id = 0;
};

class Registry {
 public:
  static Registry& instance() {
    static auto* registry = new Registry();  // never destroyed: tensors may outlive main
    return *registry;
  }

  Block* create(size_t nbytes) {
    const size_t bytes = (nbytes + kPageBytes - 1) / kPageBytes * kPageBytes;
    if (Block* reused = from_pool(bytes)) return reused;
    give_way(bytes);
    auto block = std::make_unique<Block>();
    block->bytes = bytes;
    block->fd = create_memory_file(bytes);
    block->base = static_cast<char*>(map_file(block->fd, bytes, PROT_READ | PROT_WRITE));
    if (block->base == nullptr) {
      const auto why = errno_text();
      close(block->fd);
      ZTRAIN_CHECK(false, "host_shared_empty: out of memory mapping ", bytes, " bytes: ", why);
    }
    std::lock_guard<std::mutex> lock(mu_);
    block->id = ++last_id_;
    if (!free_slots_.empty()) {
      block->slot = free_slots_.back();
      free_slots_.pop_back();
    } else if (next_slot_ < kSlots) {
      block->slot = next_slot_++;
    }
    if (block->slot >= 0) __atomic_store_n(directory_ + block->slot, block->id, __ATOMIC_RELEASE);
    blocks_[block->base] = block.get();
    return block.release();
  }

  // A freed block goes to a small pool, newest last, keeping its id and slot: the next block of
  // the same size (the same flat gradient or gathered parameters one step later) reuses it
  // without fresh pages to fault in and zero, and peers keep their mapping of it. The oldest
  // pooled blocks are unmapped beyond kPoolBlocks or kPoolBytes; a block larger than
  // kPoolBytes is unmapped at once.
  void release(Block* block) {
    std::vector<Block*> evicted;
    {
      std::lock_guard<std::mutex> lock(mu_);
      blocks_.erase(block->base);
      pool_.push_back(block);
      pool_bytes_ += block->bytes;
      if (block->bytes > kPoolBytes) std::rotate(pool_.begin(), pool_.end() - 1, pool_.end());
      evict_locked(kPoolBlocks, kPoolBytes, evicted);
    }
    unmap(evicted);
  }

  Block* from_pool(size_t bytes) {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto it = pool_.rbegin(); it != pool_.rend(); ++it) {
      if ((*it)->bytes != bytes) continue;
      Block* block = *it;
      pool_.erase(std::next(it).base());
      pool_bytes_ -= bytes;
      blocks_[block->base] = block;
      return block;
    }
    return nullptr;
  }

  // Before new memory is mapped, pooled blocks go (oldest first) where the host or the memory
  // cgroup would otherwise have less than kHostMemoryMargin left: what the pool holds gives way
  // to what the model needs.
  void give_way(size_t bytes) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (pool_.empty()) return;
    }
    const int64_t shortfall = static_cast<int64_t>(bytes) + kHostMemoryMargin - host_memory_left();
    if (shortfall <= 0) return;
    std::vector<Block*> evicted;
    {
      std::lock_guard<std::mutex> lock(mu_);
      const auto keep = std::max<int64_t>(static_cast<int64_t>(pool_bytes_) - shortfall, 0);
      evict_locked(kPoolBlocks, static_cast<size_t>(keep), evicted);
    }
    unmap(evicted);
  }

  void evict_locked(size_t max_blocks, size_t max_bytes, std::vector<Block*>& evicted) {
    while (!pool_.empty() && (pool_.size() > max_blocks || pool_bytes_ > max_bytes)) {
      Block* oldest = pool_.front();
      pool_.erase(pool_.begin());
      pool_bytes_ -= oldest->bytes;
      if (oldest->slot >= 0) {
        __atomic_store_n(directory_ + oldest->slot, uint64_t{0}, __ATOMIC_RELEASE);
        free_slots_.push_back(oldest->slot);
      }
      evicted.push_back(oldest);
    }
  }

  static void unmap(const std::vector<Block*>& evicted) {
    for (Block* b : evicted) {
      munmap(b->base, b->bytes);
      close(b->fd);
      delete b;
    }
  }

  size_t pooled_bytes() {
    std::lock_guard<std::mutex> lock(mu_);
    return pool_bytes_;
  }

  std::optional<SharedRange> find(const void* data, size_t bytes) {
    const auto* p = static_cast<const char*>(data);
    std::lock_guard<std::mutex> lock(mu_);
    auto it = blocks_.upper_bound(p);
    if (p == nullptr || it == blocks_.begin()) return std::nullopt;
    const Block& b = *std::prev(it)->second;
    if (b.slot < 0 || p + bytes > b.base + b.bytes) return std::nullopt;
    return SharedRange{static_cast<int32_t>(getpid()), b.fd, directory_fd_, b.slot, b.id, b.bytes,
                       static_cast<uint64_t>(p - b.base)};
  }

 private:
  Registry() {
    directory_fd_ = create_memory_file(kDirectoryBytes);
    directory_ = static_cast<uint64_t*>(map_file(directory_fd_, kDirectoryBytes, PROT_READ | PROT_WRITE));
    ZTRAIN_CHECK(directory_ != nullptr, "host_shared_empty: cannot map the block directory: ", errno_text());
  }

  std::mutex mu_;
  std::map<const char*, Block*, std::less<>> blocks_;  // by base address
  int directory_fd_ = -1;
  uint64_t* directory_ = nullptr;  // slot -> id of the live block there, 0 when free
  std::vector<int> free_slots_;
  std::vector<Block*> pool_;  // freed blocks, oldest first
  size_t pool_bytes_ = 0;
  int next_slot_ = 0;
  uint64_t last_id_ = 0;
};

void delete_block(void* block) { Registry::instance().release(static_cast<Block*>(block)); }

class HostSharedAllocator final : public HostAllocator {
 public:
  c10::DataPtr allocate_bytes(size_t nbytes) const override {
    if (nbytes == 0) return {nullptr, nullptr, nullptr, c10::Device(c10::DeviceType::CPU)};
    Block* block = Registry::instance().create(nbytes);
    return {block->base, block, &delete_block, c10::Device(c10::DeviceType::CPU)};
  }
  // Blocks are freed through their context, never through a raw pointer.
  c10::DeleterFnPtr raw_deleter() const override { return nullptr; }
};

// ---- peers' blocks ---------------------------------------------------------------------------

}  // namespace

void* map_process_file(int pid, int fd, uint64_t offset, size_t bytes, bool writable, void* where,
                       std::string& error) {
  const std::string path = "/proc/" + std::to_string(pid) + "/fd/" + std::to_string(fd);
  const int local = open(path.c_str(), (writable ? O_RDWR : O_RDONLY) | O_CLOEXEC);
  if (local < 0) {
    error = "cannot open " + path + ": " + errno_text();
    return nullptr;
  }
  struct stat st {};
  void* p = MAP_FAILED;
  if (fstat(local, &st) != 0 || static_cast<uint64_t>(st.st_size) < offset + bytes) {
    error = path + " is not the expected shared memory file";
  } else if ((p = mmap(where, bytes, writable ? PROT_READ | PROT_WRITE : PROT_READ,
                       MAP_SHARED | (where ? MAP_FIXED : 0), local, static_cast<off_t>(offset))) == MAP_FAILED) {
    error = "cannot map " + path + ": " + errno_text();
  }
  close(local);
  return p == MAP_FAILED ? nullptr : p;
}

namespace {

class PeerMappings {
 public:
  static PeerMappings& instance() {
    static auto* mappings = new PeerMappings();
    return *mappings;
  }

  char* map(const SharedRange& range, std::string& error) {
    std::lock_guard<std::mutex> lock(mu_);
    Peer& peer = peers_[range.pid];
    if (peer.directory == nullptr) {
      peer.directory = static_cast<const uint64_t*>(
          map_process_file(range.pid, range.directory_fd, 0, kDirectoryBytes, /*writable=*/false, nullptr, error));
      if (peer.directory == nullptr) {
        peers_.erase(range.pid);
        return nullptr;
      }
    }
    for (auto it = peer.blocks.begin(); it != peer.blocks.end();) {
      if (load_slot(peer.directory, it->second.slot) == it->first) {
        ++it;
      } else {
        munmap(it->second.base, it->second.bytes);
        it = peer.blocks.erase(it);
      }
    }
    auto found = peer.blocks.find(range.id);
    if (found == peer.blocks.end()) {
      auto* base = static_cast<char*>(
          map_process_file(range.pid, range.block_fd, 0, range.block_bytes, /*writable=*/true, nullptr, error));
      if (base == nullptr) return nullptr;
      found = peer.blocks.emplace(range.id, Mapping{base, range.block_bytes, range.slot}).first;
    }
    return found->second.base + range.offset;
  }

 private:
  struct Mapping {
    char* base;
    size_t bytes;
    int slot;
  };
  struct Peer {
    const uint64_t* directory = nullptr;
    std::map<uint64_t, Mapping> blocks;  // by id
  };

  std::mutex mu_;
  std::map<int, Peer> peers_;  // by pid
};

// ---- kernels ---------------------------------------------------------------------------------

// Below this, results likely stay in cache for whoever reads them next: ordinary stores.
constexpr size_t kStreamMinBytes = size_t{256} << 10;
// The kernels below walk their buffers line by line in order and prefetch this far ahead, across
// page boundaries where the hardware prefetcher stops. Walking four pages at a time instead, a
// line from each in turn, had been up to 1.4x faster than glibc's memcpy at 32 MiB on an Intel
// Xeon, but non-temporal stores to more than two pages at once ran 4-5x slower on an AMD EPYC
// (Zen 3), where one page at a time was fastest (docs/benchmarks.md).
constexpr int64_t kPrefetchBytes = 1024;
// stream_copy_to_all copies this much of its source to each destination in turn: read from
// memory for the first, from the core's level-2 cache for the others (8, 32 and 128 KiB were
// within noise of each other at 2 ranks on an AMD EPYC (Zen 4), 128 KiB ahead by a few percent).
constexpr size_t kFanOutChunkBytes = size_t{128} << 10;

#if defined(__x86_64__)
inline void stream_line(char* dst, const char* src) {
  const auto* s = reinterpret_cast<const __m128i*>(src);
  auto* d = reinterpret_cast<__m128i*>(dst);
  const __m128i a = _mm_loadu_si128(s), b = _mm_loadu_si128(s + 1), c = _mm_loadu_si128(s + 2),
                e = _mm_loadu_si128(s + 3);
  _mm_stream_si128(d, a);
  _mm_stream_si128(d + 1, b);
  _mm_stream_si128(d + 2, c);
  _mm_stream_si128(d + 3, e);
}

// Sums elements [begin, end) in line-sized steps into every one of `dsts` and returns where it
// stopped (less than a line before the end). Each step loads a whole line from every source
// before it stores whole lines: alternating 16-byte accesses between buffers 256 MiB apart made
// all_reduce 4x slower on an AMD EPYC (Zen 3), whose level-1 cache tells lines apart by a hash
// of low virtual address bits. Two sources, the common case, get a loop without the inner one
// (a third faster at 8-128 MiB). A divisor above 1 divides every sum by it (ReduceOp::kAvg) before
// it is stored, correctly rounded, as libtorch's division by a scalar.
template <bool kStream>
int64_t sum_lines(float* const* dsts, int ndst, const float* const* srcs, int n, int64_t begin, int64_t end,
                  int divisor) {
  const __m128 by = _mm_set1_ps(static_cast<float>(divisor));
  auto store = [&](int64_t at, __m128* acc) {
    if (divisor > 1) {
      for (int j = 0; j < 4; ++j) acc[j] = _mm_div_ps(acc[j], by);
    }
    for (int d = 0; d < ndst; ++d) {
      for (int j = 0; j < 4; ++j) {
        if constexpr (kStream) {
          _mm_stream_ps(dsts[d] + at + 4 * j, acc[j]);
        } else {
          _mm_storeu_ps(dsts[d] + at + 4 * j, acc[j]);
        }
      }
    }
  };
  auto line = [&](int64_t at) {
    for (int k = 0; k < n; ++k) _mm_prefetch(reinterpret_cast<const char*>(srcs[k] + at) + kPrefetchBytes, _MM_HINT_T0);
    __m128 acc[4];
    for (int j = 0; j < 4; ++j) acc[j] = _mm_loadu_ps(srcs[0] + at + 4 * j);
    for (int k = 1; k < n; ++k) {
      for (int j = 0; j < 4; ++j) acc[j] = _mm_add_ps(acc[j], _mm_loadu_ps(srcs[k] + at + 4 * j));
    }
    store(at, acc);
  };
  auto two = [&](int64_t at) {
    _mm_prefetch(reinterpret_cast<const char*>(srcs[0] + at) + kPrefetchBytes, _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(srcs[1] + at) + kPrefetchBytes, _MM_HINT_T0);
    __m128 acc[4];
    for (int j = 0; j < 4; ++j) acc[j] = _mm_loadu_ps(srcs[0] + at + 4 * j);
    for (int j = 0; j < 4; ++j) acc[j] = _mm_add_ps(acc[j], _mm_loadu_ps(srcs[1] + at + 4 * j));
    store(at, acc);
  };
  int64_t i = begin;
  for (; i + 16 <= end; i += 16) n == 2 ? two(i) : line(i);
  if constexpr (kStream) _mm_sfence();
  return i;
}

// sum_lines for bfloat16, 32 to a line, widened to floats and rounded to the nearest even
// bfloat16 after every addition, as libtorch's add of two bfloat16 tensors and c10::BFloat16's +
// (a NaN becomes 0x7FC0): the sum over members equals the pairwise one bit for bit. A divisor
// above 1 divides the rounded sum by it in float and rounds again, as libtorch divides a bfloat16
// tensor by a scalar. AVX2 only (bf16_avx2_sums()); a line is four registers of eight.
template <bool kStream>
__attribute__((target("avx2"))) int64_t sum_lines_bf16(uint16_t* const* dsts, int ndst, const uint16_t* const* srcs,
                                                        int n, int64_t begin, int64_t end, int divisor) {
  const __m256 by = _mm256_set1_ps(static_cast<float>(divisor));
  int64_t i = begin;
  for (; i + 32 <= end; i += 32) {
    for (int k = 0; k < n; ++k) _mm_prefetch(reinterpret_cast<const char*>(srcs[k] + i) + kPrefetchBytes, _MM_HINT_T0);
    __m256 acc[4];
    for (int j = 0; j < 4; ++j) acc[j] = avx2_load_bf16(srcs[0] + i + 8 * j);
    for (int k = 1; k < n; ++k) {
      // The last addition is rounded by the packing.
      for (int j = 0; j < 4; ++j) {
        acc[j] = _mm256_add_ps(k == 1 ? acc[j] : avx2_round_bf16(acc[j]), avx2_load_bf16(srcs[k] + i + 8 * j));
      }
    }
    if (divisor > 1) {
      for (int j = 0; j < 4; ++j) acc[j] = _mm256_div_ps(avx2_round_bf16(acc[j]), by);
    }
    __m128i sum[4];
    for (int j = 0; j < 4; ++j) sum[j] = avx2_pack_bf16(acc[j]);
    for (int d = 0; d < ndst; ++d) {
      for (int j = 0; j < 4; ++j) {
        auto* at = reinterpret_cast<__m128i*>(dsts[d] + i + 8 * j);
        if constexpr (kStream) {
          _mm_stream_si128(at, sum[j]);
        } else {
          _mm_storeu_si128(at, sum[j]);
        }
      }
    }
  }
  if constexpr (kStream) _mm_sfence();
  return i;
}
#endif

// memcpy with non-temporal stores from the first 64-byte boundary of dst on.
void copy_lines(char* dst, const char* src, size_t bytes) {
#if defined(__x86_64__)
  const size_t head = std::min(bytes, (64 - reinterpret_cast<uintptr_t>(dst) % 64) % 64);
  std::memcpy(dst, src, head);
  dst += head, src += head, bytes -= head;
  size_t at = 0;
  for (; at + 64 <= bytes; at += 64) {
    _mm_prefetch(src + at + kPrefetchBytes, _MM_HINT_T0);
    stream_line(dst + at, src + at);
  }
  _mm_sfence();
  std::memcpy(dst + at, src + at, bytes - at);
#else
  std::memcpy(dst, src, bytes);
#endif
}

// c10::BFloat16's + adds in float and rounds to the nearest even, as sum_lines_bf16; so does its
// conversion from the float quotient.
template <typename T>
void sum_scalar(T* const* dsts, int ndst, const T* const* srcs, int n, int64_t begin, int64_t end, int divisor) {
  for (int64_t i = begin; i < end; ++i) {
    T acc = srcs[0][i];
    for (int k = 1; k < n; ++k) acc = acc + srcs[k][i];
    if (divisor > 1) acc = static_cast<T>(static_cast<float>(acc) / static_cast<float>(divisor));
    for (int d = 0; d < ndst; ++d) dsts[d][i] = acc;
  }
}

// The line kernel for T, streaming its stores or not; where it returns `begin` (no vector
// kernel here), the caller's scalar loop does the rest.
template <bool kStream, typename T>
int64_t sum_lines_of(T* const* dsts, int ndst, const T* const* srcs, int n, int64_t begin, int64_t end,
                     int divisor) {
#if defined(__x86_64__)
  if constexpr (std::is_same_v<T, float>) {
    return sum_lines<kStream>(dsts, ndst, srcs, n, begin, end, divisor);
  } else {
    if (!bf16_avx2_sums()) return begin;
    return sum_lines_bf16<kStream>(reinterpret_cast<uint16_t* const*>(dsts), ndst,
                                   reinterpret_cast<const uint16_t* const*>(srcs), n, begin, end, divisor);
  }
#else
  return begin;
#endif
}

template <typename T>
void stream_sum_of(T* dst, const T* const* srcs, int n, int64_t count, int divisor) {
  int64_t i = 0;
  // In place (dst among the sources) every line is in cache when it is stored: non-temporal
  // stores to cached lines made all_reduce 4-7x slower on an AMD EPYC, so those take ordinary ones.
  const bool in_place = std::find(srcs, srcs + n, dst) != srcs + n;
  if (n >= 2 && static_cast<size_t>(count) * sizeof(T) >= kStreamMinBytes && !in_place) {
    i = std::min<int64_t>(count, (16 - reinterpret_cast<uintptr_t>(dst) % 16) % 16 / sizeof(T));
    sum_scalar(&dst, 1, srcs, n, 0, i, divisor);
    i = sum_lines_of</*kStream=*/true>(&dst, 1, srcs, n, i, count, divisor);
  } else if (n >= 2) {
    i = sum_lines_of</*kStream=*/false>(&dst, 1, srcs, n, 0, count, divisor);
  }
  sum_scalar(&dst, 1, srcs, n, i, count, divisor);
}

template <typename T>
void sum_to_all_of(T* const* buffers, int n, int64_t count, int divisor) {
  const auto* srcs = const_cast<const T* const*>(buffers);
  // Every line stored was loaded just before: ordinary stores (see stream_sum_of).
  const int64_t i = n >= 2 ? sum_lines_of</*kStream=*/false>(buffers, n, srcs, n, 0, count, divisor) : 0;
  sum_scalar(buffers, n, srcs, n, i, count, divisor);
}

}  // namespace

std::optional<SharedRange> find_host_shared(const void* data, size_t bytes) {
  return Registry::instance().find(data, bytes);
}

size_t pooled_host_shared_bytes() { return Registry::instance().pooled_bytes(); }

char* map_host_shared(const SharedRange& range, std::string& error) {
  if (range.pid == getpid()) {
    error = "the range belongs to this process";
    return nullptr;
  }
  return PeerMappings::instance().map(range, error);
}

PeerTraffic& peer_traffic() {
  static PeerTraffic traffic;
  return traffic;
}

void stream_copy(void* dst, const void* src, size_t bytes) {
  if (bytes >= kStreamMinBytes) {
    copy_lines(static_cast<char*>(dst), static_cast<const char*>(src), bytes);
  } else {
    std::memcpy(dst, src, bytes);
  }
}

void stream_copy_to_all(char* const* dsts, int n, const char* src, size_t bytes) {
  if (bytes < kStreamMinBytes) {
    for (int d = 0; d < n; ++d) std::memcpy(dsts[d], src, bytes);
    return;
  }
  for (size_t at = 0; at < bytes; at += kFanOutChunkBytes) {
    const size_t len = std::min(kFanOutChunkBytes, bytes - at);
    for (int d = 0; d < n; ++d) copy_lines(dsts[d] + at, src + at, len);
  }
}

bool bf16_avx2_sums() {
#if defined(__x86_64__)
  static const bool avx2 = __builtin_cpu_supports("avx2");
  return avx2;
#else
  return false;
#endif
}

void stream_sum(float* dst, const float* const* srcs, int n, int64_t count, int divisor) {
  stream_sum_of(dst, srcs, n, count, divisor);
}

void stream_sum(c10::BFloat16* dst, const c10::BFloat16* const* srcs, int n, int64_t count, int divisor) {
  stream_sum_of(dst, srcs, n, count, divisor);
}

void sum_to_all(float* const* buffers, int n, int64_t count, int divisor) {
  sum_to_all_of(buffers, n, count, divisor);
}

void sum_to_all(c10::BFloat16* const* buffers, int n, int64_t count, int divisor) {
  sum_to_all_of(buffers, n, count, divisor);
}

}  // namespace ztrain::detail

namespace ztrain {

c10::Allocator* host_shared_allocator() {
  static detail::HostSharedAllocator allocator;
  return &allocator;
}

torch::Tensor host_shared_empty(at::IntArrayRef sizes, const torch::TensorOptions& options) {
  ZTRAIN_CHECK(options.device().is_cpu(), "host_shared_empty: host-shared memory is CPU memory, got device ",
               options.device(), "; allocate device tensors with torch::empty (the communicator stages them)");
  ZTRAIN_CHECK(options.layout() == at::kStrided, "host_shared_empty: only strided tensors, got layout ",
               options.layout());
  auto t = at::detail::empty_generic(sizes, host_shared_allocator(), c10::DispatchKeySet(c10::DispatchKey::CPU),
                                     c10::typeMetaToScalarType(options.dtype()), c10::nullopt);
  return torch::Tensor(std::move(t)).set_requires_grad(options.requires_grad());
}

bool is_host_shared(const torch::Tensor& tensor) {
  if (!tensor.defined() || !tensor.device().is_cpu() || !tensor.has_storage()) return false;
  const auto& storage = tensor.storage();
  return storage.nbytes() > 0 && detail::find_host_shared(storage.data(), storage.nbytes()).has_value();
}

int64_t host_shared_page_bytes() {
  static const int64_t page = sysconf(_SC_PAGESIZE);
  return page;
}

namespace {

// What a member says of its part in host_shared_view_of_members.
struct PartOffer {
  int32_t usable = 0;  // host-shared, contiguous, whole pages from a page boundary
  int32_t dtype = 0;
  int64_t bytes = 0;
  detail::SharedRange range;
};

// Maps `bytes` of each member's part, in member order, into one reserved stretch of addresses;
// nullptr with the reason in `error`.
char* map_parts_end_to_end(const std::vector<PartOffer>& offers, size_t bytes, std::string& error) {
  const size_t total = bytes * offers.size();
  void* reserved = mmap(nullptr, total, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (reserved == MAP_FAILED) {
    error = "cannot reserve " + std::to_string(total) + " bytes of addresses: " + detail::errno_text();
    return nullptr;
  }
  auto* base = static_cast<char*>(reserved);
  for (size_t m = 0; m < offers.size(); ++m) {
    const auto& range = offers[m].range;
    if (!detail::map_process_file(range.pid, range.block_fd, range.offset, bytes, /*writable=*/true, base + m * bytes,
                                  error)) {
      munmap(base, total);
      return nullptr;
    }
  }
  return base;
}

}  // namespace

torch::Tensor host_shared_view_of_members(Communicator& comm, const torch::Tensor& part) {
  ZTRAIN_CHECK(part.defined(), "host_shared_view_of_members: the part is undefined");
  if (!comm.host_local()) return {};
  const int64_t page = host_shared_page_bytes();
  PartOffer mine{.dtype = static_cast<int32_t>(part.scalar_type()), .bytes = static_cast<int64_t>(part.nbytes())};
  if (part.device().is_cpu() && part.is_contiguous() && mine.bytes > 0 && mine.bytes % page == 0 &&
      reinterpret_cast<uintptr_t>(part.data_ptr()) % page == 0) {
    if (auto range = detail::find_host_shared(part.data_ptr(), part.nbytes())) {
      mine.usable = 1;
      mine.range = *range;
    }
  }
  const auto offers = comm.all_gather_object(mine);
  bool usable = true, same = true;
  for (const auto& offer : offers) {
    usable = usable && offer.usable;
    same = same && offer.bytes == mine.bytes && offer.dtype == mine.dtype;
  }
  if (!same) {
    std::ostringstream parts;
    for (size_t m = 0; m < offers.size(); ++m) {
      parts << (m ? ", " : "") << "rank " << m << " " << offers[m].bytes << " bytes of "
            << c10::toString(static_cast<c10::ScalarType>(offers[m].dtype));
    }
    ZTRAIN_CHECK(false, "host_shared_view_of_members on communicator '", comm.name(), "': the members' parts differ (",
                 parts.str(), "); every member must pass the same size and dtype");
  }
  if (!usable) return {};
  std::string error;
  char* base = map_parts_end_to_end(offers, static_cast<size_t>(mine.bytes), error);
  const bool everywhere = comm.all_reduce_scalar(int64_t{base != nullptr}, ReduceOp::kMin) == 1;
  const size_t total = static_cast<size_t>(mine.bytes) * offers.size();
  if (!everywhere) {
    if (base) munmap(base, total);
    if (!error.empty()) {
      std::cerr << "ztrain: host_shared_view_of_members on communicator '" << comm.name() << "': " << error
                << "; the caller copies instead" << std::endl;
    }
    return {};
  }
  return torch::from_blob(
      base, {part.numel() * static_cast<int64_t>(offers.size())}, [total](void* p) { munmap(p, total); },
      torch::TensorOptions().dtype(part.scalar_type()));
}

}  // namespace ztrain
