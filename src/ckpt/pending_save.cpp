#include <ztrain/ckpt/pending_save.h>

#include "background_save.h"

#include <ztrain/error.h>
#include <ztrain/runtime/parallel_context.h>

#include <condition_variable>
#include <iostream>
#include <mutex>
#include <thread>

// How it works: one BackgroundWriter per process runs saves one after another, each on a thread
// of its own (started when the previous one has finished and been joined), so that checkpoints
// are published in the order they were saved and only one copy of optimizer state waits in
// memory. A save runs its collectives on the background context of the model's ParallelContext
// (duplicates of its communicators, made by the first save), so they never share a communicator
// with the training thread's and the two progress independently. A save's outcome lives in a
// SaveJob shared by the thread and the handle.

namespace ztrain {

namespace detail {

struct SaveJob {
  std::string path;
  std::mutex mutex;
  std::condition_variable cv;
  bool done = false;
  bool observed = false;  // a wait() saw the outcome
  std::exception_ptr error;

  void finish(std::exception_ptr e) {
    {
      std::lock_guard<std::mutex> lock(mutex);
      done = true;
      error = std::move(e);
    }
    cv.notify_all();
  }
  /// Blocks until done; returns the error.
  std::exception_ptr await(bool observe) {
    std::unique_lock<std::mutex> lock(mutex);
    cv.wait(lock, [&] { return done; });
    if (observe) observed = true;
    return error;
  }
};

namespace {

class BackgroundWriter {
 public:
  ~BackgroundWriter() {
    // At process exit: after the running save and before MPI is finalised (the runtime and the
    // MPI guard were constructed before this object, so they are destroyed after it).
    wait_idle();
    if (thread_.joinable()) thread_.join();
  }

  void wait_idle() noexcept {
    std::shared_ptr<SaveJob> job;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      job = current_;
    }
    if (job) job->await(false);
  }

  PendingSave start(ParallelContext* context, std::string path, std::function<void(const SaveComms&)> write) {
    wait_idle();
    std::lock_guard<std::mutex> lock(mutex_);
    if (thread_.joinable()) thread_.join();
    const auto comms = comms_of(context ? &context->background_context() : nullptr);
    auto job = std::make_shared<SaveJob>();
    job->path = std::move(path);
    thread_ = std::thread([job, comms, write = std::move(write)]() mutable {
      std::exception_ptr error;
      try {
        write(comms);
      } catch (...) {
        error = std::current_exception();
      }
      write = nullptr;  // frees the snapshot before the handle learns the save is over
      job->finish(error);
    });
    current_ = job;
    return PendingSave(job);
  }

 private:
  std::mutex mutex_;
  std::shared_ptr<SaveJob> current_;
  std::thread thread_;
};

BackgroundWriter& writer() {
  static BackgroundWriter instance;
  return instance;
}

}  // namespace

void wait_for_background_save() noexcept { writer().wait_idle(); }

PendingSave start_background_save(ParallelContext* context, std::string path,
                                  std::function<void(const SaveComms&)> write) {
  return writer().start(context, std::move(path), std::move(write));
}

}  // namespace detail

PendingSave::PendingSave(std::shared_ptr<detail::SaveJob> job) : job_(std::move(job)) {}

PendingSave& PendingSave::operator=(PendingSave&& other) noexcept {
  if (this != &other) {
    wait_quietly();
    job_ = std::move(other.job_);
  }
  return *this;
}

PendingSave::~PendingSave() { wait_quietly(); }

void PendingSave::wait_quietly() noexcept {
  if (!job_) return;
  bool observed = false;
  {
    std::lock_guard<std::mutex> lock(job_->mutex);
    observed = job_->observed;
  }
  auto error = job_->await(false);
  if (!error || observed) return;
  try {
    std::rethrow_exception(error);
  } catch (const std::exception& e) {
    std::cerr << "ztrain: the background save of '" << job_->path
              << "' failed and no wait() reported it: " << e.what() << std::endl;
  } catch (...) {
    std::cerr << "ztrain: the background save of '" << job_->path << "' failed with an unknown error" << std::endl;
  }
}

void PendingSave::wait() const {
  if (!job_) return;
  if (auto error = job_->await(true)) std::rethrow_exception(error);
}

bool PendingSave::is_done() const {
  if (!job_) return true;
  std::lock_guard<std::mutex> lock(job_->mutex);
  return job_->done;
}

const std::string& PendingSave::path() const {
  static const std::string kNone;
  return job_ ? job_->path : kNone;
}

}  // namespace ztrain
