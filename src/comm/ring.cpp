#include <ztrain/comm/communicator.h>

#include "reduce.h"

#include <algorithm>

// Algorithms from point-to-point transfers, over any transport.
//
// A ring over n ranks moves (n-1)/n of the buffer through every rank, the least any algorithm
// can (the "bus bandwidth" bound). Segment i of a flat buffer is [bounds[i], bounds[i+1]).
//
// reduce_scatter: at step s (0 ≤ s < n-1) rank r sends its partial sum of segment r-s-1 to rank
// r+1 and receives rank r-1's partial sum of segment r-s-2, to which it adds its own input. At
// step 0 the "partial sum" sent is the rank's own input; after n-1 steps the segment received
// last, r-n ≡ r, holds the sum over all ranks. all_gather: at step s rank r forwards segment
// r-s, which it already holds, and receives segment r-s-1. Segments may be empty (fewer elements
// than ranks): neighbours cut every segment the same way, so a transfer is skipped on both ends.
//
// Broadcast (where the transport has none) is a binomial tree: in round k the ranks that hold
// the data, at distance d < 2^k from the root, send it to distance d + 2^k. The barrier is the
// dissemination algorithm: in round k every rank signals rank + 2^k and waits for rank - 2^k, so
// after ⌈log2 n⌉ rounds each rank has heard, directly or not, from every other.

