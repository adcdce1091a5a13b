#pragma once
/// An ordered queue of communication operations, run by a worker thread on its own duplicate
/// of a communicator.
///
/// Operations run one after another in submission order; each returns a Work handle. Because a
/// stream owns its communicator (and so its transport), two streams (say, one for parameter gathers and one for
/// gradient reductions) progress concurrently and never queue behind each other. The tensors an
/// operation names are kept alive until it completes; the caller must not touch them until its
/// Work is waited on.
///
/// Device operations are ordered with the streams of the threads involved: the worker's current
/// stream of the device waits, through an event recorded at submission, for what the
/// submitter's current stream held then, and `wait()` makes the waiting thread's current stream
/// wait for what the operation queued. Code that keeps to each thread's default stream sees one
/// stream order, as if it had run the operation itself.
///
/// Construction duplicates the communicator and is therefore collective: all members create
/// their streams in the same order. Submitting is thread-safe. After an operation fails, the
/// stream fails every later operation at once with the first error (its communicator's state
/// is unknown). The destructor runs what was submitted, then joins the worker; it never throws.
///
///   ztrain::CommStream gathers(rt.dp(), "gather");
///   auto w = gathers.all_gather(shard, full);
///   ...                                        // compute overlaps the transfer
///   w.wait();

#include <ztrain/comm/communicator.h>
#include <ztrain/comm/work.h>

#include <c10/core/Event.h>

#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <optional>
#include <thread>

namespace ztrain {

class CommStream {
 public:
  /// Duplicates `comm` (collective) under the name `<comm name>.<name>`.
  CommStream(Communicator& comm, const std::string& name);
  ~CommStream();
  CommStream(const CommStream&) = delete;
  CommStream& operator=(const CommStream&) = delete;

  /// Runs `fn` on the worker with the stream's communicator; `what` names it in errors. Given a
  /// device that is not the CPU, `fn` runs ordered after what the caller's current stream of that
  /// device holds now (see above).
  Work submit(std::function<void(Communicator&)> fn, const std::string& what = "operation",
              std::optional<c10::Device> device = std::nullopt);

  Work all_reduce(torch::Tensor tensor, ReduceOp op = ReduceOp::kSum);
  Work all_gather(torch::Tensor input, torch::Tensor output);
  Work reduce_scatter(torch::Tensor input, torch::Tensor output, ReduceOp op = ReduceOp::kSum);
  Work broadcast(torch::Tensor tensor, int root);
  Work send(torch::Tensor tensor, int dst, int tag = 0);
  Work recv(torch::Tensor tensor, int src, int tag = 0);
  Work barrier();

  /// Waits for everything submitted so far; rethrows the first failure.
  void synchronize();
  /// Blocks until at most `n` submitted operations are queued or running (bounding the memory
  /// the queued operations hold). Raises ztrain::CommError after the communicator's timeout.
  void throttle(size_t n);

  const std::string& name() const { return comm_->name(); }
  /// The stream's communicator. Use it only from submitted functions.
  Communicator& communicator() { return *comm_; }

 private:
  struct Task {
    Task() = default;
    Task(std::function<void(Communicator&)> fn, std::shared_ptr<detail::WorkState> state,
         std::optional<c10::Device> device);
    std::function<void(Communicator&)> fn;
    std::shared_ptr<detail::WorkState> state;
    std::optional<c10::Event> ready;  // on the submitter's stream at submission, for device operations
  };
  void run();
  void run_ordered(Task& task);  // runs fn, ordered with the device streams

  std::unique_ptr<Communicator> comm_;
  std::mutex mutex_;
  std::condition_variable cv_;       // the worker waits for work
  std::condition_variable drained_;  // throttle() waits for the worker
  std::deque<Task> queue_;
  size_t outstanding_ = 0;           // queued or running
  bool stopping_ = false;
  std::exception_ptr failure_;  // first failure, written and read by the worker only
  Work last_;                   // the most recent submission, for synchronize()
  std::thread worker_;
};

}  // namespace ztrain
