#include <ztrain/zero/memory.h>

#include <ztrain/optim/adam.h>
#include <ztrain/zero/sharded_module.h>

#include <sys/resource.h>
#include <unistd.h>

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

int64_t optimizer_state_bytes(const torch::optim::Optimizer& optimizer) {
  int64_t bytes = 0;
  if (const auto* ours = dynamic_cast<const optim::AdamW*>(&optimizer)) {  // its state lives outside state()
    for (const auto& group : ours->param_groups()) {
      for (const auto& p : group.params()) {
        if (const auto* s = ours->state_of(p)) bytes += bytes_of(s->exp_avg) + bytes_of(s->exp_avg_sq) + bytes_of(s->master);
      }
    }
  }
  for (const auto& [key, state] : optimizer.state()) {
    const auto* s = state.get();
    if (auto* a = dynamic_cast<const torch::optim::AdamParamState*>(s)) {
      bytes += bytes_of(a->exp_avg()) + bytes_of(a->exp_avg_sq()) + bytes_of(a->max_exp_avg_sq());
    } else if (auto* w = dynamic_cast<const torch::optim::AdamWParamState*>(s)) {
      bytes += bytes_of(w->exp_avg()) + bytes_of(w->exp_avg_sq()) + bytes_of(w->max_exp_avg_sq());
    } else if (auto* g = dynamic_cast<const torch::optim::SGDParamState*>(s)) {
      bytes += bytes_of(g->momentum_buffer());
    } else if (auto* r = dynamic_cast<const torch::optim::RMSpropParamState*>(s)) {
      bytes += bytes_of(r->square_avg()) + bytes_of(r->momentum_buffer()) + bytes_of(r->grad_avg());
    } else if (auto* d = dynamic_cast<const torch::optim::AdagradParamState*>(s)) {
      bytes += bytes_of(d->sum());
    }
  }
  return bytes;
}

MemoryStats memory_stats(torch::nn::Module& model, const torch::optim::Optimizer* optimizer) {
  MemoryStats m;
  count(model, m);
  if (optimizer) m.optimizer_bytes = optimizer_state_bytes(*optimizer);
  std::ifstream statm("/proc/self/statm");
  int64_t size = 0, resident = 0;
  if (statm >> size >> resident) m.rss_bytes = resident * sysconf(_SC_PAGESIZE);
  rusage usage{};
  if (getrusage(RUSAGE_SELF, &usage) == 0) m.peak_rss_bytes = static_cast<int64_t>(usage.ru_maxrss) * 1024;
  return m;
}

}  // namespace ztrain
