#pragma once
/// The communicator: collectives and point-to-point transfers over a group of ranks.
///
/// Every call that names a group operation (all_reduce, all_gather, reduce_scatter, broadcast,
/// barrier, dup, split and the *_bytes / *_object helpers) is collective: every member of the
/// group must make the same call, in the same order, with matching sizes and dtypes. Tensors must
/// be contiguous, on the CPU or a CUDA device; one on another device than the transport's (a
/// CUDA tensor on the MPI backend, a CPU one on NCCL) is staged through a buffer on the
/// transport's device, one copy each way (CommStats::staged_bytes). Nothing else is ever copied
/// silently, and a wrong size or dtype raises ztrain::Error before any rank blocks. Every wait has a finite deadline
/// (`timeout()`), creating a communicator (dup, split) included; when it passes, or the
/// transport fails, the call raises ztrain::CommError and the communicator refuses further calls
/// (its state is unknown after a partial collective).
///
/// A communicator holds the algorithms and a transport (comm/transport.h) that moves the bytes:
/// small collectives use the backend's own where it has them; from `ring_threshold_bytes` on,
/// all_gather, reduce_scatter and all_reduce (= reduce_scatter + all_gather) run as
/// bandwidth-optimal rings of point-to-point transfers, and where every member runs on this
/// host with a host-shared buffer (comm/host_shared.h) they read and write the members' buffers
/// in place instead. A transport without collectives gets all of them from point-to-point
/// transfers. Communicators are made by a backend's factory (comm/backend.h) and by dup/split.
///
/// A communicator is not thread-safe: use one per thread. CommStream owns a duplicate for its
/// worker, so a stream's operations and the caller's never share a transport.
///
///   auto& dp = ctx.dp();                                   // a ParallelContext's group
///   dp.all_reduce(grad, ztrain::ReduceOp::kAvg);           // every dp rank calls this
///   auto full = dp.all_gather(shard);                      // size() * shard.numel() elements

#include <ztrain/comm/reduce_op.h>
#include <ztrain/comm/transport.h>
#include <ztrain/error.h>

#include <torch/types.h>

#include <chrono>
#include <cstdint>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

namespace ztrain {

namespace detail {
class HostRendezvous;
}

struct CommunicatorOptions {
  /// The group's name in messages ("world", "tp", "dp", "pp", ...).
  std::string name = "world";
  /// Deadline of any single wait inside a call.
  std::chrono::milliseconds timeout = std::chrono::seconds(300);
  /// Check before every collective that all members agree on it (op, dtype, sizes, root).
  bool debug = false;
  /// Messages of at least this many bytes (the full buffer: all_reduce's tensor, all_gather's
  /// output, reduce_scatter's input) use the ring algorithms or the host-shared path.
  int64_t ring_threshold_bytes = 256 * 1024;
  /// From the same size on, when every member runs on this host and its buffer is host-shared,
  /// all_gather, reduce_scatter and all_reduce read the members' buffers directly.
  bool host_shared = true;
  /// From the same size on, when the members run on two or more hosts with the same number
  /// (two or more) on each, all_gather, reduce_scatter and all_reduce run in two levels: among
  /// the members of each host (the host-shared path), and across hosts among the members with
  /// the same index on their host, so each host's link carries what one rank per host would send
  /// ((H-1)/H of the buffer per direction for H hosts, against (P-1)/P for a flat ring of P).
  bool hierarchical = true;
};

/// Bytes this rank handed to the transport, by operation, since creation (or reset). Counts
/// the payload a rank contributes: all_reduce and broadcast count the tensor, all_gather the
/// input, reduce_scatter the input, send the tensor.
struct CommStats {
  int64_t all_reduce_bytes = 0;
  int64_t all_gather_bytes = 0;
  int64_t reduce_scatter_bytes = 0;
  int64_t broadcast_bytes = 0;
  int64_t send_bytes = 0;
  int64_t calls = 0;
  /// Collectives that read the members' host-shared buffers directly (comm/host_shared.h).
  int64_t host_shared_calls = 0;
  /// Meetings of the members in host-shared memory, which take no transport call: three for
  /// each host-shared collective (two exchanges and a barrier), one for each barrier() of
  /// members that share a host.
  int64_t host_meetings = 0;
  /// Collectives run in two levels, within and across hosts (CommunicatorOptions::hierarchical).
  int64_t hierarchical_calls = 0;
  /// Bytes of tensors staged through the transport's device (copied there, back, or both).
  int64_t staged_bytes = 0;
  int64_t total_bytes() const {
    return all_reduce_bytes + all_gather_bytes + reduce_scatter_bytes + broadcast_bytes +
           send_bytes;
  }
};

class Communicator {
 public:
  /// Takes over `transport`, one member's end of a new group. Collective over the group: the
  /// members find out, within the deadline, whether they share one host.
  Communicator(std::unique_ptr<Transport> transport, CommunicatorOptions options);
  ~Communicator();
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  /// This rank's index in the group, and the group size.
  int rank() const { return rank_; }
  int size() const { return size_; }
  const std::string& name() const { return options_.name; }
  /// The world rank of a group member, for messages and topology queries.
  int world_rank_of(int group_rank) const;
  /// The device whose tensors the transport moves without staging.
  c10::Device device() const { return transport_->device(); }
  /// Whether every member runs on this host.
  bool host_local() const { return host_local_; }
  /// How many hosts the members run on.
  int hosts() const { return hosts_; }

