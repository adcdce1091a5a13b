#pragma once
// The storage of the ZeRO engine's flat buffers: allocation, release and refill.

#include <torch/torch.h>

namespace ztrain::detail {

/// An uninitialised flat buffer on `device` for parameters or gradients: on the CPU, host-shared
/// memory when `host_shared` (so that collectives on one host read the peers' buffers in place),
/// else the device's current allocator's. Its storage remembers that it is a flat buffer
/// (is_flat_buffer), also once released and refilled.
torch::Tensor flat_buffer(int64_t numel, c10::ScalarType dtype, c10::Device device, bool host_shared);

/// Whether `t` views the storage of a flat buffer (allocated now or released): a parameter that
/// a sharded module already points into its buffer.
bool is_flat_buffer(const torch::Tensor& t);

/// Detaches `t`'s storage from its memory, keeping the StorageImpl: every tensor over it (the
/// module's parameters, what autograd saved) sees the memory again after allocate_storage.
void free_storage(const torch::Tensor& t);
/// Gives `t`'s storage fresh memory of its size from its own allocator, unless it has it.
void allocate_storage(const torch::Tensor& t);
/// Gives `t`'s storage the memory of `memory`'s, which must be as large, taking it over (and
/// its release): every tensor over t's storage sees that memory from then on.
void adopt_storage(const torch::Tensor& t, const torch::Tensor& memory);

}  // namespace ztrain::detail
