#include <ztrain/comm/communicator.h>

#include "deadline.h"
#include "host_rendezvous.h"
#include "reduce.h"

#include <torch/torch.h>

#include <unistd.h>

#include <algorithm>
#include <climits>
#include <fstream>
#include <map>
#include <sstream>
#include <thread>

// How it works
// ------------
// Each call validates its tensors (so bad input never leaves a peer blocked), optionally runs
// the debug agreement check, then picks an algorithm: the transport's own collective for small
// messages where it has one (for all messages where it runs them on the device, as NCCL's
// transport does); from the ring threshold on, the host-shared path where every
// member's buffer allows it (host_shared_collectives.cpp), else the rings (ring.cpp); barriers
// and broadcasts from point-to-point messages where the transport has no collective for them.
// Every transport operation is started non-blocking and its request polled here. Polling drives
// the backend's progress (MPI's shared-memory copies and non-blocking schedules advance only
// inside its calls), so the waiter spins hot at first, then yields, and only after a while
// without completion backs off to short sleeps (deadline.h). Past the deadline the request is abandoned: the
// communicator records the failure, tells the transport, and refuses later calls.

namespace ztrain {

const char* to_string(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum: return "sum";
    case ReduceOp::kAvg: return "avg";
    case ReduceOp::kMax: return "max";
    case ReduceOp::kMin: return "min";
  }
  return "?";
}

namespace {

bool supported(c10::ScalarType t) {
  switch (t) {
    case at::kFloat: case at::kDouble: case at::kBFloat16: case at::kHalf:
    case at::kInt: case at::kLong: case at::kByte: case at::kBool:
      return true;
    default:
      return false;
  }
}

void check_op(c10::ScalarType t, ReduceOp op, const char* call) {
  if (op != ReduceOp::kAvg) return;
  ZTRAIN_CHECK(t != at::kBool, call, ": ReduceOp::kAvg needs a floating dtype, got bool");
  ZTRAIN_CHECK(at::isFloatingType(t), call, ": ReduceOp::kAvg needs a floating dtype, got ", t,
               "; reduce with kSum and divide yourself");
}

/// What the transport reduces with: kAvg is a sum divided afterwards.
ReduceOp transport_op(ReduceOp op) { return op == ReduceOp::kAvg ? ReduceOp::kSum : op; }

/// kAvg's division, correctly rounded on every device: libtorch's CUDA kernels divide by a
/// scalar as a product with its reciprocal (5 / 3 lands one unit off), by a device tensor exactly.
void divide_by_members(const torch::Tensor& t, int members) {
  if (t.is_cpu()) {
    t.div_(members);
  } else {
    t.div_(torch::full({}, members, t.options()));
  }
}

bool overlaps(const torch::Tensor& a, const torch::Tensor& b) {
  auto a0 = static_cast<const char*>(a.data_ptr());
  auto b0 = static_cast<const char*>(b.data_ptr());
  auto a1 = a0 + a.nbytes(), b1 = b0 + b.nbytes();
  return a.nbytes() && b.nbytes() && a0 < b1 && b0 < a1;
}

std::string seconds(std::chrono::milliseconds ms) {
  std::ostringstream s;
  s << ms.count() / 1000.0 << " s";
  return s.str();
}

/// This host, as far as sharing memory goes: the host name and the kernel's boot id, so that
/// two machines with one name (or containers with one image) do not pass for one host.
std::string host_identity() {
  char name[256] = {};
  gethostname(name, sizeof(name) - 1);
  std::string boot;
  std::ifstream("/proc/sys/kernel/random/boot_id") >> boot;
  return std::string(name) + "/" + boot;
}

torch::Tensor bytes_tensor(std::string_view bytes) {
  return torch::from_blob(const_cast<char*>(bytes.data()), {static_cast<int64_t>(bytes.size())}, torch::kUInt8);
}

}  // namespace

// ---- the debug agreement check -------------------------------------------------------------

enum CallKind : int32_t { kAllReduce = 1, kAllGather, kReduceScatter, kBroadcast, kBarrier, kGatherBytes,
                          kBroadcastBytes, kDup, kSplit };

