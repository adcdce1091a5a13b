#include <ztrain/comm/mpi/communicator.h>

#include "../host_shared_detail.h"

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <climits>
#include <cstring>
#include <iostream>
#include <map>
#include <mutex>
#include <sstream>
#include <thread>

// How it works
// ------------
// Each call validates its tensors (so bad input never leaves a peer blocked), optionally runs
// the debug agreement check, starts the non-blocking MPI operation and then polls MPI_Test.
// Polling drives MPI's progress engine (shared-memory copies and the schedules of non-blocking
// collectives advance only inside MPI calls), so the waiter spins hot at first, then yields,
// and only after a while without completion backs off to short sleeps. Past the deadline the
// request is abandoned: the communicator records the failure and refuses later calls, and
// the runtime skips MPI_Finalize, which would block on the missing peer.

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

namespace detail {
namespace {
std::atomic<bool> g_mpi_failure{false};
}
bool mpi_failure_seen() { return g_mpi_failure.load(); }
}  // namespace detail

namespace {

// ---- custom reductions for 16-bit floats ---------------------------------------------------

template <class T, class F>
void reduce16(void* in, void* inout, int* len, F f) {
  auto* a = static_cast<const T*>(in);
  auto* b = static_cast<T*>(inout);
  for (int i = 0; i < *len; ++i) b[i] = T(f(static_cast<float>(a[i]), static_cast<float>(b[i])));
}
struct Sum { float operator()(float a, float b) const { return a + b; } };
struct Max { float operator()(float a, float b) const { return (a > b || a != a) ? a : b; } };
struct Min { float operator()(float a, float b) const { return (a < b || a != a) ? a : b; } };

template <class T, class F>
void reduce16_fn(void* in, void* inout, int* len, MPI_Datatype*) { reduce16<T>(in, inout, len, F{}); }

struct CustomOps {
  MPI_Op bf16[3];  // sum, max, min
  MPI_Op f16[3];
};

const CustomOps& custom_ops() {
  static CustomOps ops = [] {
    CustomOps o{};
    MPI_Op_create(&reduce16_fn<c10::BFloat16, Sum>, 1, &o.bf16[0]);
    MPI_Op_create(&reduce16_fn<c10::BFloat16, Max>, 1, &o.bf16[1]);
    MPI_Op_create(&reduce16_fn<c10::BFloat16, Min>, 1, &o.bf16[2]);
    MPI_Op_create(&reduce16_fn<c10::Half, Sum>, 1, &o.f16[0]);
    MPI_Op_create(&reduce16_fn<c10::Half, Max>, 1, &o.f16[1]);
    MPI_Op_create(&reduce16_fn<c10::Half, Min>, 1, &o.f16[2]);
    return o;
  }();
  return ops;
}

bool supported(c10::ScalarType t) {
  switch (t) {
    case at::kFloat: case at::kDouble: case at::kBFloat16: case at::kHalf:
    case at::kInt: case at::kLong: case at::kByte: case at::kBool:
      return true;
    default:
      return false;
  }
}

MPI_Datatype mpi_type(c10::ScalarType t) {
  switch (t) {
    case at::kFloat: return MPI_FLOAT;
    case at::kDouble: return MPI_DOUBLE;
    case at::kBFloat16: case at::kHalf: return MPI_UINT16_T;
    case at::kInt: return MPI_INT32_T;
    case at::kLong: return MPI_INT64_T;
    case at::kByte: return MPI_UINT8_T;
    case at::kBool: return MPI_C_BOOL;
    default: break;
  }
  ZTRAIN_INTERNAL_ASSERT(false, "no MPI type for ", t);
}

MPI_Op mpi_op(c10::ScalarType t, ReduceOp op, const char* call) {
  int idx = op == ReduceOp::kMax ? 1 : op == ReduceOp::kMin ? 2 : 0;
  if (t == at::kBFloat16) return custom_ops().bf16[idx];
  if (t == at::kHalf) return custom_ops().f16[idx];
  if (t == at::kBool) {
    ZTRAIN_CHECK(op != ReduceOp::kAvg, call, ": ReduceOp::kAvg needs a floating dtype, got bool");
    return op == ReduceOp::kMin ? MPI_LAND : MPI_LOR;
  }
  if (op == ReduceOp::kAvg) {
    ZTRAIN_CHECK(at::isFloatingType(t), call, ": ReduceOp::kAvg needs a floating dtype, got ", t,
                 "; reduce with kSum and divide yourself");
  }
  return idx == 1 ? MPI_MAX : idx == 2 ? MPI_MIN : MPI_SUM;
}

void check_tensor(const torch::Tensor& t, const char* call, const char* what) {
  ZTRAIN_CHECK(t.defined(), call, ": ", what, " is an undefined tensor");
  ZTRAIN_CHECK(t.device().is_cpu(), call, ": the MPI communicator works on CPU tensors, ", what,
               " is on ", t.device());
  ZTRAIN_CHECK(t.is_contiguous(), call, ": ", what, " must be contiguous (sizes ", t.sizes(),
               ", strides ", t.strides(), "); pass a contiguous buffer — ztrain never copies "
               "silently");
  ZTRAIN_CHECK(supported(t.scalar_type()), call, ": dtype ", t.scalar_type(), " of ", what,
               " is not supported (use float32, float64, bfloat16, float16, int32, int64, "
               "uint8 or bool)");
  ZTRAIN_CHECK(t.numel() <= INT_MAX, call, ": ", what, " has ", t.numel(),
               " elements; one call moves at most ", INT_MAX, " elements per rank");
}

int count(const torch::Tensor& t) { return static_cast<int>(t.numel()); }

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

}  // namespace

