#pragma once
// libtorch's CPU allocator for large tensors: a bounded cache of freed blocks and transparent
// huge pages; see host_allocator.cpp.

#include <cstddef>
#include <cstdint>

namespace ztrain::detail {

/// Allocations of at least this many bytes are large: mapped by the allocator, cached when freed.
constexpr size_t kLargeHostBytes = size_t{1} << 20;
/// With huge pages, allocations of at least this many bytes start on a page of this size.
constexpr size_t kHugePageBytes = size_t{2} << 20;

struct HostAllocatorOptions {
  /// Freed large blocks kept for reuse, at most this many bytes (the least recently freed go
  /// first); 0: every large block is unmapped when freed.
  int64_t cache_bytes = 0;
  /// Back allocations of kHugePageBytes and more with transparent huge pages (aligned to them,
  /// madvise(MADV_HUGEPAGE)).
  bool huge_pages = false;
};

/// Routes libtorch's CPU allocations of at least kLargeHostBytes through ztrain's allocator,
/// configured by `options` (a later call changes them; blocks cached beyond the new bound are
/// unmapped); smaller ones go to the allocator installed before. Options asking for neither a
/// cache nor huge pages install nothing. Process-wide; tensors allocated either way stay valid.
void install_host_allocator(const HostAllocatorOptions& options);

struct HostAllocatorStats {
  int64_t cached_bytes = 0;  // freed blocks held for reuse
  int64_t mapped_bytes = 0;  // all large blocks, in use or cached
  int64_t hits = 0;          // large allocations served from the cache
  int64_t misses = 0;        // large allocations that mapped new memory
};
HostAllocatorStats host_allocator_stats();

/// Unmaps every cached block (the memory goes back to the system).
void release_cached_host_memory();

/// The default bound of the cache: an eighth of this host's memory, at most 4 GiB.
int64_t default_host_cache_bytes();

}  // namespace ztrain::detail
