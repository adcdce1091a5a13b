#include "mpi_traffic.h"

#include <mutex>

// How it works: each wrapper adds its call's bytes to the counter of its communicator, then
// calls the PMPI_ entry point. The executable exports these symbols (ENABLE_EXPORTS), so the
// dynamic linker binds ztrain's libraries' calls to them rather than to libmpi's. Communicators are few
// (a dozen), so a vector searched linearly under one mutex is enough.

namespace bench {
namespace {

struct State {
  std::mutex mutex;
  std::vector<std::pair<MPI_Comm, Traffic>> counters;
};

State& state() {
  static State* s = new State;  // leaked: MPI calls may still come during static destruction
  return *s;
}

int64_t type_bytes(int count, MPI_Datatype type) {
  int size = 0;
  PMPI_Type_size(type, &size);
  return static_cast<int64_t>(count) * size;
}

int comm_size(MPI_Comm comm) {
  int n = 1;
  PMPI_Comm_size(comm, &n);
  return n;
}

void add(MPI_Comm comm, int64_t ring, int64_t native) {
  auto& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  for (auto& [c, t] : s.counters) {
    if (c == comm) {
      t.ring_bytes += ring;
      t.native_bytes += native;
      ++t.calls;
      return;
    }
  }
  s.counters.push_back({comm, Traffic{.ring_bytes = ring, .native_bytes = native, .calls = 1}});
}

}  // namespace

std::vector<std::pair<MPI_Comm, Traffic>> traffic() {
  auto& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  return s.counters;
}

void traffic_reset() {
  auto& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  s.counters.clear();
}


}  // namespace bench

extern "C" {

int MPI_Isend(const void* buf, int count, MPI_Datatype type, int dest, int tag, MPI_Comm comm, MPI_Request* request) {
  bench::add(comm, bench::type_bytes(count, type), 0);
  return PMPI_Isend(buf, count, type, dest, tag, comm, request);
}

int MPI_Send(const void* buf, int count, MPI_Datatype type, int dest, int tag, MPI_Comm comm) {
  bench::add(comm, bench::type_bytes(count, type), 0);
  return PMPI_Send(buf, count, type, dest, tag, comm);
}

int MPI_Iallreduce(const void* sendbuf, void* recvbuf, int count, MPI_Datatype type, MPI_Op op, MPI_Comm comm,
                   MPI_Request* request) {
  const int n = bench::comm_size(comm);
  bench::add(comm, 0, 2 * (n - 1) * bench::type_bytes(count, type) / n);
  return PMPI_Iallreduce(sendbuf, recvbuf, count, type, op, comm, request);
}

int MPI_Iallgather(const void* sendbuf, int sendcount, MPI_Datatype sendtype, void* recvbuf, int recvcount,
                   MPI_Datatype recvtype, MPI_Comm comm, MPI_Request* request) {
  const int64_t own = sendbuf == MPI_IN_PLACE ? bench::type_bytes(recvcount, recvtype)
                                              : bench::type_bytes(sendcount, sendtype);
  bench::add(comm, 0, (bench::comm_size(comm) - 1) * own);
  return PMPI_Iallgather(sendbuf, sendcount, sendtype, recvbuf, recvcount, recvtype, comm, request);
}

int MPI_Iallgatherv(const void* sendbuf, int sendcount, MPI_Datatype sendtype, void* recvbuf, const int recvcounts[],
                    const int displs[], MPI_Datatype recvtype, MPI_Comm comm, MPI_Request* request) {
  int rank = 0;
  PMPI_Comm_rank(comm, &rank);
  const int64_t own = sendbuf == MPI_IN_PLACE ? bench::type_bytes(recvcounts[rank], recvtype)
                                              : bench::type_bytes(sendcount, sendtype);
  bench::add(comm, 0, (bench::comm_size(comm) - 1) * own);
  return PMPI_Iallgatherv(sendbuf, sendcount, sendtype, recvbuf, recvcounts, displs, recvtype, comm, request);
}

int MPI_Ireduce_scatter_block(const void* sendbuf, void* recvbuf, int recvcount, MPI_Datatype type, MPI_Op op,
                              MPI_Comm comm, MPI_Request* request) {
  bench::add(comm, 0, (bench::comm_size(comm) - 1) * bench::type_bytes(recvcount, type));
  return PMPI_Ireduce_scatter_block(sendbuf, recvbuf, recvcount, type, op, comm, request);
}

int MPI_Ibcast(void* buffer, int count, MPI_Datatype type, int root, MPI_Comm comm, MPI_Request* request) {
  int rank = 0;
  PMPI_Comm_rank(comm, &rank);
  bench::add(comm, 0, rank == root ? bench::type_bytes(count, type) : 0);
  return PMPI_Ibcast(buffer, count, type, root, comm, request);
}


}  // extern "C"