// ---- the debug agreement check -------------------------------------------------------------

enum CallKind : int32_t { kAllReduce = 1, kAllGather, kReduceScatter, kBroadcast, kBarrier, kGatherBytes,
                          kBroadcastBytes, kDup, kSplit };

struct MpiCommunicator::Call {
  int32_t kind = 0;
  int32_t dtype = -1;   // c10::ScalarType, -1 when none
  int64_t numel = 0;    // per-rank contribution
  int64_t extra = 0;    // reduce op or root
  int64_t sequence = 0;
  int64_t ring_threshold = 0;  // ranks must agree, or they would run different algorithms

  auto key() const { return std::tie(kind, dtype, numel, extra, sequence, ring_threshold); }
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
    s << ") as collective #" << sequence << " with rings from " << ring_threshold << " bytes";
    return s.str();
  }
};

void MpiCommunicator::ensure_usable() {
  if (!failure_.empty()) {
    throw CommError(c10::str("ztrain: communicator '", name(), "' is unusable after an earlier "
                             "failure: ", failure_),
                    world_rank_, "collective", -1);
  }
  ++stats_.calls;
}

void MpiCommunicator::begin(const Call& call) {
  ensure_usable();
  ++sequence_;
  if (!options_.debug) return;
  Call mine = call;
  mine.sequence = sequence_;
  mine.ring_threshold = options_.ring_threshold_bytes;
  std::vector<Call> all(size_);
  MPI_Request req;
  check_mpi(MPI_Iallgather(&mine, sizeof(Call), MPI_BYTE, all.data(), sizeof(Call), MPI_BYTE, comm_, &req),
            "debug check", -1);
  wait(req, "debug check", -1);
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
      if (world_ranks_[ranks[i]] != ranks[i]) msg << " (world " << world_ranks_[ranks[i]] << ")";
    }
    msg << " called " << c.describe();
    first = false;
  }
  msg << ". Every member must make the same collective calls in the same order.";
  throw Error(msg.str());
}

// ---- construction --------------------------------------------------------------------------

MpiCommunicator::MpiCommunicator(MPI_Comm comm, MpiCommunicatorOptions options)
    : options_(std::move(options)) {
  int initialized = 0;
  MPI_Initialized(&initialized);
  ZTRAIN_CHECK(initialized, "ztrain: MPI is not initialised; call ztrain::init_distributed() first");
  ZTRAIN_CHECK(options_.timeout.count() > 0, "communicator timeout must be positive, got ",
               options_.timeout.count(), " ms");
  MPI_Comm_rank(MPI_COMM_WORLD, &world_rank_);
  check_mpi(MPI_Comm_dup(comm, &comm_), "MPI_Comm_dup", -1);
  MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN);
  MPI_Comm_rank(comm_, &rank_);
  MPI_Comm_size(comm_, &size_);
  MPI_Group world_group, group;
  MPI_Comm_group(MPI_COMM_WORLD, &world_group);
  MPI_Comm_group(comm_, &group);
  std::vector<int> ranks(size_);
  for (int i = 0; i < size_; ++i) ranks[i] = i;
  world_ranks_.resize(size_);
  MPI_Group_translate_ranks(group, size_, ranks.data(), world_group, world_ranks_.data());
  MPI_Group_free(&group);
  MPI_Group_free(&world_group);
  MPI_Comm host = MPI_COMM_NULL;
  check_mpi(MPI_Comm_split_type(comm_, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &host), "MPI_Comm_split_type", -1);
  int host_size = 0;
  MPI_Comm_size(host, &host_size);
  MPI_Comm_free(&host);
  host_local_ = host_size == size_;
  (void)custom_ops();
}