namespace ztrain {

namespace {

// All of these algorithms' messages carry the tag above the users' range; a collective finishes
// before the next starts on a communicator, so their messages never meet.
constexpr int kAlgorithmTag = kMaxUserTag + 1;

// Reduce-scatter steps move and sum this much at a time (see ring_reduce_scatter).
// 256 KiB chunks were 10–30% faster than whole segments at 4–256 MiB on 2 ranks
// (docs/benchmarks.md); the handshake per chunk costs little at that size.
constexpr int64_t kRingChunkBytes = int64_t{256} << 10;

}  // namespace

void Communicator::ring_exchange(const torch::Tensor& out, const torch::Tensor& in, const char* op,
                                 const std::function<void()>& overlap) {
  const int next = (rank_ + 1) % size_, prev = (rank_ + size_ - 1) % size_;
  std::vector<TransportRequestPtr> requests;
  if (in.numel() > 0) requests.push_back(guarded(op, prev, [&] { return transport_->recv(in, prev, kAlgorithmTag); }));
  if (out.numel() > 0) requests.push_back(guarded(op, next, [&] { return transport_->send(out, next, kAlgorithmTag); }));
  if (overlap) overlap();
  // A stall anywhere in the ring reaches every rank through its neighbour, so the neighbour is
  // not named as the culprit: the wait reports the collective as a whole.
  wait_all(requests, op, -1);
}

void Communicator::ring_reduce_scatter(const torch::Tensor& input, const std::vector<int64_t>& bounds,
                                       const torch::Tensor& output, ReduceOp op, const char* call) {
  const int n = size_, r = rank_;
  int64_t largest = 0;
  for (int i = 0; i < n; ++i) largest = std::max(largest, bounds[i + 1] - bounds[i]);
  // Each step moves its segment in chunks and sums every chunk right after it arrives, while it
  // is still in cache, instead of writing a whole segment to memory and reading it back for the
  // sum. Partial sums (rings longer than two) need whole segments. The scratch is kept between
  // calls, since fresh pages for every large call cost more than the copy itself.
  const int64_t chunk = std::max<int64_t>(1, kRingChunkBytes / input.element_size());
  const int64_t partial_len = n > 2 ? largest : 0;
  auto scratch = scratch_for(input.scalar_type(), std::min(chunk, largest) + 2 * partial_len);
  auto received = scratch.narrow(0, 0, std::min(chunk, largest));
  torch::Tensor partial[2] = {scratch.narrow(0, received.numel(), partial_len),
                              scratch.narrow(0, received.numel() + partial_len, partial_len)};
  for (int s = 0; s < n - 1; ++s) {
    const int send_idx = ((r - s - 1) % n + n) % n, recv_idx = ((r - s - 2) % n + n) % n;
    const int64_t send_len = bounds[send_idx + 1] - bounds[send_idx];
    const int64_t recv_len = bounds[recv_idx + 1] - bounds[recv_idx];
    auto out = s == 0 ? detail::segment(input, bounds, send_idx) : partial[(s - 1) % 2].narrow(0, 0, send_len);
    auto dst = s == n - 2 ? output : partial[s % 2].narrow(0, 0, recv_len);
    auto own = detail::segment(input, bounds, recv_idx);
    // The neighbours cut the segment they pass the same way, so every chunk sent is received
    // as a chunk of the same size.
    for (int64_t at = 0; at < std::max(send_len, recv_len); at += chunk) {
      const int64_t send_n = std::clamp<int64_t>(send_len - at, 0, chunk);
      const int64_t recv_n = std::clamp<int64_t>(recv_len - at, 0, chunk);
      auto in = received.narrow(0, 0, recv_n);
      ring_exchange(out.narrow(0, std::min(at, send_len), send_n), in, call);
      if (recv_n > 0) detail::combine(dst.narrow(0, at, recv_n), in, own.narrow(0, at, recv_n), op);
    }
  }
}

torch::Tensor Communicator::scratch_for(c10::ScalarType dtype, int64_t numel) {
  auto& buffer = scratch_[dtype];
  if (!buffer.defined() || buffer.numel() < numel) {
    buffer = torch::empty({numel}, torch::TensorOptions().dtype(dtype).device(device()));
  }
  return buffer.narrow(0, 0, numel);
}

void Communicator::ring_all_gather(const torch::Tensor& output, const std::vector<int64_t>& bounds,
                                   const torch::Tensor& own_input, const char* call) {
  const int n = size_, r = rank_;
  auto own = detail::segment(output, bounds, r);
  const bool copy_own = own_input.defined() && own_input.data_ptr() != own.data_ptr();
  for (int s = 0; s < n - 1; ++s) {
    const int send_idx = ((r - s) % n + n) % n, recv_idx = ((r - s - 1) % n + n) % n;
    // Step 0 sends straight from the caller's input and copies it into place meanwhile.
    auto out = s == 0 && copy_own ? own_input.view(-1) : detail::segment(output, bounds, send_idx);
    std::function<void()> overlap;
    if (s == 0 && copy_own) overlap = [&] { own.copy_(own_input.view(-1)); };
    ring_exchange(out, detail::segment(output, bounds, recv_idx), call, overlap);
  }
}

void Communicator::tree_broadcast(const torch::Tensor& tensor, int root, const char* call) {
  const int n = size_, distance = (rank_ - root + n) % n;
  for (int step = 1; step < n; step *= 2) {
    if (distance < step) {
      if (distance + step < n) {
        const int to = (rank_ + step) % n;
        wait(guarded(call, to, [&] { return transport_->send(tensor, to, kAlgorithmTag); }), call, to);
      }
    } else if (distance < 2 * step) {
      const int from = (rank_ - step + n) % n;
      wait(guarded(call, from, [&] { return transport_->recv(tensor, from, kAlgorithmTag); }), call, from);
    }
  }
}

void Communicator::dissemination_barrier(const char* call) {
  auto token = torch::zeros({1}, torch::TensorOptions().dtype(torch::kUInt8).device(device()));
  auto heard = torch::empty_like(token);
  for (int step = 1; step < size_; step *= 2) {
    const int to = (rank_ + step) % size_, from = (rank_ - step + size_) % size_;
    std::vector<TransportRequestPtr> requests;
    requests.push_back(guarded(call, from, [&] { return transport_->recv(heard, from, kAlgorithmTag); }));
    requests.push_back(guarded(call, to, [&] { return transport_->send(token, to, kAlgorithmTag); }));
    wait_all(requests, call, -1);
  }
}

}  // namespace ztrain
