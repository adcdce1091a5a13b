#pragma once
// Pieces the communicator's algorithms share: how a flat buffer is cut into one segment per
// member, and the element-wise reduction of two operands.

#include <ztrain/comm/reduce_op.h>

#include <torch/torch.h>

#include <vector>

namespace ztrain::detail {

/// Segment i of a buffer of `numel` elements cut into n: [bounds[i], bounds[i+1]).
inline std::vector<int64_t> even_bounds(int64_t numel, int n) {
  std::vector<int64_t> b(n + 1);
  for (int i = 0; i <= n; ++i) b[i] = numel * i / n;
  return b;
}

inline torch::Tensor segment(const torch::Tensor& flat, const std::vector<int64_t>& bounds, int i) {
  return flat.narrow(0, bounds[i], bounds[i + 1] - bounds[i]);
}

/// dst = a (op) b, element-wise, with libtorch's kernels (16-bit floats computed in fp32 and
/// rounded to nearest even). kAvg sums; the caller divides. For bool, kMin is logical and, the
/// others logical or.
inline void combine(const torch::Tensor& dst, const torch::Tensor& a, const torch::Tensor& b, ReduceOp op) {
  auto& out = const_cast<torch::Tensor&>(dst);
  if (dst.scalar_type() == at::kBool) {
    if (op == ReduceOp::kMin) {
      at::logical_and_out(out, a, b);
    } else {
      at::logical_or_out(out, a, b);
    }
    return;
  }
  switch (op) {
    case ReduceOp::kMax: at::maximum_out(out, a, b); break;
    case ReduceOp::kMin: at::minimum_out(out, a, b); break;
    default: at::add_out(out, a, b); break;
  }
}

}  // namespace ztrain::detail