struct Communicator::Call {
  int32_t kind = 0;
  int32_t dtype = -1;   // c10::ScalarType, -1 when none
  int64_t numel = 0;    // per-rank contribution
  int64_t extra = 0;    // reduce op or root
  int64_t sequence = 0;
  int64_t ring_threshold = 0;  // ranks must agree, or they would run different algorithms
  int64_t hierarchical = 0;

  auto key() const { return std::tie(kind, dtype, numel, extra, sequence, ring_threshold, hierarchical); }
  bool operator==(const Call& o) const { return key() == o.key(); }
  bool operator<(const Call& o) const { return key() < o.key(); }
  std::string describe() const {
    static const char* names[] = {"?", "all_reduce", "all_gather", "reduce_scatter", "broadcast",
                                  "barrier", "all_gather_bytes", "broadcast_bytes", "dup", "split"};
    std::ostringstream s;
    s << names[kind >= 0 && kind <= kSplit ? kind : 0] << "(";
    if (dtype >= 0) s << c10::toString(static_cast<c10::ScalarType>(dtype)) << ", " << numel << " elements";
    if (kind == kAllReduce || kind == kReduceScatter) s << ", " << to_string(static_cast<ReduceOp>(extra));
    if (kind == kBroadcast || kind == kBroadcastBytes) s << (dtype >= 0 ? ", " : "") << "root " << extra;
    s << ") as collective #" << sequence << " with rings from " << ring_threshold << " bytes"
      << (hierarchical ? ", two levels across hosts" : ", one level across hosts");
    return s.str();
  }
};

void Communicator::ensure_usable() {
  if (!failure_.empty()) {
    throw CommError(c10::str("ztrain: communicator '", name(), "' is unusable after an earlier failure: ", failure_),
                    world_rank_, "collective", -1);
  }
  ++stats_.calls;
}

void Communicator::begin(const Call& call) {
  ensure_usable();
  ++sequence_;
  if (!options_.debug) return;
  Call mine = call;
  mine.sequence = sequence_;
  mine.ring_threshold = options_.ring_threshold_bytes;
  mine.hierarchical = options_.hierarchical;
  std::vector<Call> all(size_);
  auto mine_bytes = bytes_tensor({reinterpret_cast<const char*>(&mine), sizeof(Call)});
  auto all_bytes = torch::from_blob(all.data(), {static_cast<int64_t>(size_ * sizeof(Call))}, torch::kUInt8);
  control_all_gather(mine_bytes, all_bytes, "debug check");
  if (std::all_of(all.begin(), all.end(), [&](const Call& c) { return c == all[0]; })) return;
  std::map<Call, std::vector<int>> groups;
  for (int r = 0; r < size_; ++r) groups[all[r]].push_back(r);
  std::ostringstream msg;
  msg << "ztrain: collective mismatch on communicator '" << name() << "' (debug mode): ";
  bool first = true;
  for (auto& [c, ranks] : groups) {
    msg << (first ? "" : "; ") << (ranks.size() > 1 ? "ranks " : "rank ");
    for (size_t i = 0; i < ranks.size(); ++i) {
      msg << (i ? "," : "") << ranks[i];
      if (world_rank_of(ranks[i]) != ranks[i]) msg << " (world " << world_rank_of(ranks[i]) << ")";
    }
    msg << " called " << c.describe();
    first = false;
  }
  msg << ". Every member must make the same collective calls in the same order.";
  throw Error(msg.str());
}

// ---- construction --------------------------------------------------------------------------

Communicator::Communicator(std::unique_ptr<Transport> transport, CommunicatorOptions options)
    : transport_(std::move(transport)), options_(std::move(options)) {
  ZTRAIN_CHECK(transport_ != nullptr, "Communicator '", options_.name, "': the transport is null");
  ZTRAIN_CHECK(options_.timeout.count() > 0, "communicator timeout must be positive, got ", options_.timeout.count(),
               " ms");
  rank_ = transport_->rank();
  size_ = transport_->size();
  world_rank_ = transport_->world_ranks().at(rank_);
  if (size_ == 1) {
    host_local_ = true;
    return;
  }
  // Fixed-size records, so one all_gather of bytes tells every member where the others run.
  constexpr size_t kIdentityBytes = 320;
  auto identity = host_identity();
  identity.resize(kIdentityBytes, '\0');
  auto all = torch::empty({static_cast<int64_t>(kIdentityBytes) * size_}, torch::kUInt8);
  control_all_gather(bytes_tensor(identity), all, "finding the members' hosts");
  const char* at = static_cast<const char*>(all.data_ptr());
  std::vector<std::string> identities;
  for (int m = 0; m < size_; ++m) identities.emplace_back(at + m * kIdentityBytes, kIdentityBytes);
  place_members(identities);
}

