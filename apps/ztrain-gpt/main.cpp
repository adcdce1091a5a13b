// ztrain-gpt: the GPT trainer. This build carries the distributed runtime only; it reports the
// topology every rank sees and checks that the ranks can talk, so a launch line can be tried
// before the trainer lands.
#include <ztrain/ztrain.h>

#include <iostream>

int main() {
  try {
    auto& rt = ztrain::init_distributed();
    const auto& t = rt.topology();
    auto ranks = torch::ones({1}, torch::kInt64);
    rt.world().all_reduce(ranks);
    ztrain::print_rank("ztrain ", ZTRAIN_VERSION, ": ", rt.world_size(), " rank(s) answered (pp ", t.pp_size(),
                       " x dp ", t.dp_size(), " x tp ", t.tp_size(), "), ", rt.threads(),
                       " compute thread(s) per rank, communication timeout ", rt.timeout().count() / 1000.0, " s");
    ztrain::print_rank("ztrain-gpt: the GPT model and trainer are not part of this build yet; the runtime, "
                       "communicators and communication streams are ready (see README.md).");
    return 0;
  } catch (const std::exception& e) {
    std::cerr << e.what() << std::endl;
    return 1;
  }
}
