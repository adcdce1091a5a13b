#pragma once
// The NCCL backend, made by the communicator backend factory (comm/backend.h). Built where
// libtorch has CUDA and NCCL's header and library were found (ZTRAIN_HAS_NCCL).

#include <ztrain/comm/transport.h>

#include <memory>

namespace ztrain::detail {

/// The world transport of the "nccl" backend on `device` (a CUDA device): MPI's world carries
/// the bootstrap (NCCL's unique id), CPU tensors and point-to-point headers; an NCCL
/// communicator over the same ranks carries the CUDA tensors.
std::unique_ptr<PendingTransport> nccl_world(c10::Device device);

}  // namespace ztrain::detail
