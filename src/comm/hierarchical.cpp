#include <ztrain/comm/communicator.h>
#include <ztrain/comm/host_shared.h>

#include <torch/torch.h>

#include <algorithm>

// Collectives in two levels, for members spread over several hosts.
//
// With H hosts running L members each (L >= 2), member l of host h is M(h, l). Two groups are
// split from the communicator at its first two-level collective: `host`, the L members of this
// rank's host in group order, and `across`, the H members with this rank's index l, in host
// order. The host level takes the host-shared path (or the same-host transport); only the
// `across` level crosses a host's link, and the L across-groups of a host run side by side.
//
// reduce_scatter of P = H * L slices of n elements, M(h, l) keeping slice M(h, l): the input is
// first laid out as L rows of H slices, row l holding slices M(0, l) .. M(H-1, l). The host level
// reduce-scatters the rows (member l keeps its host's sum of row l), the across level reduce-
// scatters that row (member h keeps slice M(h, l), now summed over every host). A host's link
// carries L * (H-1)/H * H * n = (H-1)/H of the buffer each way, what one rank per host would
// send, against (P-1)/P of it for a flat ring in host order.
// all_gather is the same backwards: across, then host, then the rows back into rank order.
// all_reduce: the host level reduce-scatters the buffer cut in L parts, the across level
// all-reduces this member's part, the host level all-gathers the parts: 2 (H-1)/H of the buffer
// through each link, each way. Sums are taken in another order than the flat ring's, so 16-bit
// results may differ from it by a rounding.

namespace ztrain {

namespace {

ReduceOp level_op(ReduceOp op) { return op == ReduceOp::kAvg ? ReduceOp::kSum : op; }

// Between a buffer of P slices of n elements in rank order and the same slices as L rows of H
// (row l holding the slices of members M(0, l) .. M(H-1, l)); `by_host` lists M(h, l) at h * L + l.
void lay_out_rows(const torch::Tensor& ranked, const torch::Tensor& rows, const std::vector<int>& by_host, int H,
                  int L, int64_t n, bool into_rows) {
  for (int h = 0; h < H; ++h) {
    for (int l = 0; l < L; ++l) {
      auto in_rank_order = ranked.narrow(0, by_host[h * L + l] * n, n);
      auto in_rows = rows.narrow(0, (l * H + h) * n, n);
      (into_rows ? in_rows : in_rank_order).copy_(into_rows ? in_rank_order : in_rows);
    }
  }
}

}  // namespace

bool Communicator::hierarchical(int64_t bytes) const {
  return options_.hierarchical && hosts_ > 1 && per_host_ > 1 && large(bytes);
}

Communicator::Levels& Communicator::levels(const char* call) {
  if (levels_.host) return levels_;
  const int at = static_cast<int>(std::find(by_host_.begin(), by_host_.end(), rank_) - by_host_.begin());
  const int h = at / per_host_, l = at % per_host_;
  levels_.host = adopt(guarded(call, -1, [&] { return transport_->split(h, l); }), call, name() + ".host");
  levels_.across = adopt(guarded(call, -1, [&] { return transport_->split(l, h); }), call, name() + ".across");
  return levels_;
}

torch::Tensor Communicator::level_scratch(c10::ScalarType dtype, int64_t numel) {
  auto& buffer = level_scratch_[dtype];
  if (!buffer.defined() || buffer.numel() < numel) {
    // Host-shared where it can be, so that the host level reads the members' rows in place.
    const auto options = torch::TensorOptions().dtype(dtype).device(device());
    buffer = device().is_cpu() && options_.host_shared ? host_shared_empty({numel}, options)
                                                        : torch::empty({numel}, options);
  }
  return buffer.narrow(0, 0, numel);
}

template <class F>
void Communicator::run_levels(const char* call, F&& body) {
  ++stats_.hierarchical_calls;
  try {
    body(levels(call));
  } catch (const CommError& e) {
    // A level failed: the communicator's state is unknown too.
    failure_ = e.what();
    transport_->on_failure();
    throw;
  }
}

bool Communicator::hierarchical_reduce_scatter(const torch::Tensor& input, const torch::Tensor& output, ReduceOp op,
                                               const char* call) {
  if (!hierarchical(input.nbytes())) return false;
  const int H = hosts_, L = per_host_;
  const int64_t n = output.numel();
  run_levels(call, [&](Levels& lv) {
    auto scratch = level_scratch(input.scalar_type(), (H * L + H) * n);
    auto rows = scratch.narrow(0, 0, H * L * n), row = scratch.narrow(0, H * L * n, H * n);
    lay_out_rows(input.view(-1), rows, by_host_, H, L, n, /*into_rows=*/true);
    lv.host->reduce_scatter(rows, row, level_op(op));
    lv.across->reduce_scatter(row, output.view(-1), level_op(op));
  });
  return true;
}

bool Communicator::hierarchical_all_gather(const torch::Tensor& input, const torch::Tensor& output,
                                           const char* call) {
  if (!hierarchical(output.nbytes())) return false;
  const int H = hosts_, L = per_host_;
  const int64_t n = input.numel();
  run_levels(call, [&](Levels& lv) {
    auto scratch = level_scratch(input.scalar_type(), (H * L + H) * n);
    auto rows = scratch.narrow(0, 0, H * L * n), row = scratch.narrow(0, H * L * n, H * n);
    lv.across->all_gather(input.view(-1), row);
    lv.host->all_gather(row, rows);
    lay_out_rows(output.view(-1), rows, by_host_, H, L, n, /*into_rows=*/false);
  });
  return true;
}

bool Communicator::hierarchical_all_reduce(const torch::Tensor& flat, ReduceOp op, const char* call) {
  if (!hierarchical(flat.nbytes()) || flat.numel() < size_) return false;
  const int L = per_host_;
  const int64_t numel = flat.numel(), part = (numel + L - 1) / L;
  run_levels(call, [&](Levels& lv) {
    // The host level needs L equal parts, read in place where the buffer is host-shared already.
    const bool direct = numel == part * L && (is_host_shared(flat) || !options_.host_shared || !device().is_cpu());
    auto scratch = level_scratch(flat.scalar_type(), (direct ? 0 : part * L) + part);
    auto whole = direct ? flat : scratch.narrow(0, 0, part * L);
    auto mine = scratch.narrow(0, direct ? 0 : part * L, part);
    if (!direct) {
      whole.narrow(0, 0, numel).copy_(flat);
      whole.narrow(0, numel, part * L - numel).zero_();
    }
    lv.host->reduce_scatter(whole, mine, level_op(op));
    lv.across->all_reduce(mine, level_op(op));
    lv.host->all_gather(mine, whole);
    if (!direct) flat.copy_(whole.narrow(0, 0, numel));
  });
  return true;
}

}  // namespace ztrain
