// A rank dies in the middle of a stream of collectives; the survivors must fail with a clear
// CommError within twice the communication timeout instead of hanging. Run by fault_test.sh,
// which launches three ranks with `mpirun --enable-recovery` (so the launcher leaves the
// survivors running and they must notice the death themselves) and checks what they print.
#include <ztrain/ztrain.h>

#include <csignal>
#include <iostream>
#include <thread>

int main() {
  using clock = std::chrono::steady_clock;
  using namespace std::chrono_literals;
  const auto timeout = 5s;
  try {
    auto& rt = ztrain::init_distributed({.timeout = timeout});
    if (rt.world_size() != 3) {
      std::cerr << "fault_test needs 3 ranks, got " << rt.world_size() << std::endl;
      return 1;
    }
    if (rt.rank() == 2) {
      // Die while the collectives are in flight, not between them.
      std::thread([] {
        std::this_thread::sleep_for(300ms);
        std::raise(SIGKILL);
      }).detach();
    }
    auto t = torch::ones({1 << 20});
    auto last_success = clock::now();
    const auto give_up = clock::now() + 60s;
    try {
      while (clock::now() < give_up) {
        rt.world().all_reduce(t, ztrain::ReduceOp::kAvg);
        last_success = clock::now();
      }
    } catch (const ztrain::CommError& e) {
      std::chrono::duration<double> waited = clock::now() - last_success;
      std::cout << "FAULT-DETECTED rank=" << rt.rank() << " seconds=" << waited.count() << " op=" << e.op()
                << " message=" << e.what() << std::endl;
      return 0;
    }
    std::cout << "NO-FAULT-DETECTED rank=" << rt.rank() << std::endl;
    return 1;
  } catch (const std::exception& e) {
    std::cout << "UNEXPECTED-ERROR " << e.what() << std::endl;
    return 1;
  }
}
