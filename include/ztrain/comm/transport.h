#pragma once
/// The transport interface: what a communication backend gives the communicator.
///
/// A transport moves tensors between the members of one group. It must provide non-blocking
/// point-to-point transfers and the creation of new groups (dup, split); it may provide the
/// backend's own non-blocking collectives, which the communicator then uses for small messages.
/// Everything else lives above it in ztrain::Communicator and works over any transport: input
/// validation, deadlines, the debug agreement check, the ring algorithms, the same-host
/// host-shared paths, barriers and broadcasts built from point-to-point messages, the byte and
/// object helpers, statistics. MPI is one transport (comm/mpi/transport.h); backends are made by
/// name (comm/backend.h).
///
/// No call blocks: each starts an operation and returns a request that the communicator polls
/// with `test()` against its deadline. A transport is used by one thread at a time, like its
/// communicator. Tensors passed in are contiguous, of a supported dtype and on `device()`, and
/// stay alive until their request completes (the communicator checks and guarantees this).
///
///   class MyTransport final : public ztrain::Transport { ... };   // send, recv, dup, split
///   ztrain::Communicator comm(std::make_unique<MyTransport>(...), {.name = "world"});

#include <ztrain/comm/reduce_op.h>

#include <torch/types.h>

#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

namespace ztrain {

/// Largest tag Communicator::send and recv accept. Transports accept one more, which the
/// communicator's own algorithms use.
constexpr int kMaxUserTag = 32766;

/// The transport itself failed (a backend error code, a lost connection). The communicator turns
/// it into a ztrain::CommError naming the communicator, the rank, the operation and the peer.
class TransportFailure : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// One operation in flight.
class TransportRequest {
 public:
  virtual ~TransportRequest() = default;
  /// True once the operation completed; never blocks. Throws TransportFailure when it failed,
  /// and ztrain::Error when what arrived contradicts what the caller declared (a receive whose
  /// message has another size). A request abandoned before completion (its communicator timed
  /// out) is destroyed without completing: the destructor must not block.
  virtual bool test() = 0;
};
using TransportRequestPtr = std::unique_ptr<TransportRequest>;

class Transport;

/// A new transport being created (dup, split).
class PendingTransport : public TransportRequest {
 public:
  /// The transport, once test() returned true; this rank's transport may be null after a split
  /// that left it out (never, with the colors the communicator allows).
  virtual std::unique_ptr<Transport> take() = 0;
};

class Transport {
 public:
  virtual ~Transport() = default;

  virtual int rank() const = 0;
  virtual int size() const = 0;
  /// The world rank of every member, in group order (for messages).
  virtual const std::vector<int>& world_ranks() const = 0;
  /// The device whose tensors the transport moves.
  virtual c10::Device device() const = 0;
  /// The backend's name in messages ("mpi").
  virtual const char* backend() const = 0;

  /// Point-to-point. Tags lie in [0, kMaxUserTag + 1] (communicator.h); messages of one (peer,
  /// tag) arrive in the order they were sent. A receive checks on completion that the message
  /// holds exactly `tensor`'s elements.
  virtual TransportRequestPtr send(const torch::Tensor& tensor, int dst, int tag) = 0;
  virtual TransportRequestPtr recv(const torch::Tensor& tensor, int src, int tag) = 0;

  /// The backend's own collectives, or nullptr where it has none (the communicator then runs its
  /// own algorithm). all_reduce is in place with kSum, kMax or kMin (the communicator divides
  /// for kAvg); all_gather writes every member's `input` into `output` in rank order, `input`
  /// possibly being this rank's slice of `output`; reduce_scatter reduces `input` and keeps
  /// slice rank(); broadcast is in place. 16-bit floats reduce in fp32, rounded to nearest even.
  virtual TransportRequestPtr all_reduce(const torch::Tensor&, ReduceOp) { return nullptr; }
  virtual TransportRequestPtr all_gather(const torch::Tensor& /*input*/, const torch::Tensor& /*output*/) {
    return nullptr;
  }
  virtual TransportRequestPtr reduce_scatter(const torch::Tensor& /*input*/, const torch::Tensor& /*output*/,
                                             ReduceOp) {
    return nullptr;
  }
  virtual TransportRequestPtr broadcast(const torch::Tensor&, int /*root*/) { return nullptr; }
  virtual TransportRequestPtr barrier() { return nullptr; }
  /// Whether the communicator should take the collectives above for messages of every size,
  /// never its own rings or host-shared paths (a backend whose collectives run on the device,
  /// as NCCL's do).
  virtual bool collectives_at_every_size() const { return false; }

  /// A transport over the same members with its own message space (collective).
  virtual std::unique_ptr<PendingTransport> dup() = 0;
  /// Members passing the same color form a new transport, ordered by key (collective; every
  /// member has already agreed on the call and checked the colors).
  virtual std::unique_ptr<PendingTransport> split(int color, int key) = 0;

  /// Told when the communicator gave up on an operation (a timeout or a failure): what was in
  /// flight is abandoned, and the backend may have to avoid calls that would wait on a peer.
  virtual void on_failure() {}
};

}  // namespace ztrain