void Communicator::place_members(const std::vector<std::string>& identities) {
  std::vector<std::vector<int>> members;  // by host, hosts in order of their lowest member
  std::vector<const std::string*> seen;
  for (int m = 0; m < size_; ++m) {
    auto at = std::find_if(seen.begin(), seen.end(), [&](const std::string* s) { return *s == identities[m]; });
    if (at == seen.end()) {
      seen.push_back(&identities[m]);
      members.emplace_back();
      at = seen.end() - 1;
    }
    members[at - seen.begin()].push_back(m);
  }
  hosts_ = static_cast<int>(members.size());
  host_local_ = hosts_ == 1;
  per_host_ = static_cast<int>(members[0].size());
  for (const auto& on_host : members) {
    if (static_cast<int>(on_host.size()) != per_host_) per_host_ = 0;
  }
  if (per_host_ > 0) {
    for (const auto& on_host : members) by_host_.insert(by_host_.end(), on_host.begin(), on_host.end());
  }
}

Communicator::~Communicator() = default;

int Communicator::world_rank_of(int group_rank) const {
  ZTRAIN_CHECK(group_rank >= 0 && group_rank < size_, "rank ", group_rank, " is not in communicator '", name(),
               "' of size ", size_);
  return transport_->world_ranks()[group_rank];
}

void Communicator::set_timeout(std::chrono::milliseconds timeout) {
  ZTRAIN_CHECK(timeout.count() > 0, "communicator timeout must be positive, got ", timeout.count(), " ms");
  options_.timeout = timeout;
  for (auto* level : {levels_.host.get(), levels_.across.get()}) {
    if (level) level->set_timeout(timeout);
  }
}

void Communicator::set_debug(bool on) {
  options_.debug = on;
  for (auto* level : {levels_.host.get(), levels_.across.get()}) {
    if (level) level->set_debug(on);
  }
}

void Communicator::check_tensor(const torch::Tensor& t, const char* call, const char* what) const {
  ZTRAIN_CHECK(t.defined(), call, ": ", what, " is an undefined tensor");
  ZTRAIN_CHECK(t.device() == device() || t.is_cpu() || t.is_cuda(), call, ": communicator '", name(), "' (",
               transport_->backend(), ") moves tensors on ", device(), " and stages cpu and cuda ones, ", what,
               " is on ", t.device());
  ZTRAIN_CHECK(t.is_contiguous(), call, ": ", what, " must be contiguous (sizes ", t.sizes(), ", strides ",
               t.strides(), "); pass a contiguous buffer — ztrain never copies silently");
  ZTRAIN_CHECK(supported(t.scalar_type()), call, ": dtype ", t.scalar_type(), " of ", what,
               " is not supported (use float32, float64, bfloat16, float16, int32, int64, uint8 or bool)");
  ZTRAIN_CHECK(t.numel() <= INT_MAX, call, ": ", what, " has ", t.numel(), " elements; one call moves at most ",
               INT_MAX, " elements per rank");
}

torch::Tensor Communicator::stage(const torch::Tensor& t, bool read) {
  // One rank: every collective is a copy or nothing, which runs on the tensor's own device.
  if (t.device() == device() || size_ == 1) return t;
  stats_.staged_bytes += t.nbytes();
  // Pinned host memory, so that copies to and from the device run at full speed.
  auto staged = torch::empty(t.sizes(), t.options().device(device()).pinned_memory(device().is_cpu()));
  if (read) staged.copy_(t);
  return staged;
}

void Communicator::unstage(const torch::Tensor& t, const torch::Tensor& staged) {
  if (!staged.is_same(t)) t.copy_(staged);
}

// ---- waiting and errors --------------------------------------------------------------------

void Communicator::fail(const std::string& what, const char* op, int peer) {
  failure_ = what;
  transport_->on_failure();
  throw CommError(what, world_rank_, op, peer);
}

void Communicator::wait(TransportRequestPtr request, const char* op, int peer) {
  wait_for({request.get()}, op, peer);
}