MpiCommunicator::~MpiCommunicator() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  // After a failure anywhere, requests may be abandoned and peers gone: freeing could block, so
  // the handle is left to process exit.
  if (comm_ != MPI_COMM_NULL && !finalized && !detail::mpi_failure_seen()) MPI_Comm_free(&comm_);
}

int MpiCommunicator::world_rank_of(int group_rank) const {
  ZTRAIN_CHECK(group_rank >= 0 && group_rank < size_, "rank ", group_rank,
               " is not in communicator '", name(), "' of size ", size_);
  return world_ranks_[group_rank];
}

void MpiCommunicator::set_timeout(std::chrono::milliseconds timeout) {
  ZTRAIN_CHECK(timeout.count() > 0, "communicator timeout must be positive, got ", timeout.count(), " ms");
  options_.timeout = timeout;
}

// ---- waiting and errors --------------------------------------------------------------------

void MpiCommunicator::fail(const std::string& what, const char* op, int peer) {
  failure_ = what;
  detail::g_mpi_failure = true;
  throw CommError(what, world_rank_, op, peer);
}

void MpiCommunicator::check_mpi(int code, const char* op, int peer) {
  if (code == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(code, text, &len);
  fail(c10::str("ztrain: ", op, " on communicator '", name(), "' failed on world rank ", world_rank_,
                peer >= 0 ? c10::str(" (peer rank ", peer, ")") : std::string(), ": MPI error: ",
                std::string(text, len)),
       op, peer);
}

void MpiCommunicator::wait(MPI_Request& request, const char* op, int peer, MPI_Status* status) {
  wait_all(&request, 1, op, peer, status == MPI_STATUS_IGNORE ? MPI_STATUSES_IGNORE : status);
}

void MpiCommunicator::wait_all(MPI_Request* requests, int count, const char* op, int peer, MPI_Status* statuses) {
  using clock = std::chrono::steady_clock;
  const auto start = clock::now();
  const auto deadline = start + options_.timeout;
  for (int64_t polls = 0;; ++polls) {
    int done = 0;
    check_mpi(MPI_Testall(count, requests, &done, statuses), op, peer);
    if (done) return;
    if (polls < 256) continue;  // hot: most operations complete within microseconds
    const auto now = clock::now();
    if (now >= deadline) {
      std::string who = peer >= 0 ? c10::str("rank ", peer, " (world rank ", world_ranks_[peer], ")")
                                  : std::string("a member");
      fail(c10::str("ztrain: ", op, " on communicator '", name(), "' timed out after ",
                    seconds(options_.timeout), " on world rank ", world_rank_, " (rank ", rank_,
                    " of ", size_, "): ", who, " did not take part — it is dead, stuck, or called "
                    "a different operation (set ZTRAIN_DEBUG_COLLECTIVES=1 to check agreement)"),
           op, peer);
    }
    if (now - start < std::chrono::milliseconds(20)) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }
}

// ---- rings -----------------------------------------------------------------------------------
//
// A ring over n ranks moves (n-1)/n of the buffer through every rank, the least any algorithm
// can (the "bus bandwidth" bound). Segment i of a flat buffer is [bounds[i], bounds[i+1]).
//
// reduce_scatter: at step s (0 ≤ s < n-1) rank r sends its partial sum of segment r-s-1 to rank
// r+1 and receives rank r-1's partial sum of segment r-s-2, to which it adds its own input. At
// step 0 the "partial sum" sent is the rank's own input; after n-1 steps the segment received
// last, r-n ≡ r, holds the sum over all ranks. all_gather: at step s rank r forwards segment
// r-s, which it already holds, and receives segment r-s-1.

namespace {

constexpr int kRingTag = kMaxUserTag + 1;
// Reduce-scatter steps move and sum this much at a time (see ring_reduce_scatter).
// 256 KiB chunks were 10–30% faster than whole segments at 4–256 MiB on 2 ranks
// (docs/benchmarks.md); the handshake per chunk costs little at that size.
constexpr int64_t kRingChunkBytes = int64_t{256} << 10;

torch::Tensor segment(const torch::Tensor& flat, const std::vector<int64_t>& bounds, int i) {
  return flat.narrow(0, bounds[i], bounds[i + 1] - bounds[i]);
}

std::vector<int64_t> even_bounds(int64_t numel, int n) {
  std::vector<int64_t> b(n + 1);
  for (int i = 0; i <= n; ++i) b[i] = numel * i / n;
  return b;
}

// dst = a (op) b, elementwise, with libtorch's kernels (16-bit floats computed in fp32 and
// rounded to nearest even, as the custom MPI operations do).
void combine(const torch::Tensor& dst, const torch::Tensor& a, const torch::Tensor& b, ReduceOp op) {
  if (dst.scalar_type() == at::kBool) {
    if (op == ReduceOp::kMin) {
      at::logical_and_out(const_cast<torch::Tensor&>(dst), a, b);
    } else {
      at::logical_or_out(const_cast<torch::Tensor&>(dst), a, b);
    }
    return;
  }
  auto& out = const_cast<torch::Tensor&>(dst);
  switch (op) {
    case ReduceOp::kMax: at::maximum_out(out, a, b); break;
    case ReduceOp::kMin: at::minimum_out(out, a, b); break;
    default: at::add_out(out, a, b); break;
  }
}

}  // namespace

void MpiCommunicator::ring_exchange(const torch::Tensor& out, const torch::Tensor& in, const char* op,
                                    const std::function<void()>& overlap) {
  const int next = (rank_ + 1) % size_, prev = (rank_ + size_ - 1) % size_;
  const auto type = mpi_type(out.scalar_type());
  MPI_Request reqs[2] = {MPI_REQUEST_NULL, MPI_REQUEST_NULL};
  if (in.numel() > 0) {
    check_mpi(MPI_Irecv(in.data_ptr(), count(in), type, prev, kRingTag, comm_, &reqs[0]), op, prev);
  }
  if (out.numel() > 0) {
    check_mpi(MPI_Isend(out.data_ptr(), count(out), type, next, kRingTag, comm_, &reqs[1]), op, next);
  }
  if (overlap) overlap();
  // A stall anywhere in the ring reaches every rank through its neighbour, so the neighbour is
  // not named as the culprit: the wait reports the collective as a whole.
  wait_all(reqs, 2, op, -1);
}

void MpiCommunicator::ring_reduce_scatter(const torch::Tensor& input, const std::vector<int64_t>& bounds,
                                          const torch::Tensor& output, ReduceOp op, const char* call) {
  const int n = size_, r = rank_;
  int64_t largest = 0;
  for (int i = 0; i < n; ++i) largest = std::max(largest, bounds[i + 1] - bounds[i]);
  // Each step moves its segment in chunks and sums every chunk right after it arrives, while it
  // is still in cache, instead of writing a whole segment to memory and reading it back for the
  // sum. Partial sums (rings longer than two) need whole segments. The scratch is kept between calls, since fresh pages
  // for every large call cost more than the copy itself.
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
    auto out = s == 0 ? segment(input, bounds, send_idx) : partial[(s - 1) % 2].narrow(0, 0, send_len);
    auto dst = s == n - 2 ? output : partial[s % 2].narrow(0, 0, recv_len);
    auto own = segment(input, bounds, recv_idx);
    // The neighbours cut the segment they pass the same way, so every chunk sent is received
    // as a chunk of the same size.
    for (int64_t at = 0; at < std::max(send_len, recv_len); at += chunk) {
      const int64_t send_n = std::clamp<int64_t>(send_len - at, 0, chunk);
      const int64_t recv_n = std::clamp<int64_t>(recv_len - at, 0, chunk);
      auto in = received.narrow(0, 0, recv_n);
      ring_exchange(out.narrow(0, std::min(at, send_len), send_n), in, call);
      if (recv_n > 0) combine(dst.narrow(0, at, recv_n), in, own.narrow(0, at, recv_n), op);
    }
  }
}

