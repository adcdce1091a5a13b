#include "flat_buffer.h"

#include <ztrain/comm/host_shared.h>
#include <ztrain/torch_compat.h>

#include <ATen/EmptyTensor.h>
#include <c10/core/CPUAllocator.h>

namespace ztrain::detail {

namespace {

// Hands allocations to another allocator. Its only purpose is its identity: a storage made
// through it is a flat buffer, whatever memory it holds, and its refills come from here too.
class FlatBufferAllocator final : public HostAllocator {
 public:
  explicit FlatBufferAllocator(c10::Allocator* inner) : inner_(inner) {}
  c10::DataPtr allocate_bytes(size_t nbytes) const override { return inner().allocate(nbytes); }
  c10::DeleterFnPtr raw_deleter() const override { return inner().raw_deleter(); }

 private:
  // Null: the CPU allocator of the moment (the runtime may install one for huge pages).
  c10::Allocator& inner() const { return inner_ ? *inner_ : *c10::GetCPUAllocator(); }
  c10::Allocator* inner_;
};

FlatBufferAllocator& cpu_flat() {
  static FlatBufferAllocator allocator(nullptr);
  return allocator;
}

FlatBufferAllocator& shared_flat() {
  static FlatBufferAllocator allocator(host_shared_allocator());
  return allocator;
}

}  // namespace

torch::Tensor flat_buffer(int64_t numel, c10::ScalarType dtype, bool host_shared) {
  auto* allocator = host_shared ? &shared_flat() : &cpu_flat();
  return torch::Tensor(
      at::detail::empty_generic({numel}, allocator, c10::DispatchKeySet(c10::DispatchKey::CPU), dtype, c10::nullopt));
}

bool is_flat_buffer(const torch::Tensor& t) {
  if (!t.defined() || !t.has_storage()) return false;
  const auto* allocator = t.storage().unsafeGetStorageImpl()->allocator();
  return allocator == &cpu_flat() || allocator == &shared_flat();
}

void free_storage(const torch::Tensor& t) {
  auto* impl = t.storage().unsafeGetStorageImpl();
  impl->set_data_ptr_noswap(at::DataPtr(nullptr, impl->device()));
  impl->set_nbytes(0);
}

void allocate_storage(const torch::Tensor& t) {
  auto* impl = t.storage().unsafeGetStorageImpl();
  const size_t nbytes = t.numel() * t.element_size();
  if (impl->nbytes() == nbytes && (nbytes == 0 || impl->data() != nullptr)) return;
  impl->set_data_ptr_noswap(impl->allocator()->allocate(nbytes));
  impl->set_nbytes(nbytes);
}

}  // namespace ztrain::detail
