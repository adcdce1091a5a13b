// The raw rates that bound collective bandwidth on one host: memcpy by one rank and by both at
// once, against MPI point-to-point between two ranks (Open MPI's shared-memory transport, which
// uses a single cross-process copy, CMA, for large messages), one way and both ways at once.
// Plain MPI, no ztrain: it measures the machine, not the library.
//
//   mpirun -np 2 --bind-to none build/bench/transport_probe
#include <mpi.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <vector>

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rank = 0, size = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  if (size != 2) {
    if (rank == 0) std::fprintf(stderr, "transport_probe needs exactly 2 ranks\n");
    MPI_Finalize();
    return 1;
  }
  const int peer = 1 - rank;
  const char* names[] = {"memcpy, one rank", "memcpy, both ranks at once", "send/recv, one way",
                         "sendrecv, both ways at once"};
  if (rank == 0) std::printf("# GB/s per copy of S bytes (S counted once), median of 9 after a warm-up\n");
  for (size_t bytes = size_t{16} << 20; bytes <= size_t{256} << 20; bytes *= 4) {
    std::vector<char> a(bytes, 1), b(bytes, 2);
    for (int kind = 0; kind < 4; ++kind) {
      std::vector<double> times;
      for (int it = 0; it < 10; ++it) {
        MPI_Barrier(MPI_COMM_WORLD);
        const double start = MPI_Wtime();
        if (kind == 0 && rank == 0) std::memcpy(b.data(), a.data(), bytes);
        if (kind == 1) std::memcpy(b.data(), a.data(), bytes);
        if (kind == 2 && rank == 0) MPI_Send(a.data(), static_cast<int>(bytes), MPI_BYTE, 1, 0, MPI_COMM_WORLD);
        if (kind == 2 && rank == 1) MPI_Recv(b.data(), static_cast<int>(bytes), MPI_BYTE, 0, 0, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
        if (kind == 3) {
          MPI_Sendrecv(a.data(), static_cast<int>(bytes), MPI_BYTE, peer, 0, b.data(), static_cast<int>(bytes),
                       MPI_BYTE, peer, 0, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
        }
        double t = MPI_Wtime() - start;
        MPI_Allreduce(MPI_IN_PLACE, &t, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
        if (it > 0) times.push_back(t);  // the first is the warm-up
      }
      std::nth_element(times.begin(), times.begin() + 4, times.end());
      if (rank == 0) std::printf("%4zu MiB  %-28s %6.2f GB/s\n", bytes >> 20, names[kind], bytes / times[4] / 1e9);
    }
  }
  MPI_Finalize();
  return 0;
}
