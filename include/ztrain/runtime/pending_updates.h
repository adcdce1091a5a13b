#pragma once
/// Fences for tensors that another thread is still writing.
///
/// An asynchronous optimizer (optim::AdamOffload) updates parameters on a background thread
/// after step() has returned. It registers each parameter it will write with the future of that
/// write; whoever reads a parameter first waits for it: sharded modules before they gather or
/// use their buffers, checkpoint writers and readers before they touch parameters or optimizer
/// state. Waiting for a tensor that has no write in flight costs one mutex-protected lookup.
/// Thread-safe.
///
///   ztrain::mark_pending_update(shard, done);   // the writer
///   ztrain::wait_for_update(shard);             // a reader; rethrows the writer's error

#include <torch/torch.h>

#include <future>

namespace ztrain {

/// Registers a write of `t` that completes with `done` (replacing an earlier registration).
void mark_pending_update(const torch::Tensor& t, std::shared_future<void> done);
/// Whether a write of `t` is registered and not yet complete.
bool update_pending(const torch::Tensor& t);
/// Waits until the registered write of `t` (if any) completes; rethrows its error.
void wait_for_update(const torch::Tensor& t);
/// Waits for every registered write; rethrows the first error.
void wait_for_all_updates();

}  // namespace ztrain
