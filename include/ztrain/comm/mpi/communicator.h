#pragma once
/// The MPI backend of ztrain::Communicator.
///
/// Collectives run as non-blocking MPI operations (MPI_Iallreduce, MPI_Iallgather,
/// MPI_Ireduce_scatter_block, MPI_Ibcast, MPI_Isend/MPI_Irecv, MPI_Ibarrier) completed by a
/// polling wait with a deadline, so a dead or stuck peer surfaces as ztrain::CommError instead
/// of a hang. bf16 and f16 reductions use custom MPI operations that accumulate each pair in
/// fp32 and round to nearest even.
///
/// The communicator duplicates the MPI_Comm it is given and frees its duplicate on destruction.
/// MPI must have been initialised with MPI_THREAD_MULTIPLE when several communicators are used
/// from different threads (init_distributed does this).

#include <ztrain/comm/communicator.h>

#include <mpi.h>

#include <atomic>

namespace ztrain {

struct MpiCommunicatorOptions {
  std::string name = "world";
  std::chrono::milliseconds timeout = std::chrono::seconds(300);
  bool debug = false;
};

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
  void begin(const Call& call);
  void wait(MPI_Request& request, const char* op, int peer, MPI_Status* status = MPI_STATUS_IGNORE);
  void check_mpi(int code, const char* op, int peer);
  [[noreturn]] void fail(const std::string& what, const char* op, int peer);

  MPI_Comm comm_ = MPI_COMM_NULL;
  MpiCommunicatorOptions options_;
  int rank_ = 0;
  int size_ = 1;
  int world_rank_ = 0;
  std::vector<int> world_ranks_;
  int64_t sequence_ = 0;      // collectives issued, for debug messages
  std::string failure_;       // non-empty once a call failed: the communicator is unusable
  CommStats stats_;
};

namespace detail {
/// True once any MPI communicator failed (timeout or MPI error). The runtime then skips
/// MPI_Finalize at exit, which would block on the dead peer.
bool mpi_failure_seen();
}  // namespace detail

}  // namespace ztrain
