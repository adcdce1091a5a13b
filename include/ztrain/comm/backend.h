#pragma once
/// Communicator backends, made by name.
///
/// A backend is a transport (comm/transport.h) plus what starting it takes. The factory makes a
/// backend's world communicator — every process of the job — from which every other
/// communicator is split or duplicated; init_distributed calls it with InitOptions::backend.
/// Every build has "mpi" (comm/mpi/transport.h: CPU tensors, CUDA ones staged through pinned
/// host memory); builds against a CUDA libtorch with NCCL found also have "nccl" (CUDA tensors
/// on one device per rank, over NCCL; CPU tensors and the bootstrap over MPI). A new backend adds one entry to the table in
/// src/comm/backend.cpp and its transport under comm/<name>/; no algorithm moves.
///
///   auto world = ztrain::make_world_communicator("mpi", {.name = "world", .timeout = 60s});
///   auto pairs = world->split(world->rank() / 2, world->rank(), "pairs");
///   ...
///   ztrain::shutdown_communicator_backends();     // MPI_Finalize, if ztrain started MPI

#include <ztrain/comm/communicator.h>

#include <memory>
#include <string>
#include <vector>

namespace ztrain {

/// The names make_world_communicator accepts, in this build.
std::vector<std::string> communicator_backends();

/// The world communicator of `backend`, starting the backend's library if the program has not
/// (for "mpi": MPI_Init_thread with MPI_THREAD_MULTIPLE; an MPI the program started must provide
/// that level). Collective over every process; the creation waits at most options.timeout.
/// A backend that binds a device (communicator_backend_binds_device) moves tensors on `device`,
/// this rank's CUDA device for "nccl"; the others ignore it. Throws ztrain::Error naming the
/// known backends for an unknown name.
std::unique_ptr<Communicator> make_world_communicator(const std::string& backend, CommunicatorOptions options = {},
                                                      c10::Device device = c10::Device(c10::kCPU));

/// Whether `backend`'s transport moves the memory of one device chosen at its creation (NCCL:
/// the rank's GPU), so that its world needs the rank's device. Throws for an unknown name.
bool communicator_backend_binds_device(const std::string& backend);

/// Shuts down the libraries make_world_communicator started (MPI_Finalize), unless a
/// communication failure makes that unsafe (it would wait for the dead peer). Collective and
/// idempotent; a backend cannot be started again afterwards. init_distributed's runtime calls it
/// at finalize_distributed() or process exit.
void shutdown_communicator_backends();

/// Ends every process of the job now with `exit_code` through the running backends (MPI_Abort:
/// the launcher ends the other ranks); returns if none is running. Not collective.
void abort_communicator_backends(int exit_code);

}  // namespace ztrain
