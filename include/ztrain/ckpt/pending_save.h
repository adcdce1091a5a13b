#pragma once
/// A save running on the process's background save thread (save_optimizer_state_async,
/// save_checkpoint_async).
///
/// wait() blocks until the save finished — its file is then published on every rank that
/// waited — and rethrows its error: a ztrain::Error for a mistake such as an unwritable path, a
/// ztrain::CommError for a failed transfer. Every call of wait() rethrows the same error.
/// is_done() never blocks. The destructor waits too but never throws; an error that no wait()
/// observed is printed to stderr there rather than lost silently. Move-only; one thread per
/// handle. A default-constructed handle holds nothing: it is done and wait() returns.
///
///   auto pending = ztrain::save_optimizer_state_async(*model, opt, "optim.safetensors");
///   for (int i = 0; i < 10; ++i) train_step();   // the write overlaps these steps
///   pending.wait();                              // complete, or throws what went wrong

#include <memory>
#include <string>

namespace ztrain {

namespace detail {
struct SaveJob;
}

class PendingSave {
 public:
  PendingSave() = default;
  explicit PendingSave(std::shared_ptr<detail::SaveJob> job);
  PendingSave(PendingSave&& other) noexcept = default;
  /// Waits for the save this handle held (never throws) before taking the other one.
  PendingSave& operator=(PendingSave&& other) noexcept;
  PendingSave(const PendingSave&) = delete;
  PendingSave& operator=(const PendingSave&) = delete;
  ~PendingSave();

  /// Blocks until the save finished; rethrows its error.
  void wait() const;
  /// True once the save finished, successfully or not.
  bool is_done() const;
  /// The file or directory that appears when the save completes ("" for an empty handle).
  const std::string& path() const;

 private:
  void wait_quietly() noexcept;

  std::shared_ptr<detail::SaveJob> job_;
};

}  // namespace ztrain