void Communicator::wait_all(std::vector<TransportRequestPtr>& requests, const char* op, int peer) {
  std::vector<TransportRequest*> pending;
  for (auto& r : requests) pending.push_back(r.get());
  wait_for(std::move(pending), op, peer);
}

void Communicator::wait_for(std::vector<TransportRequest*> requests, const char* op, int peer) {
  if (guarded(op, peer, [&] { return detail::poll_until_done(requests, options_.timeout); })) return;
  timed_out(op, peer);
}

void Communicator::timed_out(const char* op, int peer) {
  const std::string who =
      peer >= 0 ? c10::str("rank ", peer, " (world rank ", world_rank_of(peer), ")") : std::string("a member");
  fail(c10::str("ztrain: ", op, " on communicator '", name(), "' timed out after ", seconds(options_.timeout),
                " on world rank ", world_rank_, " (rank ", rank_, " of ", size_, "): ", who,
                " did not take part — it is dead, stuck, cut off, or called a different operation (set "
                "ZTRAIN_DEBUG_COLLECTIVES=1 to check agreement)"),
       op, peer);
}

namespace detail {

bool poll_until_done(std::vector<TransportRequest*>& requests, std::chrono::milliseconds timeout) {
  using clock = std::chrono::steady_clock;
  const auto start = clock::now();
  const auto deadline = start + timeout;
  for (int64_t polls = 0;; ++polls) {
    bool done = true;
    for (auto& r : requests) {
      if (r && r->test()) r = nullptr;
      done = done && !r;
    }
    if (done) return true;
    if (polls < 256) continue;  // hot: most operations complete within microseconds
    const auto now = clock::now();
    if (now >= deadline) return false;
    if (now - start < std::chrono::milliseconds(20)) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }
}

}  // namespace detail

// ---- algorithm choice ------------------------------------------------------------------------

bool Communicator::run_all_reduce(const torch::Tensor& flat, ReduceOp op, const char* call) {
  if (size_ == 1 || flat.numel() == 0) return false;
  const bool big = large(flat.nbytes());
  if (big && host_shared_all_reduce(flat, op, call)) return true;
  if (big && hierarchical_all_reduce(flat, op, call)) return false;
  if (!big || flat.numel() < size_) {
    if (auto r = guarded(call, -1, [&] { return transport_->all_reduce(flat, transport_op(op)); })) {
      wait(std::move(r), call, -1);
      return false;
    }
  }
  // Reduce-scatter into this rank's segment (in place), then all-gather the segments.
  const auto bounds = detail::even_bounds(flat.numel(), size_);
  ring_reduce_scatter(flat, bounds, detail::segment(flat, bounds, rank_), op, call);
  ring_all_gather(flat, bounds, torch::Tensor(), call);
  return false;
}

void Communicator::run_all_gather(const torch::Tensor& input, const torch::Tensor& output, bool in_place,
                                  const char* call) {
  if (input.numel() == 0) return;
  if (size_ == 1) {
    if (!in_place) output.copy_(input.view_as(output));
    return;
  }
  const bool big = large(output.nbytes());
  if (big && (host_shared_all_gather(input, output, in_place, call) || hierarchical_all_gather(input, output, call))) {
    return;
  }
  if (!big) {
    if (auto r = guarded(call, -1, [&] { return transport_->all_gather(input, output); })) {
      wait(std::move(r), call, -1);
      return;
    }
  }
  ring_all_gather(output.view(-1), detail::even_bounds(output.numel(), size_), input, call);
}

bool Communicator::run_reduce_scatter(const torch::Tensor& input, const torch::Tensor& output, ReduceOp op,
                                      const char* call) {
  if (output.numel() == 0) return false;
  if (size_ == 1) {
    output.copy_(input.view_as(output));
    return false;
  }
  const bool big = large(input.nbytes());
  if (big && host_shared_reduce_scatter(input, output, op, call)) return true;
  if (big && hierarchical_reduce_scatter(input, output, op, call)) return false;
  if (!big) {
    if (auto r = guarded(call, -1, [&] { return transport_->reduce_scatter(input, output, transport_op(op)); })) {
      wait(std::move(r), call, -1);
      return false;
    }
  }
  ring_reduce_scatter(input.view(-1), detail::even_bounds(input.numel(), size_), output.view(-1), op, call);
  return false;
}

