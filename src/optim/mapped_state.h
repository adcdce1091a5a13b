#pragma once
// Optimizer state in files (AdamEngineOptions::state_dir): fp32 tensors whose memory is a
// shared mapping of a file of their own, unlinked at once, so it vanishes with the tensor or the
// process. The kernel reads pages in on first touch and writes dirty ones back; read_ahead and
// write_behind steer it around each parameter's update.

#include <torch/torch.h>

#include <string>

namespace ztrain::optim::detail {

/// A zero fp32 CPU tensor of `sizes` backed by a new file in `dir` (created if missing), its
/// space reserved now: a full disk is an error here, naming the directory, not a fault later.
torch::Tensor mapped_zeros(const std::string& dir, at::IntArrayRef sizes);
/// Asks the kernel to start reading `t`'s pages (does not wait).
void read_ahead(const torch::Tensor& t);
/// Writes `t`'s dirty pages to its file and drops its pages from this process's memory.
void write_behind(const torch::Tensor& t);

}  // namespace ztrain::optim::detail
