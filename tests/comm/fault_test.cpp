// A rank dies; the survivors must fail with a clear CommError within twice the communication
// timeout instead of hanging. Run by fault_test.sh, which launches three ranks with `mpirun
// --enable-recovery` (so the launcher leaves the survivors running and they must notice the
// death themselves) and checks what they print. Three scenarios, by the first argument:
//   collective  rank 2 dies in the middle of a stream of collectives;
//   host_shared the same with host-shared tensors, whose members meet in shared memory
//               (comm/host_rendezvous.h) instead of the transport, and with barriers;
//   create      rank 2 dies before the others make new communicators from groups that hold it
//               (dup, then split): creating a communicator has the same deadline as any wait.
#include <ztrain/ztrain.h>

#include <csignal>
#include <iostream>
#include <thread>

namespace {

using clock_type = std::chrono::steady_clock;

/// Runs `fn` expecting it to fail with a CommError and prints what the test script checks: how
/// long after `since` (which fn may move on, to its last success) the error came.
template <class F>
bool expect_fault(const char* what, int rank, F&& fn) {
  auto since = clock_type::now();
  try {
    fn(since);
  } catch (const ztrain::CommError& e) {
    std::chrono::duration<double> waited = clock_type::now() - since;
    std::cout << "FAULT-DETECTED rank=" << rank << " seconds=" << waited.count() << " op=" << e.op()
              << " in=" << what << " message=" << e.what() << std::endl;
    return true;
  }
  std::cout << "NO-FAULT-DETECTED rank=" << rank << " in=" << what << std::endl;
  return false;
}

}  // namespace

int main(int argc, char** argv) {
  using namespace std::chrono_literals;
  const std::string mode = argc > 1 ? argv[1] : "collective";
  try {
    auto& rt = ztrain::init_distributed({.timeout = 5s});
    if (rt.world_size() != 3) {
      std::cerr << "fault_test needs 3 ranks, got " << rt.world_size() << std::endl;
      return 1;
    }
    if (mode == "create") {
      if (rt.rank() == 2) std::raise(SIGKILL);
      std::this_thread::sleep_for(300ms);  // rank 2 is gone
      // Each starts the clock when it starts waiting.
      bool ok = expect_fault("dup", rt.rank(), [&](auto&) { rt.world().dup("after-death"); });
      ok = expect_fault("split", rt.rank(), [&](auto&) { rt.dp().split(0, rt.rank(), "after-death"); }) && ok;
      return ok ? 0 : 1;
    }
    if (rt.rank() == 2) {
      // Die while the collectives are in flight, not between them.
      std::thread([] {
        std::this_thread::sleep_for(300ms);
        std::raise(SIGKILL);
      }).detach();
    }
    const bool shared = mode == "host_shared";
    auto t = shared ? ztrain::host_shared_empty({1 << 20}).fill_(1) : torch::ones({1 << 20}, rt.device());
    const bool ok = expect_fault(mode.c_str(), rt.rank(), [&](auto& last_success) {
      const auto give_up = clock_type::now() + 60s;
      while (clock_type::now() < give_up) {
        rt.world().all_reduce(t, ztrain::ReduceOp::kAvg);
        if (shared) rt.world().barrier();
        last_success = clock_type::now();
      }
    });
    return ok ? 0 : 1;
  } catch (const std::exception& e) {
    std::cout << "UNEXPECTED-ERROR " << e.what() << std::endl;
    return 1;
  }
}