void Communicator::control_all_gather(const torch::Tensor& input, const torch::Tensor& output, const char* call) {
  if (size_ == 1) {
    output.copy_(input.view_as(output));
    return;
  }
  if (auto r = guarded(call, -1, [&] { return transport_->all_gather(input, output); })) {
    wait(std::move(r), call, -1);
    return;
  }
  ring_all_gather(output.view(-1), detail::even_bounds(output.numel(), size_), input, call);
}

void Communicator::control_all_reduce(const torch::Tensor& flat, ReduceOp op, const char* call) {
  if (size_ == 1) return;
  if (auto r = guarded(call, -1, [&] { return transport_->all_reduce(flat, op); })) {
    wait(std::move(r), call, -1);
    return;
  }
  const auto bounds = detail::even_bounds(flat.numel(), size_);
  ring_reduce_scatter(flat, bounds, detail::segment(flat, bounds, rank_), op, call);
  ring_all_gather(flat, bounds, torch::Tensor(), call);
}

void Communicator::run_broadcast(const torch::Tensor& tensor, int root, const char* call) {
  if (size_ == 1 || tensor.numel() == 0) return;
  if (auto r = guarded(call, root, [&] { return transport_->broadcast(tensor, root); })) {
    wait(std::move(r), call, root);
    return;
  }
  tree_broadcast(tensor, root, call);
}

void Communicator::run_barrier(const char* call) {
  if (size_ == 1) return;
  if (auto r = guarded(call, -1, [&] { return transport_->barrier(); })) {
    wait(std::move(r), call, -1);
    return;
  }
  dissemination_barrier(call);
}

// ---- collectives ---------------------------------------------------------------------------

void Communicator::all_reduce(const torch::Tensor& tensor, ReduceOp op) {
  constexpr const char* kCall = "all_reduce";
  check_tensor(tensor, kCall, "tensor");
  check_op(tensor.scalar_type(), op, kCall);
  begin({kAllReduce, static_cast<int32_t>(tensor.scalar_type()), tensor.numel(), static_cast<int64_t>(op)});
  stats_.all_reduce_bytes += tensor.nbytes();
  const auto flat = stage(tensor, true);
  const bool averaged = run_all_reduce(flat.view(-1), op, kCall);
  if (op == ReduceOp::kAvg && size_ > 1 && !averaged) divide_by_members(flat, size_);
  unstage(tensor, flat);
}

void Communicator::all_gather(const torch::Tensor& input, const torch::Tensor& output) {
  constexpr const char* kCall = "all_gather";
  check_tensor(input, kCall, "input");
  check_tensor(output, kCall, "output");
  ZTRAIN_CHECK(input.scalar_type() == output.scalar_type(), "all_gather: input is ", input.scalar_type(),
               " but output is ", output.scalar_type());
  ZTRAIN_CHECK(input.device() == output.device(), "all_gather: input is on ", input.device(), " but output on ",
               output.device());
  ZTRAIN_CHECK(output.numel() == input.numel() * size_, "all_gather: output must hold size() * input.numel() = ",
               size_, " * ", input.numel(), " = ", size_ * input.numel(), " elements, got ", output.numel());
  const char* own = static_cast<const char*>(output.data_ptr()) + rank_ * input.nbytes();
  const bool in_place = input.numel() > 0 && input.data_ptr() == own;
  ZTRAIN_CHECK(in_place || !overlaps(input, output), "all_gather: input overlaps output without being this rank's "
               "slice of it");
  begin({kAllGather, static_cast<int32_t>(input.scalar_type()), input.numel(), 0});
  stats_.all_gather_bytes += input.nbytes();
  const auto staged_output = stage(output, false);
  const auto staged_input = in_place && staged_output.is_same(output) ? input : stage(input, true);
  run_all_gather(staged_input, staged_output, in_place && staged_input.is_same(input), kCall);
  unstage(output, staged_output);
}

