#pragma once
/// Memory accounting: bytes this rank holds for model state, and the process's resident size.
///
/// Parameters count what stays between steps (the full buffer at levels 0–1, the shard at
/// 2–3, plain parameters in full); gathered counts the full buffers of levels 2–3 allocated
/// right now (between steps: none, unless a module was gathered by hand); gradients count the
/// `.grad` tensors now allocated; optimizer counts the state tensors of the optimizer given
/// (fp32 master weights and moments; optim/state_view.h lists the optimizers it reads). What
/// each level keeps comes from its policy (level_policy.h). Not collective.
///
///   auto m = ztrain::memory_stats(*model, &optimizer);
///   ztrain::print_rank("params ", m.parameter_bytes, " grads ", m.gradient_bytes, " peak ", m.peak_rss_bytes);

#include <torch/torch.h>

#include <cstdint>

namespace ztrain {

struct MemoryStats {
  int64_t parameter_bytes = 0;
  int64_t gathered_bytes = 0;
  int64_t gradient_bytes = 0;
  int64_t optimizer_bytes = 0;
  /// Resident set size of the process now and its peak so far.
  int64_t rss_bytes = 0;
  int64_t peak_rss_bytes = 0;

  int64_t model_state_bytes() const { return parameter_bytes + gradient_bytes + optimizer_bytes; }
};

MemoryStats memory_stats(torch::nn::Module& model, torch::optim::Optimizer* optimizer = nullptr);

}  // namespace ztrain
