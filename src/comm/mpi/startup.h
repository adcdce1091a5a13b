#pragma once
// The process's MPI library, started and shut down by the communicator backend factory
// (comm/backend.h).

#include <ztrain/comm/transport.h>

#include <memory>

namespace ztrain::detail {

/// Starts MPI with MPI_THREAD_MULTIPLE unless the program already did (then checks that it
/// provides that level). Throws ztrain::Error naming what is missing.
void start_mpi();
/// Throws ztrain::Error unless MPI is initialised.
void require_mpi_threads();
/// MPI_COMM_WORLD's duplicate, starting MPI if needed.
std::unique_ptr<PendingTransport> mpi_world();
/// MPI_Finalize if ztrain started MPI, unless a communication failure makes it unsafe.
void shutdown_mpi();
/// MPI_Abort over MPI_COMM_WORLD when MPI is running (the launcher ends every process); returns
/// otherwise.
void abort_mpi(int exit_code);

}  // namespace ztrain::detail