torch::Tensor MpiCommunicator::scratch_for(c10::ScalarType dtype, int64_t numel) {
  auto& buffer = scratch_[dtype];
  if (!buffer.defined() || buffer.numel() < numel) buffer = torch::empty({numel}, torch::dtype(dtype));
  return buffer.narrow(0, 0, numel);
}

void MpiCommunicator::ring_all_gather(const torch::Tensor& output, const std::vector<int64_t>& bounds,
                                      const torch::Tensor& own_input, const char* call) {
  const int n = size_, r = rank_;
  auto own = segment(output, bounds, r);
  const bool copy_own = own_input.defined() && own_input.data_ptr() != own.data_ptr();
  for (int s = 0; s < n - 1; ++s) {
    const int send_idx = ((r - s) % n + n) % n, recv_idx = ((r - s - 1) % n + n) % n;
    // Step 0 sends straight from the caller's input and copies it into place meanwhile.
    auto out = s == 0 && copy_own ? own_input : segment(output, bounds, send_idx);
    std::function<void()> overlap;
    if (s == 0 && copy_own) overlap = [&] { own.copy_(own_input.view(-1)); };
    ring_exchange(out, segment(output, bounds, recv_idx), call, overlap);
  }
}

// ---- host-shared buffers ---------------------------------------------------------------------
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

