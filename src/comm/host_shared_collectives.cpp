#include <ztrain/comm/communicator.h>

#include "host_rendezvous.h"
#include "host_shared_detail.h"
#include "reduce.h"

#include <iostream>
#include <mutex>
#include <sstream>

// Collectives over host-shared buffers, for any transport whose members share a host.
//
// When every member's buffer is host-shared (comm/host_shared.h), a collective takes three
// steps. The members exchange the names of their buffers, which also tells each that the others
// have arrived with their inputs ready; each maps the others' buffers and all agree that every
// mapping worked. Each then reads or writes what it needs straight in the members' buffers. A
// closing barrier keeps every buffer alive and unchanged until all members have finished with it.
// - all_reduce: member r sums segment r over all buffers and stores the sum to segment r of
//   every buffer, which no other member touches, so each element is read once and written once
//   per buffer with no barrier in the middle.
// - all_gather, where the outputs are shared: member r writes its input into slice r of every
//   output, so an input is read once, not once per member (at 2 ranks a rank reads S/2 and
//   writes S, against S and S when each rank pulls the inputs). Where only the inputs are
//   shared, each member pulls them into its own output.
// - reduce_scatter: member r sums slice r of every input into its output.
// Each member starts at a different peer, so that no buffer is read by all members at once.
// The exchanges, the agreement and the barrier are meetings in a small host-shared memory file
// (host_rendezvous.h), where a waiting member sleeps until the next arrival instead of polling
// the transport. The communicator makes the meeting point at its first call here, through its
// control collectives (the transport's own, else rings), and keeps to those where one cannot be
// made, so the path needs nothing of the transport beyond them.