  std::chrono::milliseconds timeout() const { return options_.timeout; }
  void set_timeout(std::chrono::milliseconds timeout);
  bool debug() const { return options_.debug; }
  void set_debug(bool on);
  const CommunicatorOptions& options() const { return options_; }

  /// In place: `tensor` becomes the reduction over the group.
  void all_reduce(const torch::Tensor& tensor, ReduceOp op = ReduceOp::kSum);
  /// `output` (size() * input.numel() elements) receives every rank's `input`, in rank order.
  /// `input` may be this rank's slice of `output` (in-place gather).
  void all_gather(const torch::Tensor& input, const torch::Tensor& output);
  /// `input` (size() * output.numel() elements) is reduced; rank r receives slice r.
  void reduce_scatter(const torch::Tensor& input, const torch::Tensor& output, ReduceOp op = ReduceOp::kSum);
  /// In place: every rank's `tensor` becomes root's.
  void broadcast(const torch::Tensor& tensor, int root);
  /// Point-to-point. Shapes and dtypes must match on both ends (the receiver supplies the
  /// buffer); `tag` in [0, kMaxUserTag] pairs a send with its receive.
  void send(const torch::Tensor& tensor, int dst, int tag = 0);
  void recv(const torch::Tensor& tensor, int src, int tag = 0);
  void barrier();

  /// Variable-length byte strings: every rank's bytes, in rank order.
  std::vector<std::string> all_gather_bytes(std::string_view bytes);
  /// Root's bytes on every rank (the argument is ignored elsewhere).
  std::string broadcast_bytes(std::string_view bytes, int root);

  /// A new communicator over the same ranks, with its own message space (collective).
  std::unique_ptr<Communicator> dup(const std::string& name);
  /// Ranks passing the same `color` (>= 0) form a group, ordered by `key` (collective).
  std::unique_ptr<Communicator> split(int color, int key, const std::string& name);

  CommStats stats() const { return stats_; }
  void reset_stats() { stats_ = {}; }

  /// The transport underneath (for backend-specific code).
  Transport& transport() { return *transport_; }

  // ---- conveniences built on the primitives ----------------------------------------------

  /// Allocating all_gather: returns a flat tensor of size() * input.numel() elements.
  torch::Tensor all_gather(const torch::Tensor& input);
  /// Allocating reduce_scatter: returns this rank's input.numel() / size() elements.
  torch::Tensor reduce_scatter(const torch::Tensor& input, ReduceOp op = ReduceOp::kSum);
  double all_reduce_scalar(double value, ReduceOp op = ReduceOp::kSum);
  int64_t all_reduce_scalar(int64_t value, ReduceOp op = ReduceOp::kSum);

