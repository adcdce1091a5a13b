#pragma once
/// Bytes each rank hands to MPI, by MPI communicator, counted by intercepting the MPI calls of
/// the whole process (the MPI profiling interface: this file's definitions of MPI_Isend, … take
/// precedence over the library's and forward to PMPI_*). A program gets the counters by linking
/// bench/mpi_traffic.cpp into its executable.
///
/// Why not Communicator::stats(): it counts what a rank hands to its communicator, while the
/// bytes on the wire depend on the algorithm beneath (a ring, MPI's own collective); the MPI
/// calls below are what the communicators issue, so counting them counts every byte moved. A
/// program attributes them by MPI communicator: MpiTransport::handle() names each ztrain
/// communicator's (the ZeRO engine's are its context's streams).
///
/// What is counted, per call:
///   MPI_Isend / MPI_Send           the message (ztrain's ring collectives are made of these)
///   MPI_Iallreduce                 2(n−1)/n × the buffer   } MPI's own collectives (ztrain uses
///   MPI_Iallgather(v)              (n−1) × this rank's part } them below 256 KiB): their internal
///   MPI_Ireduce_scatter_block      (n−1) × the result       } traffic is invisible here, so they
///   MPI_Ibcast                     the buffer, at the root  } count at the bandwidth-optimal volume
/// `ring_bytes` and `native_bytes` keep the two kinds apart. Thread-safe.
///
///   bench::traffic_reset();
///   ...                                              // training steps
///   for (const auto& [comm, t] : bench::traffic()) ...

#include <mpi.h>

#include <cstdint>
#include <utility>
#include <vector>

namespace bench {

struct Traffic {
  int64_t ring_bytes = 0;    // point-to-point messages
  int64_t native_bytes = 0;  // MPI's collectives, at their bandwidth-optimal volume
  int64_t calls = 0;
  int64_t sent_bytes() const { return ring_bytes + native_bytes; }
};

/// Counters of every communicator that sent something since the last reset.
std::vector<std::pair<MPI_Comm, Traffic>> traffic();
void traffic_reset();

}  // namespace bench
