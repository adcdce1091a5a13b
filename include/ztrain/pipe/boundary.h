#pragma once
/// The stage boundary protocol: lists of tensors between neighbouring pipeline stages.
///
/// Activations travel forward (stage s to s+1, and from the last stage to the first for the
/// next model chunk of an interleaved schedule); gradients travel backward. Every message is a
/// list of any number of tensors. A small header travels first with, per tensor, whether it is
/// defined, its dtype, its shape and whether it requires grad, so shapes and dtypes may change
/// from one message to the next and nothing is lost at the boundary (DeepSpeed's pipeline lost
/// dtypes and requires_grad flags here). Only floating-point tensors can require grad: an
/// integer or bool tensor (a mask, positions) always arrives without, and the receiver's
/// backward message carries gradients only for the tensors that arrived requiring grad, in
/// their order.
///
/// Sends are non-blocking: they run on their own communication stream and return a Work; the
/// tensors are read until it completes, so do not modify them in place before `synchronize()`.
/// Receives return a PendingMessage; `wait()` blocks. Each direction has one communicator for
/// its sends and another for its receives on every rank (six duplicates of the pipeline
/// communicator in all, matched by rank parity), so each is used by one thread and messages of
/// one direction between two ranks arrive in the order they were sent, under fixed tags. Every
/// message carries an id (the executor uses micro-batch and virtual stage) which the receiver
/// checks, so a schedule mismatch is an error, never silently wrong data. With one stage, a
/// message to the next stage is a local hand-over to oneself (interleaved chunks on one rank).
///
/// Construction is collective over `pp`. Not thread-safe.
///
///   ztrain::pipe::Boundary boundary(ctx.pp());                      // a ParallelContext's pp group
///   // stage s: hidden requires grad, mask and positions never do
///   auto in = boundary.recv_forward(/*id=*/mb).wait().tensors;     // stages > 0
///   auto out = stage_forward(in);
///   boundary.send_forward(out, mb);                                  // stages < p-1
///   ...
///   auto grads = boundary.recv_backward(mb).wait().tensors;         // for outputs requiring grad
///   ztrain::pipe::backward_from(out, grads);
///   boundary.send_backward(ztrain::pipe::input_gradients(in), mb);
///   boundary.synchronize();

#include <ztrain/comm/comm_stream.h>
#include <ztrain/comm/communicator.h>
#include <ztrain/comm/work.h>

#include <torch/torch.h>

#include <cstdint>
#include <deque>
#include <memory>
#include <optional>
#include <vector>

namespace ztrain::pipe {

/// What the header says about one tensor.
struct TensorMeta {
  bool defined = true;
  c10::ScalarType dtype = torch::kFloat32;
  std::vector<int64_t> shape;
  bool requires_grad = false;
  bool operator==(const TensorMeta&) const = default;
};

/// The header entry a tensor gets; requires_grad only for floating-point tensors.
TensorMeta meta_of(const torch::Tensor& t);

/// Whether `t` crosses a boundary requiring grad (defined, floating-point, requires grad).
bool boundary_requires_grad(const torch::Tensor& t);

/// A received message.
struct Message {
  int64_t id = 0;
  std::vector<torch::Tensor> tensors;
};

/// A receive in flight.
class PendingMessage {
 public:
  PendingMessage() = default;
  bool defined() const { return state_ != nullptr; }
  /// Blocks until the message is here and returns it (once). Received floating-point tensors
  /// that were sent requiring grad are leaves requiring grad. Raises ztrain::Error when the id
  /// is not the expected one, ztrain::CommError on a transport failure or timeout.
  Message wait();

 private:
  friend class Boundary;
  struct State;
  explicit PendingMessage(std::shared_ptr<State> state) : state_(std::move(state)) {}
  std::shared_ptr<State> state_;
};

class Boundary {
 public:
  /// Collective over `pp` (it is duplicated; `pp` itself is not used afterwards). Received
  /// tensors are placed on `device` (this stage's), whatever the sender's was.
  explicit Boundary(Communicator& pp, c10::Device device = c10::kCPU);
  /// Waits for the sends still in flight; never throws.
  ~Boundary();
  Boundary(const Boundary&) = delete;
  Boundary& operator=(const Boundary&) = delete;

  int rank() const { return rank_; }
  int size() const { return size_; }
  c10::Device device() const { return device_; }
  /// Neighbours: (rank + 1) % size and (rank − 1) % size.
  int next() const { return (rank_ + 1) % size_; }
  int prev() const { return (rank_ + size_ - 1) % size_; }

  /// Sends `tensors` (any number, any dtypes and shapes; undefined ones allowed) to next().
  Work send_forward(const std::vector<torch::Tensor>& tensors, int64_t id);
  /// Receives what prev() sent forward; the message must carry `expected_id`.
  PendingMessage recv_forward(int64_t expected_id);
  /// Sends gradients to prev(): one per tensor that arrived requiring grad, in order
  /// (undefined for none).
  Work send_backward(const std::vector<torch::Tensor>& grads, int64_t id);
  /// Receives what next() sent backward.
  PendingMessage recv_backward(int64_t expected_id);

  /// Waits for every send so far; rethrows the first failure.
  void synchronize();

 private:
  Work send(CommStream* stream, int dst, const std::vector<torch::Tensor>& tensors, int64_t id, bool forward);
  PendingMessage recv(CommStream* stream, int src, int64_t expected_id, bool forward);

  int rank_ = 0;
  int size_ = 1;
  c10::Device device_;
  // The duplicates: [direction][a, b, wrap]; see boundary.cpp for who uses which.
  std::vector<std::unique_ptr<CommStream>> streams_;
  CommStream* forward_send_ = nullptr;
  CommStream* forward_recv_ = nullptr;
  CommStream* backward_send_ = nullptr;
  CommStream* backward_recv_ = nullptr;
  std::vector<Work> in_flight_;
  // One stage: local hand-overs, oldest first.
  std::deque<Message> local_forward_, local_backward_;
};

/// Runs backward from the tensors of `outputs` that cross the boundary requiring grad, with
/// `grads` (one per such output, in order, as recv_backward returns them; undefined ones are
/// skipped). Not a collective, but sharded modules inside reduce gradients over their dp group.
void backward_from(const std::vector<torch::Tensor>& outputs, const std::vector<torch::Tensor>& grads);
/// The gradients to send back for received `inputs`: the .grad of each input that arrived
/// requiring grad, in order (undefined where backward left none).
std::vector<torch::Tensor> input_gradients(const std::vector<torch::Tensor>& inputs);

}  // namespace ztrain::pipe

namespace ztrain::detail {
/// The tensors a pipeline-boundary message header of `n` entries from rank `src` describes, and
/// its id. Throws ztrain::Error naming the sender on anything but a well-formed header (a wrong
/// magic, counts, dtypes or dimensions that do not fit, entries missing or left over).
std::vector<pipe::TensorMeta> decode_boundary_header(const int64_t* header, int64_t n, int64_t& id, int src);
}  // namespace ztrain::detail