  /// Every rank's value of a trivially copyable object, in rank order.
  template <class T>
  std::vector<T> all_gather_object(const T& value) {
    static_assert(std::is_trivially_copyable_v<T>, "all_gather_object needs a trivially copyable type");
    auto parts = all_gather_bytes(std::string_view(reinterpret_cast<const char*>(&value), sizeof(T)));
    std::vector<T> out(parts.size());
    for (size_t i = 0; i < parts.size(); ++i) {
      ZTRAIN_CHECK(parts[i].size() == sizeof(T), "all_gather_object: rank ", i, " sent ",
                   parts[i].size(), " bytes, expected ", sizeof(T));
      std::memcpy(&out[i], parts[i].data(), sizeof(T));
    }
    return out;
  }
  /// Root's object on every rank.
  template <class T>
  T broadcast_object(const T& value, int root) {
    static_assert(std::is_trivially_copyable_v<T>, "broadcast_object needs a trivially copyable type");
    auto bytes = broadcast_bytes(std::string_view(reinterpret_cast<const char*>(&value), sizeof(T)), root);
    ZTRAIN_CHECK(bytes.size() == sizeof(T), "broadcast_object: root sent ", bytes.size(),
                 " bytes, expected ", sizeof(T));
    T out;
    std::memcpy(&out, bytes.data(), sizeof(T));
    return out;
  }

 private:
  struct Call;  // what a collective is about to do; exchanged in debug mode
  void ensure_usable();
  void begin(const Call& call);
  void check_tensor(const torch::Tensor& t, const char* call, const char* what) const;
  // `t` itself when it is on the transport's device or the communicator has one rank (nothing
  // crosses a process then), else a buffer on the transport's device, holding t's values
  // when `read`; unstage copies a buffer's values back into the tensor it stands for.
  torch::Tensor stage(const torch::Tensor& t, bool read);
  static void unstage(const torch::Tensor& t, const torch::Tensor& staged);
  void check_point_to_point(const torch::Tensor& tensor, const char* call, const char* role, int peer, int tag);
  bool large(int64_t bytes) const {
    return size_ > 1 && bytes >= options_.ring_threshold_bytes && !transport_->collectives_at_every_size();
  }

  // Waiting with the deadline; a failure makes the communicator unusable (src/comm/communicator.cpp).
  void wait(TransportRequestPtr request, const char* op, int peer);
  void wait_all(std::vector<TransportRequestPtr>& requests, const char* op, int peer);
  void wait_for(std::vector<TransportRequest*> requests, const char* op, int peer);  // null entries: done
  // Runs `start` (a transport call), turning a TransportFailure into this communicator's failure.
  template <class F>
  auto guarded(const char* op, int peer, F&& start) {
    try {
      return start();
    } catch (const TransportFailure& e) {
      fail(c10::str("ztrain: ", op, " on communicator '", name(), "' failed on world rank ", world_rank_,
                    peer >= 0 ? c10::str(" (peer rank ", peer, ")") : std::string(), ": ", e.what()),
           op, peer);
    }
  }
  [[noreturn]] void fail(const std::string& what, const char* op, int peer);
  // The failure of a wait that ran out of time: `peer` (or else "a member") did not take part.
  [[noreturn]] void timed_out(const char* op, int peer);
  std::unique_ptr<Communicator> adopt(std::unique_ptr<PendingTransport> pending, const char* op,
                                      const std::string& name);
  // Where the members run, from their host identities (in group order).
  void place_members(const std::vector<std::string>& identities);

  // Small exchanges of the communicator's own (debug descriptions, host names, buffer names,
  // agreements): the transport's collective, else a ring; never the host-shared path.
  void control_all_gather(const torch::Tensor& input, const torch::Tensor& output, const char* call);
  void control_all_reduce(const torch::Tensor& flat, ReduceOp op, const char* call);
  // The algorithms, without validation, statistics or the debug check. The reductions return
  // whether they divided kAvg's sum by the members themselves (the host-shared path); where not,
  // the caller divides.
  bool run_all_reduce(const torch::Tensor& flat, ReduceOp op, const char* call);
  void run_all_gather(const torch::Tensor& input, const torch::Tensor& output, bool in_place, const char* call);
  bool run_reduce_scatter(const torch::Tensor& input, const torch::Tensor& output, ReduceOp op, const char* call);
  void run_broadcast(const torch::Tensor& tensor, int root, const char* call);
  void run_barrier(const char* call);