void Communicator::reduce_scatter(const torch::Tensor& input, const torch::Tensor& output, ReduceOp op) {
  constexpr const char* kCall = "reduce_scatter";
  check_tensor(input, kCall, "input");
  check_tensor(output, kCall, "output");
  ZTRAIN_CHECK(input.scalar_type() == output.scalar_type(), "reduce_scatter: input is ", input.scalar_type(),
               " but output is ", output.scalar_type());
  ZTRAIN_CHECK(input.device() == output.device(), "reduce_scatter: input is on ", input.device(), " but output on ",
               output.device());
  ZTRAIN_CHECK(input.numel() == output.numel() * size_, "reduce_scatter: input must hold size() * output.numel() = ",
               size_, " * ", output.numel(), " = ", size_ * output.numel(), " elements, got ", input.numel());
  ZTRAIN_CHECK(!overlaps(input, output), "reduce_scatter: input and output must not overlap");
  check_op(input.scalar_type(), op, kCall);
  begin({kReduceScatter, static_cast<int32_t>(input.scalar_type()), output.numel(), static_cast<int64_t>(op)});
  stats_.reduce_scatter_bytes += input.nbytes();
  const auto staged_output = stage(output, false);
  const bool averaged = run_reduce_scatter(stage(input, true), staged_output, op, kCall);
  if (op == ReduceOp::kAvg && size_ > 1 && output.numel() > 0 && !averaged) divide_by_members(staged_output, size_);
  unstage(output, staged_output);
}

void Communicator::broadcast(const torch::Tensor& tensor, int root) {
  constexpr const char* kCall = "broadcast";
  check_tensor(tensor, kCall, "tensor");
  ZTRAIN_CHECK(root >= 0 && root < size_, "broadcast: root ", root, " is not a rank of communicator '", name(),
               "' (size ", size_, ")");
  begin({kBroadcast, static_cast<int32_t>(tensor.scalar_type()), tensor.numel(), root});
  if (rank_ == root) stats_.broadcast_bytes += tensor.nbytes();
  const auto staged = stage(tensor, rank_ == root);
  run_broadcast(staged, root, kCall);
  unstage(tensor, staged);
}

void Communicator::check_point_to_point(const torch::Tensor& tensor, const char* call, const char* role, int peer,
                                        int tag) {
  check_tensor(tensor, call, "tensor");
  ZTRAIN_CHECK(peer >= 0 && peer < size_ && peer != rank_, call, ": ", role, " ", peer,
               " must be another rank of communicator '", name(), "' (size ", size_, ", this rank ", rank_, ")");
  ZTRAIN_CHECK(tag >= 0 && tag <= kMaxUserTag, call, ": tag must be in [0, ", kMaxUserTag, "], got ", tag);
  ensure_usable();
}

void Communicator::send(const torch::Tensor& tensor, int dst, int tag) {
  constexpr const char* kCall = "send";
  check_point_to_point(tensor, kCall, "destination", dst, tag);
  stats_.send_bytes += tensor.nbytes();
  const auto staged = stage(tensor, true);
  wait(guarded(kCall, dst, [&] { return transport_->send(staged, dst, tag); }), kCall, dst);
}

void Communicator::recv(const torch::Tensor& tensor, int src, int tag) {
  constexpr const char* kCall = "recv";
  check_point_to_point(tensor, kCall, "source", src, tag);
  const auto staged = stage(tensor, false);
  wait(guarded(kCall, src, [&] { return transport_->recv(staged, src, tag); }), kCall, src);
  unstage(tensor, staged);
}

void Communicator::barrier() {
  begin({kBarrier});
  barrier_on_host("barrier");
}

std::vector<std::string> Communicator::all_gather_bytes(std::string_view bytes) {
  constexpr const char* kCall = "all_gather_bytes";
  ZTRAIN_CHECK(bytes.size() <= INT_MAX, kCall, ": at most ", INT_MAX, " bytes, got ", bytes.size());
  begin({kGatherBytes});
  // The lengths first, then every rank's bytes padded to the longest.
  auto mine = torch::tensor({static_cast<int64_t>(bytes.size())}, torch::kInt64);
  auto sizes = torch::empty({size_}, torch::kInt64);
  control_all_gather(mine, sizes, kCall);
  const int64_t longest = sizes.max().item<int64_t>();
  ZTRAIN_CHECK(longest * size_ <= INT_MAX, kCall, ": ", longest * size_, " bytes in all exceed the limit of ", INT_MAX);
  std::vector<std::string> out(size_);
  if (longest == 0) return out;
  auto padded = torch::zeros({longest}, torch::kUInt8);
  std::memcpy(padded.data_ptr(), bytes.data(), bytes.size());
  auto all = torch::empty({longest * size_}, torch::kUInt8);
  control_all_gather(padded, all, kCall);
  const auto* at = static_cast<const char*>(all.data_ptr());
  for (int r = 0; r < size_; ++r) out[r].assign(at + r * longest, sizes[r].item<int64_t>());
  return out;
}

