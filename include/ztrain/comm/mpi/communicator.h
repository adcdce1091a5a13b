#pragma once
/// The MPI backend of ztrain::Communicator.
///
/// Every operation is non-blocking MPI completed by a polling wait with a deadline, so a dead or
/// stuck peer surfaces as ztrain::CommError instead of a hang. Small collectives use MPI's own
/// (MPI_Iallreduce, MPI_Iallgather, MPI_Ireduce_scatter_block, MPI_Ibcast, MPI_Ibarrier), with
/// custom MPI operations for bf16 and f16 that form each pairwise result in fp32 and round to
/// nearest even. From `ring_threshold_bytes` on, all_gather, reduce_scatter and all_reduce run
/// as bandwidth-optimal rings of MPI_Isend/MPI_Irecv between neighbours, reducing with
/// libtorch's kernels (same rounding); on one host each hop is a single copy (CMA). Where every
/// member's buffer is host-shared, they skip the transport altogether (see host_shared.h).
///
/// Point-to-point tags must lie in [0, kMaxUserTag]; the tag above is reserved for the rings.
/// Ring reduce-scatter passes segments in 256 KiB chunks, each summed as soon as it arrives, and
/// keeps a scratch buffer between calls: one chunk, plus two segments of partial sums (2/n of
/// the input) on rings longer than two.
///
/// The communicator duplicates the MPI_Comm it is given and frees its duplicate on destruction.
/// MPI must have been initialised with MPI_THREAD_MULTIPLE when several communicators are used
/// from different threads (init_distributed does this).

#include <ztrain/comm/communicator.h>

#include <mpi.h>

#include <atomic>
#include <functional>
#include <map>

namespace ztrain {

struct MpiCommunicatorOptions {
  std::string name = "world";
  std::chrono::milliseconds timeout = std::chrono::seconds(300);
  bool debug = false;
  /// Messages of at least this many bytes (the full buffer: all_reduce's tensor, all_gather's
  /// output, reduce_scatter's input) use the ring algorithms.
  int64_t ring_threshold_bytes = 256 * 1024;
  /// From the same size on, when every member runs on this host and its buffer is host-shared
  /// (comm/host_shared.h), all_gather, reduce_scatter and all_reduce read the members' buffers
  /// directly instead of passing them around the ring.
  bool host_shared = true;
};

/// Largest tag send() and recv() accept.
constexpr int kMaxUserTag = 32766;

class MpiCommunicator final : public Communicator {
 public:
  /// Duplicates `comm` (collective over its members).
  MpiCommunicator(MPI_Comm comm, MpiCommunicatorOptions options);
  ~MpiCommunicator() override;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  const std::string& name() const override { return options_.name; }
  int world_rank_of(int group_rank) const override;
  std::chrono::milliseconds timeout() const override { return options_.timeout; }
  void set_timeout(std::chrono::milliseconds timeout) override;
  bool debug() const override { return options_.debug; }
  void set_debug(bool on) override { options_.debug = on; }

  void all_reduce(const torch::Tensor& tensor, ReduceOp op) override;
  void all_gather(const torch::Tensor& input, const torch::Tensor& output) override;
  void reduce_scatter(const torch::Tensor& input, const torch::Tensor& output, ReduceOp op) override;
  void broadcast(const torch::Tensor& tensor, int root) override;
  void send(const torch::Tensor& tensor, int dst, int tag) override;
  void recv(const torch::Tensor& tensor, int src, int tag) override;
  void barrier() override;
  std::vector<std::string> all_gather_bytes(std::string_view bytes) override;
  std::string broadcast_bytes(std::string_view bytes, int root) override;
  std::unique_ptr<Communicator> dup(const std::string& name) override;
  std::unique_ptr<Communicator> split(int color, int key, const std::string& name) override;
  CommStats stats() const override { return stats_; }
  void reset_stats() override { stats_ = {}; }

  using Communicator::all_gather;
  using Communicator::reduce_scatter;

  /// The duplicated MPI communicator (for code that must call MPI directly).
  MPI_Comm handle() const { return comm_; }

 private:
  struct Call;  // what a collective is about to do; exchanged in debug mode
  void ensure_usable();
  void check_point_to_point(const torch::Tensor& tensor, const char* call, const char* role, int peer, int tag);
  void begin(const Call& call);
  void wait(MPI_Request& request, const char* op, int peer, MPI_Status* status = MPI_STATUS_IGNORE);
  void wait_all(MPI_Request* requests, int count, const char* op, int peer,
                MPI_Status* statuses = MPI_STATUSES_IGNORE);
  bool use_ring(int64_t bytes) const { return size_ > 1 && bytes >= options_.ring_threshold_bytes; }
  // Sends `out` to the next rank while receiving `in` from the previous one; `overlap` runs
  // while the transfer is in flight.
  void ring_exchange(const torch::Tensor& out, const torch::Tensor& in, const char* op,
                     const std::function<void()>& overlap = {});
  void ring_reduce_scatter(const torch::Tensor& input, const std::vector<int64_t>& bounds,
                           const torch::Tensor& output, ReduceOp op, const char* call);
  // A reusable buffer of at least `numel` elements (received chunks and ring partial sums).
  torch::Tensor scratch_for(c10::ScalarType dtype, int64_t numel);
  void ring_all_gather(const torch::Tensor& output, const std::vector<int64_t>& bounds,
                       const torch::Tensor& own_input, const char* call);
  // Every member's address of one of `buffers` (this rank's own at its index): the first that
  // every member has host-shared, with its index in `buffers`. Empty, with index -1, on every
  // member when no buffer is host-shared everywhere or a peer's cannot be mapped here.
  struct Members {
    int buffer = -1;
    std::vector<char*> at;
  };
  Members map_members(const std::vector<torch::Tensor>& buffers, const char* call);
  // dst = the reduction over members m = rank, rank+1, ... of members[m]'s elements
  // [offset, offset + dst.numel()). With `to_all`, dst is this rank's own range and the result
  // is stored to that range of every member's buffer as well.
  void reduce_members(const torch::Tensor& dst, const std::vector<char*>& members, int64_t offset, ReduceOp op,
                      bool to_all);
  void shared_barrier(const char* call);
  // Each returns false, having moved nothing, where map_members finds no shared buffers.
  bool host_shared_all_gather(const torch::Tensor& input, const torch::Tensor& output, bool in_place,
                              const char* call);
  bool host_shared_reduce_scatter(const torch::Tensor& input, const torch::Tensor& output, ReduceOp op,
                                  const char* call);
  bool host_shared_all_reduce(const torch::Tensor& flat, ReduceOp op, const char* call);
  void check_mpi(int code, const char* op, int peer);
  [[noreturn]] void fail(const std::string& what, const char* op, int peer);

  MPI_Comm comm_ = MPI_COMM_NULL;
  MpiCommunicatorOptions options_;
  int rank_ = 0;
  int size_ = 1;
  int world_rank_ = 0;
  bool host_local_ = false;   // every member runs on this host
  std::vector<int> world_ranks_;
  int64_t sequence_ = 0;      // collectives issued, for debug messages
  std::string failure_;       // non-empty once a call failed: the communicator is unusable
  CommStats stats_;
  std::map<c10::ScalarType, torch::Tensor> scratch_;
};

namespace detail {
/// True once any MPI communicator failed (timeout or MPI error). The runtime then skips
/// MPI_Finalize at exit, which would block on the dead peer.
bool mpi_failure_seen();
}  // namespace detail

}  // namespace ztrain
