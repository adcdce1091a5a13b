#pragma once
// How much memory this process can still get, for the caches of freed blocks (the CPU
// allocator's and the host-shared pool) to give way before the kernel runs out.

#include <cstdint>

namespace ztrain::detail {

/// What a cache leaves free beside a new block before it gives back what it holds.
constexpr int64_t kHostMemoryMargin = int64_t{512} << 20;

/// Bytes the kernel can still give this process: the host's available memory (MemAvailable), or
/// less where its memory cgroup (v1 or v2) has less left under its limit.
int64_t host_memory_left();

/// Makes host_memory_left() return `left` (a negative value: the real figure again), so that
/// tests can stage a shortfall; process-wide.
void fake_host_memory_left(int64_t left);

}  // namespace ztrain::detail
