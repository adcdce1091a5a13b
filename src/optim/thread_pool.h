#pragma once
// A fixed set of threads that run the parts of one job at a time, for the optimizers' fused
// passes. Internal to ztrain.
//
//   detail::ThreadPool pool(4);                     // 3 threads started here, once
//   pool.run(4, [&](int part) { update(part); });   // parts 1..3 on them, part 0 on the caller
//
// The threads live as long as the pool and sleep between jobs; run() wakes the ones it needs and
// returns when every part is done. Part k > 0 always runs on pool thread k − 1 and part 0 on the
// caller, so a job is split the same way every time. One caller at a time; run() is not
// reentrant (a part must not call run() on the same pool).

#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace ztrain::detail {

class ThreadPool {
 public:
  /// A pool for jobs of up to `size` parts: starts size − 1 threads. size >= 1.
  explicit ThreadPool(int size);
  /// Stops and joins the threads. Never throws.
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  /// The most parts a job may have: the threads plus the caller.
  int size() const { return static_cast<int>(threads_.size()) + 1; }

  /// Runs part(0) .. part(parts − 1), 1 <= parts <= size(), and waits for all of them. If parts
  /// throw, the first exception (by part number) is rethrown after all have finished.
  void run(int parts, const std::function<void(int)>& part);

 private:
  void work(int index);

  std::vector<std::thread> threads_;
  std::mutex mutex_;
  std::condition_variable wake_;   // a new job, or stop
  std::condition_variable done_;   // pending_ reached 0
  uint64_t generation_ = 0;        // bumped per job
  int parts_ = 0;                  // of the current job
  int pending_ = 0;                // parts of the current job run by threads, not yet finished
  const std::function<void(int)>* part_ = nullptr;
  std::vector<std::exception_ptr> errors_;  // per part of the current job
  bool stop_ = false;
};

}  // namespace ztrain::detail
