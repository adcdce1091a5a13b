// wait_bench: what a rank pays while it waits in a collective for a peer that comes late.
//
//   mpirun -np 2 --bind-to none build/bench/wait_bench [--late-ms 0,0.2,2,20] [--calls 40]
//
// Each call starts together on every rank (a barrier on a communicator of its own); then every
// rank but 0 sleeps L ms and rank 0 goes straight in, so it waits about L ms for the others.
// Rank 0 times its call on the clock and on its thread's CPU clock. Side by side, on
// communicators that differ only in CommunicatorOptions::host_shared:
//   host-shared  the members meet in a shared memory page and a waiter sleeps on a futex until
//                the next arrival (src/comm/host_rendezvous.h);
//   transport    the same collective on the transport (MPI), whose waiter polls: it spins, then
//                yields the core for up to 20 ms, then sleeps 50 µs between polls.
// The calls: barrier, and all_reduce of a 1 MiB host-shared float tensor (where the members are
// on one host, host-shared reads the peers' tensors in place, transport sends them).
// Columns (medians over --calls): wall ms of the call; CPU ms rank 0's thread spent in it, and
// that as a share of the wall time (while a peer is late this is CPU taken from the host's
// compute threads); "after" = wall - L, how long the call took once the last member arrived.
#include <ztrain/ztrain.h>

#include <CLI/CLI.hpp>
#include <torch/torch.h>

#include <time.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <functional>
#include <string>
#include <thread>
#include <vector>

namespace {

using ztrain::Communicator;
using Clock = std::chrono::steady_clock;

double thread_cpu_seconds() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

struct Figures {
  double wall_ms, cpu_ms;
};

// `calls` calls of `call` on `comm`, rank 0 arriving `late_ms` before the others; rank 0's medians.
Figures measure(Communicator& start, Communicator& comm, double late_ms, int calls,
                const std::function<void(Communicator&)>& call) {
  for (int i = 0; i < 3; ++i) call(comm);  // lazy set-up: mappings, the meeting point
  std::vector<double> wall(calls), cpu(calls);
  for (int i = 0; i < calls; ++i) {
    start.barrier();
    if (comm.rank() != 0 && late_ms > 0) {
      std::this_thread::sleep_for(std::chrono::duration<double, std::milli>(late_ms));
    }
    const double c0 = thread_cpu_seconds();
    const auto t0 = Clock::now();
    call(comm);
    wall[i] = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
    cpu[i] = 1e3 * (thread_cpu_seconds() - c0);
  }
  return {median(wall), median(cpu)};
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"wait_bench: CPU and wall time of a collective that waits for a late peer (run under mpirun)"};
  std::vector<double> late = {0, 0.2, 2, 20};
  int calls = 40;
  app.add_option("--late-ms", late, "how late the other ranks come, ms")->delimiter(',');
  app.add_option("--calls", calls, "timed calls per cell")->check(CLI::Range(1, 100000));
  CLI11_PARSE(app, argc, argv);
  try {
    auto& rt = ztrain::init_distributed();
    auto& world = rt.world();
    if (world.size() < 2) {
      std::fprintf(stderr, "wait_bench: run it under mpirun with two or more ranks\n");
      return 1;
    }
    const auto timeout = world.timeout();
    auto shared = ztrain::make_world_communicator("mpi", {.name = "host-shared", .timeout = timeout});
    auto transport =
        ztrain::make_world_communicator("mpi", {.name = "transport", .timeout = timeout, .host_shared = false});
    auto tensor = ztrain::host_shared_empty({(int64_t{1} << 20) / 4}).fill_(1);
    const std::vector<std::pair<std::string, std::function<void(Communicator&)>>> ops = {
        {"barrier", [](Communicator& c) { c.barrier(); }},
        {"all_reduce 1 MiB", [&](Communicator& c) { c.all_reduce(tensor, ztrain::ReduceOp::kMax); }},
    };
    if (world.rank() == 0) {
      std::printf("# %d ranks%s; rank 0 arrives first, the others L ms later; medians of %d calls\n", world.size(),
                  world.host_local() ? " on one host" : " on several hosts", calls);
      std::printf("| call | L ms | meeting | wall ms | CPU ms | CPU / wall | after ms |\n");
      std::printf("|---|---|---|---|---|---|---|\n");
    }
    for (const auto& [what, call] : ops) {
      for (double l : late) {
        for (auto* comm : {shared.get(), transport.get()}) {
          const auto f = measure(world, *comm, l, calls, call);
          if (world.rank() != 0) continue;
          std::printf("| %s | %g | %s | %.3f | %.3f | %.0f%% | %.3f |\n", what.c_str(), l, comm->name().c_str(),
                      f.wall_ms, f.cpu_ms, 100 * f.cpu_ms / std::max(f.wall_ms, 1e-9), std::max(0.0, f.wall_ms - l));
        }
      }
    }
    const auto meetings = static_cast<long long>(shared->stats().host_meetings);
    if (world.rank() == 0) std::printf("# meetings in host-shared memory on 'host-shared': %lld\n", meetings);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "wait_bench: %s\n", e.what());
    return 1;
  }
  return 0;
}