namespace {

// Below this, reductions go through libtorch in chunks this size (kept in cache between the
// steps of a sum over more than two members).
constexpr int64_t kReduceChunkBytes = int64_t{256} << 10;

torch::Tensor view_of(const char* data, int64_t numel, c10::ScalarType dtype) {
  return torch::from_blob(const_cast<char*>(data), {numel}, torch::dtype(dtype));
}

}  // namespace

MpiCommunicator::Members MpiCommunicator::map_members(const std::vector<torch::Tensor>& buffers, const char* call) {
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
    if (auto range = options_.host_shared ? detail::find_host_shared(buffer.data_ptr(), buffer.nbytes())
                                          : std::nullopt) {
      mine[b].shared = 1;
      mine[b].range = *range;
    }
  }
  std::vector<Entry> all(size_ * count);  // member m's buffer b at m * count + b
  const int entry_bytes = count * static_cast<int>(sizeof(Entry));
  MPI_Request req;
  check_mpi(MPI_Iallgather(mine.data(), entry_bytes, MPI_BYTE, all.data(), entry_bytes, MPI_BYTE, comm_, &req),
            call, -1);
  wait(req, call, -1);
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
  check_mpi(MPI_Iallreduce(MPI_IN_PLACE, &mapped, 1, MPI_INT32_T, MPI_MIN, comm_, &req), call, -1);
  wait(req, call, -1);
  if (mapped) return members;
  // Correct either way, only slower: said once, not for every call.
  static std::once_flag once;
  if (!error.empty()) {
    std::call_once(once, [&] {
      std::cerr << "ztrain: " << call << " on communicator '" << name() << "' cannot map a peer's host-shared "
                << "buffer (" << error << "); collectives on host-shared buffers take the transport instead"
                << std::endl;
    });
  }
  return {};
}

void MpiCommunicator::reduce_members(const torch::Tensor& dst, const std::vector<char*>& members, int64_t offset,
                                     ReduceOp op, bool to_all) {
  const auto dtype = dst.scalar_type();
  const int64_t bytes_offset = offset * dst.element_size();
  std::vector<char*> sources(size_);
  for (int k = 0; k < size_; ++k) sources[k] = members[(rank_ + k) % size_] + bytes_offset;
  if (dtype == at::kFloat && (op == ReduceOp::kSum || op == ReduceOp::kAvg)) {
    auto* const* buffers = reinterpret_cast<float* const*>(sources.data());
    if (to_all) {
      detail::sum_to_all(buffers, size_, dst.numel());
    } else {
      detail::stream_sum(dst.data_ptr<float>(), buffers, size_, dst.numel());
    }
    return;
  }
  const int64_t chunk = std::max<int64_t>(1, kReduceChunkBytes / dst.element_size());
  for (int64_t at = 0; at < dst.numel(); at += chunk) {
    const int64_t len = std::min(chunk, dst.numel() - at);
    auto out = dst.narrow(0, at, len);
    const int64_t skip = at * dst.element_size();
    combine(out, view_of(sources[0] + skip, len, dtype), view_of(sources[1] + skip, len, dtype), op);
    for (int k = 2; k < size_; ++k) combine(out, out, view_of(sources[k] + skip, len, dtype), op);
    // sources[0] is this rank's own buffer, which is `out` itself.
    for (int k = 1; to_all && k < size_; ++k) std::memcpy(sources[k] + skip, out.data_ptr(), out.nbytes());
  }
}

void MpiCommunicator::shared_barrier(const char* call) {
  MPI_Request req;
  check_mpi(MPI_Ibarrier(comm_, &req), call, -1);
  wait(req, call, -1);
}

