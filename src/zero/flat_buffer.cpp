#include "flat_buffer.h"

#include <ztrain/comm/host_shared.h>
#include <ztrain/error.h>

#include <ATen/EmptyTensor.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/DeviceGuard.h>

namespace ztrain::detail {

namespace {

// Hands allocations to another allocator. Its only purpose is its identity: a storage made
// through it is a flat buffer, whatever memory it holds, and its refills come from here too.
class FlatBufferAllocator final : public c10::Allocator {
 public:
  FlatBufferAllocator(c10::DeviceType type, c10::Allocator* inner) : type_(type), inner_(inner) {}
  c10::DataPtr allocate(size_t nbytes) override { return inner().allocate(nbytes); }
  c10::DeleterFnPtr raw_deleter() const override { return inner().raw_deleter(); }
  void copy_data(void* dest, const void* src, std::size_t count) const override { inner().copy_data(dest, src, count); }

 private:
  // Null: the device type's allocator of the moment (for the CPU, the runtime may install one
  // for huge pages).
  c10::Allocator& inner() const { return inner_ ? *inner_ : *c10::GetAllocator(type_); }
  c10::DeviceType type_;
  c10::Allocator* inner_;
};

FlatBufferAllocator& shared_flat() {
  static FlatBufferAllocator allocator(c10::kCPU, host_shared_allocator());
  return allocator;
}

// One per device type ztrain runs on (runtime/device.h).
FlatBufferAllocator& device_flat(c10::DeviceType type) {
  static FlatBufferAllocator cpu(c10::kCPU, nullptr), cuda(c10::kCUDA, nullptr);
  ZTRAIN_CHECK(type == c10::kCPU || type == c10::kCUDA, "flat buffers live on cpu or cuda devices, not ", type);
  return type == c10::kCPU ? cpu : cuda;
}

}  // namespace

torch::Tensor flat_buffer(int64_t numel, c10::ScalarType dtype, c10::Device device, bool host_shared) {
  ZTRAIN_INTERNAL_ASSERT(!host_shared || device.is_cpu(), "host-shared flat buffers are CPU memory");
  c10::DeviceGuard on(device);  // device allocators allocate on the current device
  auto* allocator = host_shared ? &shared_flat() : &device_flat(device.type());
  const auto keys = c10::DispatchKeySet(c10::computeDispatchKey(dtype, c10::kStrided, device));
  return torch::Tensor(at::detail::empty_generic({numel}, allocator, keys, dtype, c10::nullopt));
}

bool is_flat_buffer(const torch::Tensor& t) {
  if (!t.defined() || !t.has_storage()) return false;
  const auto* allocator = t.storage().unsafeGetStorageImpl()->allocator();
  return allocator == &shared_flat() || allocator == &device_flat(c10::kCPU) || allocator == &device_flat(c10::kCUDA);
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
  c10::DeviceGuard on(impl->device());
  impl->set_data_ptr_noswap(impl->allocator()->allocate(nbytes));
  impl->set_nbytes(nbytes);
}

void adopt_storage(const torch::Tensor& t, const torch::Tensor& memory) {
  auto* impl = t.storage().unsafeGetStorageImpl();
  auto* from = memory.storage().unsafeGetStorageImpl();
  const size_t nbytes = from->nbytes();
  ZTRAIN_INTERNAL_ASSERT(nbytes == t.nbytes() && from->device() == impl->device());
  impl->set_data_ptr_noswap(from->set_data_ptr(at::DataPtr(nullptr, from->device())));
  from->set_nbytes(0);
  impl->set_nbytes(nbytes);
}

}  // namespace ztrain::detail
