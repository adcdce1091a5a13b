#pragma once
/// The communicator interface: collectives and point-to-point transfers over a group of ranks.
///
/// Every call that names a group operation (all_reduce, all_gather, reduce_scatter, broadcast,
/// barrier and the *_bytes / *_object helpers) is collective: every member of the group must
/// make the same call, in the same order, with matching sizes and dtypes. Tensors must be
/// contiguous and on the communicator's device; nothing is ever copied silently, and a wrong
/// size or dtype raises ztrain::Error before any rank blocks. Every wait has a finite deadline
/// (`timeout()`); when it passes, or the transport fails, the call raises ztrain::CommError and
/// the communicator refuses further calls (its state is unknown after a partial collective).
///
/// A communicator is not thread-safe: use one per thread. CommStream owns a duplicate for its
/// worker, so a stream's operations and the caller's never share an MPI communicator.
///
///   auto& dp = ztrain::runtime().dp();
///   dp.all_reduce(grad, ztrain::ReduceOp::kAvg);          // every dp rank calls this
///   auto full = dp.all_gather(shard);                      // size() * shard.numel() elements

#include <ztrain/error.h>

#include <torch/types.h>

#include <chrono>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

namespace ztrain {

/// Reductions. kAvg divides the sum by the group size and needs a floating dtype. For bool,
/// kSum and kMax are logical or, kMin is logical and.
enum class ReduceOp { kSum, kAvg, kMax, kMin };

const char* to_string(ReduceOp op);

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
  int64_t total_bytes() const {
    return all_reduce_bytes + all_gather_bytes + reduce_scatter_bytes + broadcast_bytes +
           send_bytes;
  }
};

class Communicator {
 public:
  virtual ~Communicator() = default;
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  /// This rank's index in the group, and the group size.
  virtual int rank() const = 0;
  virtual int size() const = 0;
  /// The group's name in messages ("world", "tp", "dp", "pp", ...).
  virtual const std::string& name() const = 0;
  /// The world rank of a group member, for messages and topology queries.
  virtual int world_rank_of(int group_rank) const = 0;

  /// Deadline for any single wait inside a call.
  virtual std::chrono::milliseconds timeout() const = 0;
  virtual void set_timeout(std::chrono::milliseconds timeout) = 0;
  /// When on, every collective first checks that all members agree on the operation, dtype,
  /// sizes and root, and raises ztrain::Error naming the ranks that disagree.
  virtual bool debug() const = 0;
  virtual void set_debug(bool on) = 0;

  /// In place: `tensor` becomes the reduction over the group.
  virtual void all_reduce(const torch::Tensor& tensor, ReduceOp op = ReduceOp::kSum) = 0;
  /// `output` (size() * input.numel() elements) receives every rank's `input`, in rank order.
  /// `input` may be this rank's slice of `output` (in-place gather).
  virtual void all_gather(const torch::Tensor& input, const torch::Tensor& output) = 0;
  /// `input` (size() * output.numel() elements) is reduced; rank r receives slice r.
  virtual void reduce_scatter(const torch::Tensor& input, const torch::Tensor& output,
                              ReduceOp op = ReduceOp::kSum) = 0;
  /// In place: every rank's `tensor` becomes root's.
  virtual void broadcast(const torch::Tensor& tensor, int root) = 0;
  /// Point-to-point. Shapes and dtypes must match on both ends (the receiver supplies the
  /// buffer); `tag` pairs a send with its receive.
  virtual void send(const torch::Tensor& tensor, int dst, int tag = 0) = 0;
  virtual void recv(const torch::Tensor& tensor, int src, int tag = 0) = 0;
  virtual void barrier() = 0;

  /// Variable-length byte strings: every rank's bytes, in rank order.
  virtual std::vector<std::string> all_gather_bytes(std::string_view bytes) = 0;
  /// Root's bytes on every rank (the argument is ignored elsewhere).
  virtual std::string broadcast_bytes(std::string_view bytes, int root) = 0;

  /// A new communicator over the same ranks, with its own message space (collective).
  virtual std::unique_ptr<Communicator> dup(const std::string& name) = 0;
  /// Ranks passing the same `color` form a group, ordered by `key` (collective).
  virtual std::unique_ptr<Communicator> split(int color, int key, const std::string& name) = 0;

  virtual CommStats stats() const = 0;
  virtual void reset_stats() = 0;

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

 protected:
  Communicator() = default;
};

}  // namespace ztrain