bool MpiCommunicator::host_shared_all_gather(const torch::Tensor& input, const torch::Tensor& output,
                                             bool in_place, const char* call) {
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
    detail::stream_copy_to_all(dsts.data(), static_cast<int>(dsts.size()),
                               static_cast<const char*>(input.data_ptr()), slice);
  } else {
    // Only the inputs are shared: this rank copies every member's input into its own output.
    auto* out = static_cast<char*>(output.data_ptr());
    for (int k = 1; k <= size_; ++k) {
      const int m = (rank_ + k) % size_;
      if (m != rank_ || !in_place) detail::stream_copy(out + m * slice, members.at[m], slice);
    }
  }
  shared_barrier(call);
  ++stats_.host_shared_calls;
  detail::peer_traffic().all_gather += static_cast<int64_t>((size_ - 1) * slice);
  return true;
}

bool MpiCommunicator::host_shared_reduce_scatter(const torch::Tensor& input, const torch::Tensor& output,
                                                 ReduceOp op, const char* call) {
  const auto members = map_members({input}, call);
  if (members.at.empty()) return false;
  reduce_members(output.view(-1), members.at, rank_ * output.numel(), op, /*to_all=*/false);
  shared_barrier(call);
  ++stats_.host_shared_calls;
  detail::peer_traffic().reduction += (size_ - 1) * static_cast<int64_t>(output.nbytes());
  return true;
}

bool MpiCommunicator::host_shared_all_reduce(const torch::Tensor& flat, ReduceOp op, const char* call) {
  const auto members = map_members({flat}, call);
  if (members.at.empty()) return false;
  const auto bounds = even_bounds(flat.numel(), size_);
  reduce_members(segment(flat, bounds, rank_), members.at, bounds[rank_], op, /*to_all=*/true);
  shared_barrier(call);
  ++stats_.host_shared_calls;
  // Segment rank_ of every peer, read and then written.
  detail::peer_traffic().reduction += 2 * (size_ - 1) * (bounds[rank_ + 1] - bounds[rank_]) * flat.element_size();
  return true;
}

// ---- collectives ---------------------------------------------------------------------------

void MpiCommunicator::all_reduce(const torch::Tensor& tensor, ReduceOp op) {
  constexpr const char* kCall = "all_reduce";
  check_tensor(tensor, kCall, "tensor");
  MPI_Op mop = mpi_op(tensor.scalar_type(), op, kCall);
  begin({kAllReduce, static_cast<int32_t>(tensor.scalar_type()), tensor.numel(), static_cast<int64_t>(op)});
  stats_.all_reduce_bytes += tensor.nbytes();
  if (use_ring(tensor.nbytes()) && host_shared_all_reduce(tensor.view(-1), op, kCall)) {
    // Done by reading the members' buffers.
  } else if (use_ring(tensor.nbytes()) && tensor.numel() >= size_) {
    // Reduce-scatter into this rank's segment (in place), then all-gather the segments.
    auto flat = tensor.view(-1);
    auto bounds = even_bounds(flat.numel(), size_);
    ring_reduce_scatter(flat, bounds, segment(flat, bounds, rank_), op, kCall);
    ring_all_gather(flat, bounds, torch::Tensor(), kCall);
  } else if (size_ > 1 && tensor.numel() > 0) {
    MPI_Request req;
    check_mpi(MPI_Iallreduce(MPI_IN_PLACE, tensor.data_ptr(), count(tensor), mpi_type(tensor.scalar_type()),
                             mop, comm_, &req), kCall, -1);
    wait(req, kCall, -1);
  }
  if (op == ReduceOp::kAvg && size_ > 1) tensor.div_(size_);
}

void MpiCommunicator::all_gather(const torch::Tensor& input, const torch::Tensor& output) {
  constexpr const char* kCall = "all_gather";
  check_tensor(input, kCall, "input");
  check_tensor(output, kCall, "output");
  ZTRAIN_CHECK(input.scalar_type() == output.scalar_type(), "all_gather: input is ", input.scalar_type(),
               " but output is ", output.scalar_type());
  ZTRAIN_CHECK(output.numel() == input.numel() * size_, "all_gather: output must hold size() * input.numel() = ",
               size_, " * ", input.numel(), " = ", size_ * input.numel(), " elements, got ", output.numel());
  const auto slice_bytes = input.nbytes();
  const char* own = static_cast<const char*>(output.data_ptr()) + rank_ * slice_bytes;
  const bool in_place = input.numel() > 0 && input.data_ptr() == own;
  ZTRAIN_CHECK(in_place || !overlaps(input, output), "all_gather: input overlaps output without being "
               "this rank's slice of it");
  begin({kAllGather, static_cast<int32_t>(input.scalar_type()), input.numel(), 0});
  stats_.all_gather_bytes += slice_bytes;
  if (input.numel() == 0) return;
  if (size_ == 1) {
    if (!in_place) output.copy_(input.view_as(output));
    return;
  }
  if (use_ring(output.nbytes())) {
    if (host_shared_all_gather(input, output, in_place, kCall)) return;
    ring_all_gather(output.view(-1), even_bounds(output.numel(), size_), input, kCall);
    return;
  }
  auto type = mpi_type(input.scalar_type());
  MPI_Request req;
  check_mpi(MPI_Iallgather(in_place ? MPI_IN_PLACE : input.data_ptr(), count(input), type,
                           output.data_ptr(), count(input), type, comm_, &req), kCall, -1);
  wait(req, kCall, -1);
}