  // Rings and trees of point-to-point transfers (src/comm/ring.cpp).
  void ring_exchange(const torch::Tensor& out, const torch::Tensor& in, const char* op,
                     const std::function<void()>& overlap = {});
  void ring_reduce_scatter(const torch::Tensor& input, const std::vector<int64_t>& bounds,
                           const torch::Tensor& output, ReduceOp op, const char* call);
  void ring_all_gather(const torch::Tensor& output, const std::vector<int64_t>& bounds,
                       const torch::Tensor& own_input, const char* call);
  void tree_broadcast(const torch::Tensor& tensor, int root, const char* call);
  void dissemination_barrier(const char* call);
  // A reusable buffer of at least `numel` elements (received chunks and ring partial sums).
  torch::Tensor scratch_for(c10::ScalarType dtype, int64_t numel);

  // The same-host paths over host-shared buffers (src/comm/host_shared_collectives.cpp). Each
  // returns false, having moved nothing, on every member alike where they cannot be taken. Their
  // kAvg results come out divided by the members.
  struct Members {
    int buffer = -1;
    std::vector<char*> at;
  };
  Members map_members(const std::vector<torch::Tensor>& buffers, const char* call);
  // Their synchronisation, and barrier()'s: at the members' meeting point in host-shared memory
  // (src/comm/host_rendezvous.h), else the control collectives and the transport's barrier.
  // rendezvous() makes the meeting point at its first call (collective) where the members share
  // a host and host-shared memory is on; null where it cannot be made. exchange_on_host gathers
  // `bytes` from each member (member m's at all + m * bytes).
  detail::HostRendezvous* rendezvous(const char* call);
  void exchange_on_host(const void* mine, void* all, size_t bytes, const char* call);
  void barrier_on_host(const char* call);
  void meet_on_host(const void* mine, size_t bytes, const char* call);
  void reduce_members(const torch::Tensor& dst, const std::vector<char*>& members, int64_t offset, ReduceOp op,
                      bool to_all);
  bool host_shared_all_gather(const torch::Tensor& input, const torch::Tensor& output, bool in_place,
                              const char* call);
  bool host_shared_reduce_scatter(const torch::Tensor& input, const torch::Tensor& output, ReduceOp op,
                                  const char* call);
  bool host_shared_all_reduce(const torch::Tensor& flat, ReduceOp op, const char* call);

  // The two-level paths across hosts (src/comm/hierarchical.cpp): each returns false, having
  // moved nothing, on every member alike where the layout does not allow them.
  struct Levels {
    std::unique_ptr<Communicator> host;    // the members on this rank's host
    std::unique_ptr<Communicator> across;  // the members with this rank's index on their host
  };
  bool hierarchical(int64_t bytes) const;
  Levels& levels(const char* call);
  torch::Tensor level_scratch(c10::ScalarType dtype, int64_t numel);
  template <class F>
  void run_levels(const char* call, F&& body);
  bool hierarchical_all_reduce(const torch::Tensor& flat, ReduceOp op, const char* call);
  bool hierarchical_all_gather(const torch::Tensor& input, const torch::Tensor& output, const char* call);
  bool hierarchical_reduce_scatter(const torch::Tensor& input, const torch::Tensor& output, ReduceOp op,
                                   const char* call);

  std::unique_ptr<Transport> transport_;
  CommunicatorOptions options_;
  int rank_ = 0;
  int size_ = 1;
  int world_rank_ = 0;
  bool host_local_ = false;  // every member runs on this host
  int hosts_ = 1;            // hosts the members run on
  // Group rank of member l of host h at h * per_host_ + l, where every host runs per_host_
  // members (0 when the hosts differ in count).
  std::vector<int> by_host_;
  int per_host_ = 0;
  std::unique_ptr<detail::HostRendezvous> rendezvous_;
  bool rendezvous_tried_ = false;
  Levels levels_;  // made at the first two-level collective
  std::map<c10::ScalarType, torch::Tensor> level_scratch_;
  int64_t sequence_ = 0;     // collectives issued, for debug messages
  std::string failure_;      // non-empty once a call failed: the communicator is unusable
  CommStats stats_;
  std::map<c10::ScalarType, torch::Tensor> scratch_;
};

/// Where the members of a communicator run: how many share this rank's host (and its memory),
/// and this rank's index among them.
struct HostLayout {
  int local_size = 1;
  int local_rank = 0;
};
/// Collective over `comm`. With `alike`, only the members on this host that pass the same
/// `alike` count (such as those given the same CPUs).
HostLayout host_layout(Communicator& comm, std::string_view alike = {});

}  // namespace ztrain
