#include <ztrain/zero/memory.h>

#include <ztrain/optim/state_view.h>
#include <ztrain/zero/sharded_module.h>

#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <fstream>

namespace ztrain {

namespace {
int64_t bytes_of(const torch::Tensor& t) { return t.defined() ? static_cast<int64_t>(t.nbytes()) : 0; }

void count(torch::nn::Module& module, MemoryStats& m) {
  if (auto* s = dynamic_cast<ShardedModule*>(&module)) {
    m.parameter_bytes += s->parameter_bytes();
    m.gathered_bytes += s->gathered_bytes();
    m.gradient_bytes += s->gradient_bytes();
    return;
  }
  for (const auto& p : module.named_parameters(/*recurse=*/false)) {
    m.parameter_bytes += bytes_of(p.value());
    m.gradient_bytes += bytes_of(p.value().grad());
  }
  for (const auto& child : module.children()) count(*child, m);
}
}  // namespace

MemoryStats memory_stats(torch::nn::Module& model, torch::optim::Optimizer* optimizer) {
  MemoryStats m;
  count(model, m);
  if (optimizer) m.optimizer_bytes = optim::state_bytes(*optimizer);
  std::ifstream statm("/proc/self/statm");
  int64_t size = 0, resident = 0;
  if (statm >> size >> resident) m.rss_bytes = resident * sysconf(_SC_PAGESIZE);
  rusage usage{};
  if (getrusage(RUSAGE_SELF, &usage) == 0) m.peak_rss_bytes = static_cast<int64_t>(usage.ru_maxrss) * 1024;
  // Linux moves its high-water mark lazily (when the resident set shrinks): the resident size
  // now can be above the last mark.
  m.peak_rss_bytes = std::max(m.peak_rss_bytes, m.rss_bytes);
  return m;
}

}  // namespace ztrain
