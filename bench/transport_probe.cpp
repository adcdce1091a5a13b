// The raw rates that bound collective bandwidth on one host: memcpy by one rank and by both at
// once, against MPI point-to-point between two ranks (Open MPI's shared-memory transport, which
// uses a single cross-process copy, CMA, for large messages), one way and both ways at once.
// Each on buffers of 4 KiB pages and on transparent huge pages (2 MiB, what ztrain's allocator
// gives large tensors). Plain MPI, no ztrain: it measures the machine, not the library.
//
//   mpirun -np 2 --bind-to none build/bench/transport_probe
#include <mpi.h>
#include <sys/mman.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

namespace {
// `bytes` filled with `value`, 2 MiB aligned; on huge pages if asked (advised before the first touch).
char* buffer(size_t bytes, bool huge, int value) {
  constexpr size_t kHuge = size_t{2} << 20;
  void* p = std::aligned_alloc(kHuge, (bytes + kHuge - 1) / kHuge * kHuge);
  madvise(p, bytes, huge ? MADV_HUGEPAGE : MADV_NOHUGEPAGE);
  std::memset(p, value, bytes);
  return static_cast<char*>(p);
}
}  // namespace

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
  for (int huge = 0; huge < 2; ++huge) {
    for (size_t bytes = size_t{16} << 20; bytes <= size_t{256} << 20; bytes *= 4) {
      char* a = buffer(bytes, huge, 1);
      char* b = buffer(bytes, huge, 2);
      for (int kind = 0; kind < 4; ++kind) {
        std::vector<double> times;
        for (int it = 0; it < 10; ++it) {
          MPI_Barrier(MPI_COMM_WORLD);
          const double start = MPI_Wtime();
          if (kind == 0 && rank == 0) std::memcpy(b, a, bytes);
          if (kind == 1) std::memcpy(b, a, bytes);
          if (kind == 2 && rank == 0) MPI_Send(a, static_cast<int>(bytes), MPI_BYTE, 1, 0, MPI_COMM_WORLD);
          if (kind == 2 && rank == 1) MPI_Recv(b, static_cast<int>(bytes), MPI_BYTE, 0, 0, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
          if (kind == 3) {
            MPI_Sendrecv(a, static_cast<int>(bytes), MPI_BYTE, peer, 0, b, static_cast<int>(bytes),
                         MPI_BYTE, peer, 0, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
          }
          double t = MPI_Wtime() - start;
          MPI_Allreduce(MPI_IN_PLACE, &t, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
          if (it > 0) times.push_back(t);  // the first is the warm-up
        }
        std::nth_element(times.begin(), times.begin() + 4, times.end());
        if (rank == 0) {
          std::printf("%4zu MiB  %-10s %-28s %6.2f GB/s\n", bytes >> 20, huge ? "huge pages" : "4 KiB", names[kind],
                      bytes / times[4] / 1e9);
        }
      }
      std::free(a);
      std::free(b);
    }
  }
  MPI_Finalize();
  return 0;
}