std::string Communicator::broadcast_bytes(std::string_view bytes, int root) {
  constexpr const char* kCall = "broadcast_bytes";
  ZTRAIN_CHECK(root >= 0 && root < size_, kCall, ": root ", root, " is not a rank of communicator '", name(),
               "' (size ", size_, ")");
  ZTRAIN_CHECK(bytes.size() <= INT_MAX, kCall, ": at most ", INT_MAX, " bytes, got ", bytes.size());
  begin({kBroadcastBytes, -1, 0, root});
  auto n = torch::tensor({static_cast<int64_t>(bytes.size())}, torch::kInt64);
  run_broadcast(n, root, kCall);
  std::string out = rank_ == root ? std::string(bytes) : std::string(n.item<int64_t>(), '\0');
  if (!out.empty()) run_broadcast(bytes_tensor(out), root, kCall);
  return out;
}

std::unique_ptr<Communicator> Communicator::adopt(std::unique_ptr<PendingTransport> pending, const char* op,
                                                  const std::string& name) {
  ZTRAIN_INTERNAL_ASSERT(pending != nullptr, op, ": the transport returned no request");
  wait_for({pending.get()}, op, -1);
  auto transport = pending->take();
  ZTRAIN_INTERNAL_ASSERT(transport != nullptr, op, ": the transport created no group for this rank");
  auto opts = options_;
  opts.name = name;
  return std::make_unique<Communicator>(std::move(transport), opts);
}

std::unique_ptr<Communicator> Communicator::dup(const std::string& name) {
  begin({kDup});
  return adopt(guarded("dup", -1, [&] { return transport_->dup(); }), "dup", name);
}

std::unique_ptr<Communicator> Communicator::split(int color, int key, const std::string& name) {
  constexpr const char* kCall = "split";
  ZTRAIN_CHECK(color >= 0, "split: color must be non-negative, got ", color);
  begin({kSplit});
  // Every member shows up with its color first, within the deadline: a member that died before
  // the split then fails the others here instead of leaving them in a blocking creation.
  auto mine = torch::tensor({color, key}, torch::kInt32);
  auto all = torch::empty({2 * size_}, torch::kInt32);
  control_all_gather(mine, all, kCall);
  return adopt(guarded(kCall, -1, [&] { return transport_->split(color, key); }), kCall, name);
}

// ---- conveniences ----------------------------------------------------------------------------

torch::Tensor Communicator::all_gather(const torch::Tensor& input) {
  auto output = torch::empty({input.numel() * size()}, input.options());
  all_gather(input, output);
  return output;
}

torch::Tensor Communicator::reduce_scatter(const torch::Tensor& input, ReduceOp op) {
  ZTRAIN_CHECK(input.numel() % size() == 0, "reduce_scatter: input of ", input.numel(),
               " elements does not divide into ", size(), " equal slices; pad it to a multiple of ", size());
  auto output = torch::empty({input.numel() / size()}, input.options());
  reduce_scatter(input, output, op);
  return output;
}

double Communicator::all_reduce_scalar(double value, ReduceOp op) {
  auto t = torch::tensor({value}, torch::TensorOptions().dtype(torch::kFloat64).device(device()));
  all_reduce(t, op);
  return t.item<double>();
}

int64_t Communicator::all_reduce_scalar(int64_t value, ReduceOp op) {
  auto t = torch::tensor({value}, torch::TensorOptions().dtype(torch::kInt64).device(device()));
  all_reduce(t, op);
  return t.item<int64_t>();
}

HostLayout host_layout(Communicator& comm, std::string_view alike) {
  const auto hosts = comm.all_gather_bytes(host_identity() + '\n' + std::string(alike));
  HostLayout out{0, 0};
  for (int r = 0; r < comm.size(); ++r) {
    if (hosts[r] != hosts[comm.rank()]) continue;
    if (r < comm.rank()) ++out.local_rank;
    ++out.local_size;
  }
  return out;
}

}  // namespace ztrain
