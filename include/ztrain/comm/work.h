#pragma once
/// A handle on an operation submitted to a CommStream.
///
/// `wait()` blocks until the operation finished and rethrows its error, if any (a
/// ztrain::CommError for a transport failure, a ztrain::Error for bad input). It raises
/// ztrain::CommError itself when the operation has not finished within the timeout. Handles are
/// cheap to copy; all copies observe the same operation. Thread-safe.
///
///   auto work = stream.all_gather(shard, full);
///   compute_something_else();
///   work.wait();                       // full is ready

#include <chrono>
#include <exception>
#include <memory>
#include <optional>
#include <string>

namespace ztrain {

namespace detail {
struct WorkState;
}

class Work {
 public:
  Work() = default;
  explicit Work(std::shared_ptr<detail::WorkState> state) : state_(std::move(state)) {}

  /// False for a default-constructed handle.
  bool defined() const { return state_ != nullptr; }
  /// True once the operation ran to completion or failed. Never blocks.
  bool is_completed() const;
  /// Blocks until completion; rethrows the operation's error. Not given: the timeout of the
  /// stream's communicator. For a device operation, the calling thread's current stream of the
  /// device then waits for what the operation queued on the device.
  void wait(std::optional<std::chrono::milliseconds> timeout = std::nullopt) const;
  /// The operation's error, if it failed (null otherwise or while running).
  std::exception_ptr error() const;

 private:
  std::shared_ptr<detail::WorkState> state_;
};

}  // namespace ztrain
