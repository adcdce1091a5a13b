#pragma once
/// Host-shared tensors: CPU memory that the other ranks on the same host can map.
///
/// When every member of a communicator runs on one host and every member's buffer that peers
/// must read or write was allocated here (all_gather's output or its input, reduce_scatter's
/// input, all_reduce's tensor), the large collectives skip the transport: each rank reads its
/// peers' buffers in place and copies or sums them straight into its result, one pass over
/// memory instead of a transfer into scratch and a second pass. all_reduce also stores each
/// rank's share of the sum into every member's tensor, and all_gather into shared outputs has
/// each rank write its input into every member's output, reading it once. Any other case (ranks
/// on several hosts, a buffer from another allocator on any rank, a kernel that refuses to map
/// another process's memory) takes the ordinary path; the ranks agree on the path at every call,
/// so mixing is safe. Results equal the ordinary path's up to the order of floating-point sums.
///
/// Allocation is local (not collective) and thread-safe. The memory is released when the last
/// tensor or view of it goes, in peers as well: a peer that mapped a block unmaps it at its next
/// collective after the owner frees it. Use it for buffers that live long and are communicated
/// often (flat gradients, gathered parameters); each allocation is a separate kernel object.
///
///   auto grads = ztrain::host_shared_empty({numel}, torch::kFloat32);
///   dp.reduce_scatter(grads, shard, ztrain::ReduceOp::kAvg);  // reads the peers' grads in place

#include <c10/core/Allocator.h>
#include <torch/types.h>

namespace ztrain {

/// An uninitialised CPU tensor in host-shared memory. `options` must be CPU (the default) and
/// strided; the tensor is contiguous.
torch::Tensor host_shared_empty(at::IntArrayRef sizes, const torch::TensorOptions& options = {});

/// True when `tensor` views memory from host_shared_empty (false for no memory at all).
bool is_host_shared(const torch::Tensor& tensor);

class Communicator;

/// Collective over `comm`: one tensor that lays the members' `part`s end to end, member 0's
/// first, each mapped into this process where it lies, not copied. Reading it reads the members'
/// parts as they are now; writing it writes them. Every member passes a contiguous CPU tensor
/// from host_shared_empty of the same dtype and size, whose bytes are a whole number of pages
/// from a page boundary (host_shared_page_bytes()). Returns an undefined tensor on every member
/// when one cannot take part: the members are on several hosts, a part does not qualify, or a
/// kernel refuses to map a peer's memory. Throws ztrain::Error on every member when the parts
/// differ in size or dtype.
///
///   auto mine = ztrain::host_shared_empty({n}, torch::kFloat32);   // n · 4 a multiple of the page
///   auto all = ztrain::host_shared_view_of_members(comm, mine);     // [comm.size() · n]
torch::Tensor host_shared_view_of_members(Communicator& comm, const torch::Tensor& part);

/// The page size that host_shared_view_of_members needs its parts to be made of.
int64_t host_shared_page_bytes();

/// The allocator behind host_shared_empty, for code that allocates storage itself. Lives as long
/// as the process.
c10::Allocator* host_shared_allocator();

}  // namespace ztrain