void MpiCommunicator::reduce_scatter(const torch::Tensor& input, const torch::Tensor& output, ReduceOp op) {
  constexpr const char* kCall = "reduce_scatter";
  check_tensor(input, kCall, "input");
  check_tensor(output, kCall, "output");
  ZTRAIN_CHECK(input.scalar_type() == output.scalar_type(), "reduce_scatter: input is ", input.scalar_type(),
               " but output is ", output.scalar_type());
  ZTRAIN_CHECK(input.numel() == output.numel() * size_, "reduce_scatter: input must hold size() * "
               "output.numel() = ", size_, " * ", output.numel(), " = ", size_ * output.numel(),
               " elements, got ", input.numel());
  ZTRAIN_CHECK(!overlaps(input, output), "reduce_scatter: input and output must not overlap");
  MPI_Op mop = mpi_op(input.scalar_type(), op, kCall);
  begin({kReduceScatter, static_cast<int32_t>(input.scalar_type()), output.numel(), static_cast<int64_t>(op)});
  stats_.reduce_scatter_bytes += input.nbytes();
  if (output.numel() == 0) return;
  if (size_ == 1) {
    output.copy_(input.view_as(output));
  } else if (use_ring(input.nbytes())) {
    if (!host_shared_reduce_scatter(input, output, op, kCall)) {
      ring_reduce_scatter(input.view(-1), even_bounds(input.numel(), size_), output.view(-1), op, kCall);
    }
  } else {
    MPI_Request req;
    check_mpi(MPI_Ireduce_scatter_block(input.data_ptr(), output.data_ptr(), count(output),
                                        mpi_type(input.scalar_type()), mop, comm_, &req), kCall, -1);
    wait(req, kCall, -1);
  }
  if (op == ReduceOp::kAvg && size_ > 1) output.div_(size_);
}

void MpiCommunicator::broadcast(const torch::Tensor& tensor, int root) {
  constexpr const char* kCall = "broadcast";
  check_tensor(tensor, kCall, "tensor");
  ZTRAIN_CHECK(root >= 0 && root < size_, "broadcast: root ", root, " is not a rank of communicator '",
               name(), "' (size ", size_, ")");
  begin({kBroadcast, static_cast<int32_t>(tensor.scalar_type()), tensor.numel(), root});
  if (rank_ == root) stats_.broadcast_bytes += tensor.nbytes();
  if (size_ == 1 || tensor.numel() == 0) return;
  MPI_Request req;
  check_mpi(MPI_Ibcast(tensor.data_ptr(), count(tensor), mpi_type(tensor.scalar_type()), root, comm_, &req),
            kCall, root);
  wait(req, kCall, root);
}

void MpiCommunicator::check_point_to_point(const torch::Tensor& tensor, const char* call, const char* role,
                                           int peer, int tag) {
  check_tensor(tensor, call, "tensor");
  ZTRAIN_CHECK(peer >= 0 && peer < size_ && peer != rank_, call, ": ", role, " ", peer,
               " must be another rank of communicator '", name(), "' (size ", size_, ", this rank ", rank_, ")");
  ZTRAIN_CHECK(tag >= 0 && tag <= kMaxUserTag, call, ": tag must be in [0, ", kMaxUserTag, "], got ", tag);
  ensure_usable();
}

void MpiCommunicator::send(const torch::Tensor& tensor, int dst, int tag) {
  constexpr const char* kCall = "send";
  check_point_to_point(tensor, kCall, "destination", dst, tag);
  stats_.send_bytes += tensor.nbytes();
  MPI_Request req;
  check_mpi(MPI_Isend(tensor.data_ptr(), count(tensor), mpi_type(tensor.scalar_type()), dst, tag, comm_, &req),
            kCall, dst);
  wait(req, kCall, dst);
}

