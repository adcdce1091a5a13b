#pragma once
// Tensors in files (ZeRO-Infinity's offload to disk: the optimizer's state with
// AdamEngineOptions::state_dir, a block's parameter and gradient shards with
// BlockOptions::offload_dir): CPU tensors whose memory is a shared mapping of a file of their
// own, unlinked at once, so it vanishes with the tensor or the process. The kernel reads pages in
// on first touch and writes dirty ones back when memory is short; read_ahead and write_behind
// steer it around each use.

#include <torch/torch.h>

#include <string>

namespace ztrain::detail {

/// A zero CPU tensor of `sizes` and `dtype` backed by a new file in `dir` (created if missing),
/// its space reserved now: a full disk is an error here, naming `what` and the directory, not a
/// fault later.
torch::Tensor mapped_zeros(const std::string& dir, at::IntArrayRef sizes, c10::ScalarType dtype,
                           const std::string& what);
/// Whether `t`'s memory is such a file mapping.
bool is_mapped(const torch::Tensor& t);
/// Asks the kernel to start reading `t`'s pages (does not wait); nothing unless is_mapped(t).
void read_ahead(const torch::Tensor& t);
/// Writes `t`'s dirty pages to its file and drops its pages from this process's memory; nothing
/// unless is_mapped(t).
void write_behind(const torch::Tensor& t);

}  // namespace ztrain::detail
