#include "huge_pages.h"

#include <ztrain/error.h>
#include <ztrain/torch_compat.h>

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>

#include <sys/mman.h>

#include <cstdlib>
#include <mutex>

// Why
// ---
// A large tensor on 4 KiB pages costs one page-table walk per 4 KiB touched. Part of that cost
// falls on the cross-process copy Open MPI uses for large messages on one host (CMA,
// process_vm_readv, which pins the peer's pages one by one), and on memcpy and streaming kernels
// through TLB misses. On 2 MiB pages, two ranks' simultaneous exchanges ran up to 1.5× faster on
// the machine we measured, varying from run to run (bench/transport_probe, docs/benchmarks.md).
// Linux backs a range with transparent huge pages only where it covers whole aligned 2 MiB
// pages and, under the common "madvise" policy, only after madvise(MADV_HUGEPAGE) before the
// first touch, so this must happen where the memory is allocated, for every large tensor: the
// flat parameters and gradients, the gathered blocks, the communication scratch and the
// activations alike.
//
// Rounding sizes up to whole pages wastes at most 2 MiB per tensor of at least 2 MiB, i.e.
// under half of it at worst and a fraction of a percent for the tensors that dominate memory.
// Measured over a whole GPT training step, though, peak RSS grew 12–16% while throughput did not
// change measurably, which is why the runtime installs this only when asked (InitOptions).

namespace ztrain::detail {
namespace {

void free_huge(void* p) { std::free(p); }

class HugePageAllocator final : public HostAllocator {
 public:
  explicit HugePageAllocator(c10::Allocator* small) : small_(small) {}

  c10::DataPtr allocate_bytes(size_t nbytes) const override {
    if (nbytes < kHugePageBytes) return small_->allocate(nbytes);
    const size_t rounded = (nbytes + kHugePageBytes - 1) / kHugePageBytes * kHugePageBytes;
    void* p = nullptr;
    ZTRAIN_CHECK(posix_memalign(&p, kHugePageBytes, rounded) == 0 && p != nullptr,
                 "ztrain: out of memory allocating ", nbytes, " bytes for a CPU tensor");
    // Only advice: where the kernel has transparent huge pages off, memory stays on 4 KiB pages.
    madvise(p, rounded, MADV_HUGEPAGE);
    return {p, p, &free_huge, c10::Device(c10::DeviceType::CPU)};
  }

  // Both kinds end in free(): libtorch's default CPU allocator uses posix_memalign too.
  c10::DeleterFnPtr raw_deleter() const override { return small_->raw_deleter(); }

 private:
  c10::Allocator* small_;
};

}  // namespace

void install_huge_page_allocator() {
  static std::once_flag once;
  std::call_once(once, [] {
    // Lives for the process: libtorch keeps a plain pointer to it, and tensors may outlive main.
    static HugePageAllocator allocator(c10::GetCPUAllocator());
    c10::SetCPUAllocator(&allocator, /*priority=*/1);
  });
}

}  // namespace ztrain::detail
