#pragma once
/// Training checkpoints: everything a run needs to continue — at the same or another world size.
///
/// A checkpoint is a directory `<root>/step-<8 digits>/` holding
///   model.safetensors      every parameter, full tensors, plain names (see save())
///   optimizer.safetensors  every optimizer state tensor, full-sized, by parameter name
///   rng.safetensors        each rank's generator states: the CPU's ("rank<r>"), a CUDA device's ("rank<r>.cuda")
///   manifest.json          step, world layout, OptimManager state (loss scaler, schedules,
///                          step counters), the caller's extra JSON (data position, config), and
///                          the SHA-256 of every file
/// Files are written by all ranks in parallel into a temporary directory, fsynced, then rank 0
/// writes the manifest, renames the directory into place and, last, points `<root>/latest` at
/// it. A save killed at any moment leaves the previous checkpoints intact; load verifies every
/// file against the manifest and names a corrupt or missing one. The model and optimizer files
/// do not depend on the world size, so a run resumes on any number of ranks (each rank reads
/// the elements it holds); generator states are restored only at the same world size.
///
/// save_checkpoint and load_checkpoint are collective over the world. save_checkpoint_async
/// writes the optimizer state and publishes on the background save thread instead.
///
///   ztrain::TrainingState state{*model, optimizer, manager};
///   ztrain::save_checkpoint("ckpt", step, state, R"({"data": {"step": 120}})");
///   if (auto dir = ztrain::latest_checkpoint("ckpt")) auto info = ztrain::load_checkpoint(*dir, state);

#include <ztrain/ckpt/pending_save.h>
#include <ztrain/optim/optim_manager.h>

#include <torch/torch.h>

#include <functional>
#include <optional>
#include <string>
#include <vector>

namespace ztrain {

struct TrainingState {
  torch::nn::Module& model;
  torch::optim::Optimizer& optimizer;
  optim::OptimManager& manager;
};

struct CheckpointOptions {
  /// Keep only the newest keep_last checkpoints under the root (0: keep all).
  int keep_last = 0;
  /// Called on every rank once all files are in the temporary directory, before the manifest
  /// is written and the directory published (for progress reports and crash tests). By
  /// save_checkpoint_async: on the background save thread.
  std::function<void()> before_publish;
};

struct CheckpointInfo {
  std::string dir;
  int64_t step = 0;
  int world_size = 0;
  /// The extra JSON given to save_checkpoint.
  std::string extra_json;
};

/// Writes the checkpoint of `step` under `root` and returns its directory. Waits first for a
/// save_checkpoint_async still running, so checkpoints are published in the order saved.
std::string save_checkpoint(const std::string& root, int64_t step, const TrainingState& state,
                            const std::string& extra_json = "{}", const CheckpointOptions& options = {});

/// save_checkpoint with the optimizer state written while training goes on. On the calling
/// thread it writes the model file and takes the generator states, the OptimManager state and
/// a copy of the optimizer state (see save_optimizer_state_async), so training may step right
/// after it returns. The background save thread then writes the optimizer file and publishes
/// exactly as save_checkpoint does — manifest, rename, `latest` — only after that file is
/// complete, so a checkpoint is never visible half-written. Collective over the world; waits
/// first for the previous background save. The handle's path() is the checkpoint directory;
/// its wait() returns once the checkpoint is published and rethrows what failed.
///
///   auto pending = ztrain::save_checkpoint_async("ckpt", step, state);
///   train_some_steps();
///   pending.wait();                              // ckpt/step-…/ is complete and `latest`
PendingSave save_checkpoint_async(const std::string& root, int64_t step, const TrainingState& state,
                                  const std::string& extra_json = "{}", const CheckpointOptions& options = {});

/// The newest complete checkpoint under `root`: the one `latest` names if it is complete, else
/// the highest step with a manifest; nullopt when there is none. Not collective.
std::optional<std::string> latest_checkpoint(const std::string& root);

/// The complete checkpoints under `root` (directories step-NNNNNNNN with a manifest), newest
/// first. Not collective.
std::vector<std::string> checkpoints(const std::string& root);

/// Checks that every file of the checkpoint in `dir` is present and has the SHA-256 its manifest
/// records, and returns what the manifest says; raises ztrain::Error naming the missing or
/// corrupt file. Reads every file; not collective. What a reader of a checkpoint that does not go
/// through load_checkpoint calls first.
CheckpointInfo verify_checkpoint(const std::string& dir);

/// Verifies (as verify_checkpoint, on world rank 0) and loads the checkpoint in `dir` into `state`.
CheckpointInfo load_checkpoint(const std::string& dir, const TrainingState& state);

}  // namespace ztrain
