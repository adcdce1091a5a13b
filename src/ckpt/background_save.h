#pragma once
// The process's background save thread: one save at a time, on the background context of the
// model's ParallelContext. Used by the *_async savers.

#include "sharded_io.h"

#include <ztrain/ckpt/model_file.h>
#include <ztrain/ckpt/pending_save.h>

#include <torch/torch.h>

#include <functional>
#include <string>

namespace ztrain::detail {

/// Blocks until no background save of this process is running. Never throws (a failed save
/// reports to its own handle).
void wait_for_background_save() noexcept;

/// Waits for the running background save, then runs `write` on the background thread with the
/// communicators of `context`'s background context (none for a null context) and returns its
/// handle; `path` is what the save publishes. The first call for a context makes its background
/// context — collective over its world, so every rank must call this at the same point of its
/// program. `write` must own everything it touches (copies, not the caller's live tensors).
PendingSave start_background_save(ParallelContext* context, std::string path,
                                  std::function<void(const SaveComms&)> write);

/// The write of save_optimizer_state(model, optimizer, path, options) from a copy of this rank's
/// state taken now: call it (collective over comms.world) on any thread to write the file.
std::function<void(const SaveComms&)> optimizer_state_writer(torch::nn::Module& model,
                                                              torch::optim::Optimizer& optimizer,
                                                              const std::string& path, const SaveOptions& options);

}  // namespace ztrain::detail
