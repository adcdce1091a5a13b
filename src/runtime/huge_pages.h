#pragma once
// Transparent huge pages for large CPU tensors; see huge_pages.cpp.

#include <cstddef>

namespace ztrain::detail {

/// Allocations of at least this many bytes get 2 MiB pages.
constexpr size_t kHugePageBytes = size_t{2} << 20;

/// Routes libtorch's CPU allocations of at least kHugePageBytes through an allocator that
/// aligns and sizes them to whole 2 MiB pages and asks the kernel to back them with
/// transparent huge pages. Smaller ones go to the allocator installed before. Idempotent and
/// process-wide; tensors allocated either way stay valid.
void install_huge_page_allocator();

}  // namespace ztrain::detail
