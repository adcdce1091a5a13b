#pragma once
/// The MPI transport: CPU tensors between the processes of an MPI communicator.
///
/// Every operation is non-blocking MPI (MPI_Isend/MPI_Irecv, and MPI's own MPI_Iallreduce,
/// MPI_Iallgather, MPI_Ireduce_scatter_block, MPI_Ibcast and MPI_Ibarrier for the communicator's
/// small collectives), with custom MPI operations for bf16 and f16 that form each pairwise
/// result in fp32 and round to nearest even. dup is MPI_Comm_idup; split runs MPI_Comm_split,
/// which MPI only offers blocking, on a helper thread, so the communicator's deadline covers it
/// too. The transport owns a duplicate of the MPI communicator it is made from and frees it on
/// destruction (not after a failure anywhere, when freeing could block on a dead peer).
///
/// MPI must run with MPI_THREAD_MULTIPLE when several transports are used from different threads
/// (comm/backend.h starts it so).
///
///   auto comm = ztrain::make_world_communicator("mpi", {.name = "world"});   // MPI_COMM_WORLD
///   auto mine = std::make_unique<ztrain::Communicator>(
///       ztrain::MpiTransport::adopt(my_mpi_comm), ztrain::CommunicatorOptions{.name = "mine"});

#include <ztrain/comm/transport.h>

#include <mpi.h>

namespace ztrain {

class PendingMpiTransport;

struct MpiTransportOptions {
  /// Offer MPI's own collectives to the communicator. Off, the communicator builds every
  /// collective from point-to-point transfers (how a transport without collectives runs).
  bool native_collectives = true;
};

class MpiTransport final : public Transport {
 public:
  /// Starts duplicating `comm` (collective over its members; non-blocking).
  static std::unique_ptr<PendingTransport> dup_of(MPI_Comm comm, MpiTransportOptions options = {});
  /// Duplicates `comm` now (collective, blocking: for programs that hand ztrain their own MPI
  /// communicator at a point where every member is known to be alive). Raises ztrain::CommError
  /// when MPI fails.
  static std::unique_ptr<MpiTransport> adopt(MPI_Comm comm, MpiTransportOptions options = {});
  ~MpiTransport() override;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  const std::vector<int>& world_ranks() const override { return world_ranks_; }
  c10::Device device() const override { return c10::Device(c10::DeviceType::CPU); }
  const char* backend() const override { return "mpi"; }

  TransportRequestPtr send(const torch::Tensor& tensor, int dst, int tag) override;
  TransportRequestPtr recv(const torch::Tensor& tensor, int src, int tag) override;
  TransportRequestPtr all_reduce(const torch::Tensor& tensor, ReduceOp op) override;
  TransportRequestPtr all_gather(const torch::Tensor& input, const torch::Tensor& output) override;
  TransportRequestPtr reduce_scatter(const torch::Tensor& input, const torch::Tensor& output, ReduceOp op) override;
  TransportRequestPtr broadcast(const torch::Tensor& tensor, int root) override;
  TransportRequestPtr barrier() override;
  std::unique_ptr<PendingTransport> dup() override;
  std::unique_ptr<PendingTransport> split(int color, int key) override;
  void on_failure() override;

  /// The duplicated MPI communicator (for code that must call MPI directly).
  MPI_Comm handle() const { return comm_; }

 private:
  friend class PendingMpiTransport;
  MpiTransport(MPI_Comm owned, MpiTransportOptions options);

  MPI_Comm comm_ = MPI_COMM_NULL;
  MpiTransportOptions options_;
  int rank_ = 0;
  int size_ = 1;
  std::vector<int> world_ranks_;
};

namespace detail {
/// True once any MPI transport gave up on an operation (a timeout or an MPI error). MPI_Finalize
/// and MPI_Comm_free are skipped from then on: they would block on the dead peer.
bool mpi_failure_seen();
}  // namespace detail

}  // namespace ztrain
