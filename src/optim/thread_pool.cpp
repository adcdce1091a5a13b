#include "thread_pool.h"

#include <ztrain/error.h>

namespace ztrain::detail {

ThreadPool::ThreadPool(int size) {
  ZTRAIN_CHECK(size >= 1, "a thread pool needs at least one thread (the caller), got ", size);
  threads_.reserve(size - 1);
  for (int i = 0; i + 1 < size; ++i) threads_.emplace_back([this, i] { work(i); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard lock(mutex_);
    stop_ = true;
  }
  wake_.notify_all();
  for (auto& t : threads_) t.join();
}

void ThreadPool::run(int parts, const std::function<void(int)>& part) {
  ZTRAIN_INTERNAL_ASSERT(parts >= 1 && parts <= size(), "a job of ", parts, " parts on a pool of ", size());
  errors_.assign(parts, nullptr);
  if (parts > 1) {
    {
      std::lock_guard lock(mutex_);
      ++generation_;
      parts_ = parts;
      pending_ = parts - 1;
      part_ = &part;
    }
    wake_.notify_all();
  }
  try {
    part(0);
  } catch (...) {
    errors_[0] = std::current_exception();
  }
  if (parts > 1) {
    std::unique_lock lock(mutex_);
    done_.wait(lock, [this] { return pending_ == 0; });
    part_ = nullptr;
  }
  for (const auto& e : errors_) {
    if (e) std::rethrow_exception(e);
  }
}

void ThreadPool::work(int index) {
  uint64_t seen = 0;
  const int my_part = index + 1;
  std::unique_lock lock(mutex_);
  while (true) {
    wake_.wait(lock, [&] { return stop_ || generation_ != seen; });
    if (stop_) return;
    seen = generation_;
    if (my_part >= parts_) continue;  // this job needs fewer threads
    const auto* part = part_;
    lock.unlock();
    try {
      (*part)(my_part);
    } catch (...) {
      errors_[my_part] = std::current_exception();
    }
    lock.lock();
    if (--pending_ == 0) done_.notify_one();
  }
}

}  // namespace ztrain::detail
