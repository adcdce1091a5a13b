#pragma once
// What the communicator needs from host-shared memory (host_shared.cpp): naming a range so that
// a peer process can map it, mapping peers' ranges, and the copy and sum kernels that stream
// results to memory.

#include <c10/util/BFloat16.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>

namespace ztrain::detail {

/// A byte range inside one host-shared block, named so that another process on the host can map
/// it. Plain data: ranks exchange it as bytes.
struct SharedRange {
  int32_t pid = 0;           // owner process
  int32_t block_fd = -1;     // the block's memory file in the owner
  int32_t directory_fd = -1; // the owner's directory of live blocks
  int32_t slot = -1;         // the block's entry in that directory
  uint64_t id = 0;           // unique among the owner's blocks, never reused
  uint64_t block_bytes = 0;
  uint64_t offset = 0;       // of the range within the block
};

/// The range [data, data + bytes) if it lies inside one live host-shared block of this process.
std::optional<SharedRange> find_host_shared(const void* data, size_t bytes);

/// Bytes of freed blocks this process keeps for reuse (its pool).
size_t pooled_host_shared_bytes();

/// The first byte of a peer's `range`, mapped into this process for reading and writing, or
/// nullptr with the reason in `error`. Mappings are kept while the owner keeps the block; each
/// call first unmaps the blocks that owner has freed since. Thread-safe.
char* map_host_shared(const SharedRange& range, std::string& error);

/// Maps [offset, offset + bytes) of memory file `fd` of process `pid` on this host, shared: at
/// `where` (replacing what is mapped there) unless that is null. Null with the reason in `error`.
void* map_process_file(int pid, int fd, uint64_t offset, size_t bytes, bool writable, void* where,
                       std::string& error);

/// Bytes this process has moved through peers' host-shared buffers in collectives (read from
/// them or written to them), process-wide: what those collectives move instead of messages.
/// Benchmarks count them beside MPI's traffic.
struct PeerTraffic {
  std::atomic<int64_t> all_gather{0};  // copied from peers' inputs or into peers' outputs by all_gather
  std::atomic<int64_t> reduction{0};   // peers' data summed by reduce_scatter, summed and stored by all_reduce
};
PeerTraffic& peer_traffic();

/// memcpy for large copies whose destination is not read again soon: non-temporal stores and
/// software prefetch. Any size and alignment.
void stream_copy(void* dst, const void* src, size_t bytes);

/// stream_copy of `src` to each of the n destinations, reading `src` from memory once.
void stream_copy_to_all(char* const* dsts, int n, const char* src, size_t bytes);

/// dst[i] = srcs[0][i] + srcs[1][i] + ... + srcs[n-1][i], summed in that order (so equal bit
/// for bit to a scalar loop; bfloat16 adds in float and rounds after every addition, as
/// c10::BFloat16's + and libtorch's add), stored non-temporally when large and not in place.
/// dst may be one of srcs; n >= 1. A divisor above 1 divides each sum by it before it is
/// stored (ReduceOp::kAvg), rounded as libtorch divides a tensor of that type by a scalar.
void stream_sum(float* dst, const float* const* srcs, int n, int64_t count, int divisor = 1);
void stream_sum(c10::BFloat16* dst, const c10::BFloat16* const* srcs, int n, int64_t count, int divisor = 1);

/// buffers[k][i] = (buffers[0][i] + ... + buffers[n-1][i]) / divisor for every k, summed once in
/// that order and stored to all n buffers.
void sum_to_all(float* const* buffers, int n, int64_t count, int divisor = 1);
void sum_to_all(c10::BFloat16* const* buffers, int n, int64_t count, int divisor = 1);

/// Whether the bfloat16 sums above run vector kernels on this CPU (x86 with AVX2); elsewhere
/// they are scalar loops, correct but slower than libtorch's kernels.
bool bf16_avx2_sums();

}  // namespace ztrain::detail
