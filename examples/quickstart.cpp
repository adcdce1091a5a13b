#include <ztrain/ztrain.h>
#include <iostream>
namespace zt = ztrain;

int main() try {
  auto& rt = zt::init_distributed({.seed = 0, .tp_size = 1});  // mpirun -np 4 ./example
  auto grad = torch::randn({1024});
  rt.dp().all_reduce(grad, zt::ReduceOp::kAvg);                 // mean over data-parallel ranks

  zt::CommStream gathers(rt.dp(), "gather");                    // its own thread and communicator
  auto shard = torch::full({256}, float(rt.dp_rank()));
  auto full = torch::empty({256 * rt.topology().dp_size()});
  auto work = gathers.all_gather(shard, full);                  // runs while we compute
  auto y = torch::matmul(torch::randn({64, 64}), torch::randn({64, 64}));
  work.wait();                                                  // full holds every shard

  zt::print_rank("loss ", zt::sum_loss(y.mean()).item<double>()); // mean over dp ranks
} catch (const std::exception& e) {
  std::cerr << e.what() << '\n';
  return 1;
}