namespace ztrain {

namespace {

// Reductions other than float and bfloat16 sums go through libtorch in chunks this size (kept in
// cache between the steps of a sum over more than two members).
constexpr int64_t kReduceChunkBytes = int64_t{256} << 10;

// A fallback that is correct, only slower: said once per cause, not for every call or communicator.
void say_once(std::once_flag& once, const std::string& message) {
  std::call_once(once, [&] { std::cerr << message << std::endl; });
}

torch::Tensor view_of(const char* data, int64_t numel, c10::ScalarType dtype) {
  return torch::from_blob(const_cast<char*>(data), {numel}, torch::dtype(dtype));
}

// The members' sum, divided by `divisor`, into dst (this rank's segment), or into every member's
// buffer (to_all), with the streaming kernels of comm/host_shared_detail.h.
template <typename T>
void sum_members(const torch::Tensor& dst, const std::vector<char*>& sources, int members, bool to_all, int divisor) {
  auto* const* buffers = reinterpret_cast<T* const*>(sources.data());
  if (to_all) {
    detail::sum_to_all(buffers, members, dst.numel(), divisor);
  } else {
    detail::stream_sum(dst.data_ptr<T>(), buffers, members, dst.numel(), divisor);
  }
}

}  // namespace

detail::HostRendezvous* Communicator::rendezvous(const char* call) {
  if (rendezvous_tried_ || !host_local_ || size_ == 1 || !options_.host_shared) return rendezvous_.get();
  rendezvous_tried_ = true;
  std::string error;
  detail::HostRendezvous::Name made_here;
  if (rank_ == 0 && (rendezvous_ = detail::HostRendezvous::create(size_, error))) made_here = rendezvous_->name();
  std::vector<detail::HostRendezvous::Name> names(size_);
  constexpr auto kNameBytes = static_cast<int64_t>(sizeof(made_here));
  control_all_gather(torch::from_blob(&made_here, {kNameBytes}, torch::kUInt8),
                     torch::from_blob(names.data(), {kNameBytes * size_}, torch::kUInt8), call);
  if (rank_ != 0 && names[0].pid != 0) rendezvous_ = detail::HostRendezvous::join(names[0], size_, rank_, error);
  int32_t made = rendezvous_ != nullptr;
  control_all_reduce(torch::from_blob(&made, {1}, torch::kInt32), ReduceOp::kMin, call);
  if (made) return rendezvous_.get();
  rendezvous_.reset();
  static std::once_flag once;
  if (!error.empty()) {
    say_once(once, c10::str("ztrain: ", call, " on communicator '", name(), "': ", error,
                            "; the members of collectives on host-shared buffers meet through the transport instead"));
  }
  return nullptr;
}

void Communicator::meet_on_host(const void* mine, size_t bytes, const char* call) {
  if (rendezvous_->meet(mine, bytes, options_.timeout)) {
    ++stats_.host_meetings;
    return;
  }
  const auto absent = rendezvous_->absent();
  timed_out(call, absent.size() == 1 ? absent[0] : -1);
}

void Communicator::exchange_on_host(const void* mine, void* all, size_t bytes, const char* call) {
  if (!rendezvous(call) || bytes > detail::HostRendezvous::kSlotBytes) {
    const auto length = static_cast<int64_t>(bytes);
    control_all_gather(torch::from_blob(const_cast<void*>(mine), {length}, torch::kUInt8),
                       torch::from_blob(all, {length * size_}, torch::kUInt8), call);
    return;
  }
  meet_on_host(mine, bytes, call);
  for (int m = 0; m < size_; ++m) std::memcpy(static_cast<char*>(all) + m * bytes, rendezvous_->said(m), bytes);
}

void Communicator::barrier_on_host(const char* call) {
  if (rendezvous(call)) {
    meet_on_host(nullptr, 0, call);
  } else {
    run_barrier(call);
  }
}

Communicator::Members Communicator::map_members(const std::vector<torch::Tensor>& buffers, const char* call) {
  if (!host_local_ || size_ == 1) return {};
  struct Entry {
    int32_t shared = 0;
    int64_t bytes = 0;
    detail::SharedRange range;
  };
  const int count = static_cast<int>(buffers.size());
  std::vector<Entry> mine(count);
  for (int b = 0; b < count; ++b) {
    const auto& buffer = buffers[b];
    mine[b].bytes = static_cast<int64_t>(buffer.nbytes());
    const bool eligible = options_.host_shared && buffer.device().is_cpu();
    if (auto range = eligible ? detail::find_host_shared(buffer.data_ptr(), buffer.nbytes()) : std::nullopt) {
      mine[b].shared = 1;
      mine[b].range = *range;
    }
  }
  std::vector<Entry> all(size_ * count);  // member m's buffer b at m * count + b
  exchange_on_host(mine.data(), all.data(), count * sizeof(Entry), call);
  auto of = [&](int m, int b) -> const Entry& { return all[m * count + b]; };
  // Members read (and write) each other's buffers over this rank's extent: a member with a
  // different size is refused on every member alike, before anyone touches memory.
  for (int b = 0; b < count; ++b) {
    bool same = true;
    for (int m = 0; m < size_; ++m) same = same && of(m, b).bytes == mine[b].bytes;
    if (same) continue;
    std::ostringstream sizes;
    for (int m = 0; m < size_; ++m) sizes << (m ? ", " : "") << "rank " << m << " " << of(m, b).bytes;
    ZTRAIN_CHECK(false, call, " on communicator '", name(), "': the members' buffers differ in size (", sizes.str(),
                 " bytes); every member must pass the same shape");
  }
  Members members;
  for (int b = 0; b < count && members.buffer < 0; ++b) {
    bool shared = true;
    for (int m = 0; m < size_; ++m) shared = shared && of(m, b).shared;
    if (shared) members.buffer = b;
  }
  if (members.buffer < 0) return {};
  members.at.resize(size_);
  int32_t mapped = 1;
  std::string error;
  for (int m = 0; m < size_ && mapped; ++m) {
    members.at[m] = m == rank_ ? static_cast<char*>(buffers[members.buffer].data_ptr())
                               : detail::map_host_shared(of(m, members.buffer).range, error);
    mapped = members.at[m] != nullptr;
  }
  std::vector<int32_t> everywhere(size_);
  exchange_on_host(&mapped, everywhere.data(), sizeof(mapped), call);
  if (*std::min_element(everywhere.begin(), everywhere.end())) return members;
  static std::once_flag once;
  if (!error.empty()) {
    say_once(once, c10::str("ztrain: ", call, " on communicator '", name(), "' cannot map a peer's host-shared ",
                            "buffer (", error, "); collectives on host-shared buffers take the transport instead"));
  }
  return {};
}

void Communicator::reduce_members(const torch::Tensor& dst, const std::vector<char*>& members, int64_t offset,
                                  ReduceOp op, bool to_all) {
  const auto dtype = dst.scalar_type();
  const int64_t bytes_offset = offset * dst.element_size();
  std::vector<char*> sources(size_);
  for (int k = 0; k < size_; ++k) sources[k] = members[(rank_ + k) % size_] + bytes_offset;
  // kAvg's division goes with the sum, by the rank that makes it: one pass, and each rank divides
  // only its own segment (libtorch's bfloat16 division by a scalar took 42 ms for 77 MB).
  const int divisor = op == ReduceOp::kAvg ? size_ : 1;
  if (op == ReduceOp::kSum || op == ReduceOp::kAvg) {
    if (dtype == at::kFloat) return sum_members<float>(dst, sources, size_, to_all, divisor);
    if (dtype == at::kBFloat16 && detail::bf16_avx2_sums()) {
      return sum_members<c10::BFloat16>(dst, sources, size_, to_all, divisor);
    }
  }
  const int64_t chunk = std::max<int64_t>(1, kReduceChunkBytes / dst.element_size());
  for (int64_t at = 0; at < dst.numel(); at += chunk) {
    const int64_t len = std::min(chunk, dst.numel() - at);
    auto out = dst.narrow(0, at, len);
    const int64_t skip = at * dst.element_size();
    detail::combine(out, view_of(sources[0] + skip, len, dtype), view_of(sources[1] + skip, len, dtype), op);
    for (int k = 2; k < size_; ++k) detail::combine(out, out, view_of(sources[k] + skip, len, dtype), op);
    if (divisor > 1) out.div_(divisor);
    // sources[0] is this rank's own buffer, which is `out` itself.
    for (int k = 1; to_all && k < size_; ++k) std::memcpy(sources[k] + skip, out.data_ptr(), out.nbytes());
  }
}

bool Communicator::host_shared_all_gather(const torch::Tensor& input, const torch::Tensor& output, bool in_place,
                                          const char* call) {
  const auto members = map_members({output, input}, call);
  if (members.at.empty()) return false;
  const auto slice = input.nbytes();
  std::vector<char*> dsts;
  if (members.buffer == 0) {
    // The outputs are shared: this rank's input goes into its slice of every member's output,
    // read once for all of them.
    for (int k = 1; k <= size_; ++k) {
      const int m = (rank_ + k) % size_;
      if (m != rank_ || !in_place) dsts.push_back(members.at[m] + rank_ * slice);
    }
    detail::stream_copy_to_all(dsts.data(), static_cast<int>(dsts.size()), static_cast<const char*>(input.data_ptr()),
                               slice);
  } else {
    // Only the inputs are shared: this rank copies every member's input into its own output.
    auto* out = static_cast<char*>(output.data_ptr());
    for (int k = 1; k <= size_; ++k) {
      const int m = (rank_ + k) % size_;
      if (m != rank_ || !in_place) detail::stream_copy(out + m * slice, members.at[m], slice);
    }
  }
  barrier_on_host(call);
  ++stats_.host_shared_calls;
  detail::peer_traffic().all_gather += static_cast<int64_t>((size_ - 1) * slice);
  return true;
}

bool Communicator::host_shared_reduce_scatter(const torch::Tensor& input, const torch::Tensor& output, ReduceOp op,
                                              const char* call) {
  const auto members = map_members({input}, call);
  if (members.at.empty()) return false;
  reduce_members(output.view(-1), members.at, rank_ * output.numel(), op, /*to_all=*/false);
  barrier_on_host(call);
  ++stats_.host_shared_calls;
  detail::peer_traffic().reduction += (size_ - 1) * static_cast<int64_t>(output.nbytes());
  return true;
}

bool Communicator::host_shared_all_reduce(const torch::Tensor& flat, ReduceOp op, const char* call) {
  const auto members = map_members({flat}, call);
  if (members.at.empty()) return false;
  const auto bounds = detail::even_bounds(flat.numel(), size_);
  reduce_members(detail::segment(flat, bounds, rank_), members.at, bounds[rank_], op, /*to_all=*/true);
  barrier_on_host(call);
  ++stats_.host_shared_calls;
  // Segment rank_ of every peer, read and then written.
  detail::peer_traffic().reduction += 2 * (size_ - 1) * (bounds[rank_ + 1] - bounds[rank_]) * flat.element_size();
  return true;
}

}  // namespace ztrain