void MpiCommunicator::recv(const torch::Tensor& tensor, int src, int tag) {
  constexpr const char* kCall = "recv";
  check_point_to_point(tensor, kCall, "source", src, tag);
  MPI_Request req;
  check_mpi(MPI_Irecv(tensor.data_ptr(), count(tensor), mpi_type(tensor.scalar_type()), src, tag, comm_, &req),
            kCall, src);
  MPI_Status status;
  wait(req, kCall, src, &status);
  int received = 0;
  MPI_Get_count(&status, mpi_type(tensor.scalar_type()), &received);
  ZTRAIN_CHECK(received == count(tensor), "recv: expected ", tensor.numel(), " elements of ", tensor.scalar_type(),
               " from rank ", src, " (tag ", tag, ") but the message held ", received,
               "; sender and receiver must agree on the shape");
}

void MpiCommunicator::barrier() {
  begin({kBarrier});
  if (size_ == 1) return;
  MPI_Request req;
  check_mpi(MPI_Ibarrier(comm_, &req), "barrier", -1);
  wait(req, "barrier", -1);
}

std::vector<std::string> MpiCommunicator::all_gather_bytes(std::string_view bytes) {
  constexpr const char* kCall = "all_gather_bytes";
  ZTRAIN_CHECK(bytes.size() <= INT_MAX, kCall, ": at most ", INT_MAX, " bytes, got ", bytes.size());
  begin({kGatherBytes});
  int64_t mine = static_cast<int64_t>(bytes.size());
  std::vector<int64_t> sizes(size_);
  MPI_Request req;
  check_mpi(MPI_Iallgather(&mine, 1, MPI_INT64_T, sizes.data(), 1, MPI_INT64_T, comm_, &req), kCall, -1);
  wait(req, kCall, -1);
  std::vector<int> counts(size_), displs(size_);
  int64_t total = 0;
  for (int r = 0; r < size_; ++r) {
    counts[r] = static_cast<int>(sizes[r]);
    displs[r] = static_cast<int>(total);
    total += sizes[r];
  }
  ZTRAIN_CHECK(total <= INT_MAX, kCall, ": ", total, " bytes in all exceed the limit of ", INT_MAX);
  std::string flat(total, '\0');
  check_mpi(MPI_Iallgatherv(bytes.data(), static_cast<int>(mine), MPI_BYTE, flat.data(), counts.data(),
                            displs.data(), MPI_BYTE, comm_, &req), kCall, -1);
  wait(req, kCall, -1);
  std::vector<std::string> out(size_);
  for (int r = 0; r < size_; ++r) out[r] = flat.substr(displs[r], counts[r]);
  return out;
}

std::string MpiCommunicator::broadcast_bytes(std::string_view bytes, int root) {
  constexpr const char* kCall = "broadcast_bytes";
  ZTRAIN_CHECK(root >= 0 && root < size_, kCall, ": root ", root, " is not a rank of communicator '",
               name(), "' (size ", size_, ")");
  ZTRAIN_CHECK(bytes.size() <= INT_MAX, kCall, ": at most ", INT_MAX, " bytes, got ", bytes.size());
  begin({kBroadcastBytes, -1, 0, root});
  int64_t n = static_cast<int64_t>(bytes.size());
  MPI_Request req;
  check_mpi(MPI_Ibcast(&n, 1, MPI_INT64_T, root, comm_, &req), kCall, root);
  wait(req, kCall, root);
  std::string out = rank_ == root ? std::string(bytes) : std::string(n, '\0');
  if (n > 0) {
    check_mpi(MPI_Ibcast(out.data(), static_cast<int>(n), MPI_BYTE, root, comm_, &req), kCall, root);
    wait(req, kCall, root);
  }
  return out;
}

std::unique_ptr<Communicator> MpiCommunicator::dup(const std::string& name) {
  begin({kDup});
  auto opts = options_;
  opts.name = name;
  return std::make_unique<MpiCommunicator>(comm_, opts);
}

std::unique_ptr<Communicator> MpiCommunicator::split(int color, int key, const std::string& name) {
  ZTRAIN_CHECK(color >= 0, "split: color must be non-negative, got ", color);
  begin({kSplit});
  MPI_Comm part = MPI_COMM_NULL;
  check_mpi(MPI_Comm_split(comm_, color, key, &part), "split", -1);
  auto opts = options_;
  opts.name = name;
  auto out = std::make_unique<MpiCommunicator>(part, opts);
  MPI_Comm_free(&part);
  return out;
}

}  // namespace ztrain
