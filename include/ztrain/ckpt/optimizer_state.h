#pragma once
/// Optimizer state files: every state tensor under "<parameter name>.<state>" with the
/// parameter's full shape, so the file does not depend on the world size or ZeRO level it was
/// written at.
///
/// Works for ztrain's AdamW/Adam (exp_avg, exp_avg_sq, master for bf16/fp16 parameters) and
/// libtorch's Adam, AdamW (exp_avg, exp_avg_sq, max_exp_avg_sq) and SGD (momentum_buffer);
/// the per-parameter step counters go to the file's metadata. The optimizer's parameters must
/// be the model's: shards of its sharded modules or its plain parameters. Hyperparameters are
/// not stored (the run that loads decides them).
///
/// Collective over the data-parallel group like save()/load(): each rank writes and reads the
/// elements it holds. Loading at another world size or level reshards.
///
///   ztrain::save_optimizer_state(*model, opt, "optim.safetensors");
///   ztrain::load_optimizer_state(*model, opt, "optim.safetensors");   // any world size

#include <ztrain/ckpt/model_file.h>
#include <ztrain/ckpt/pending_save.h>

#include <torch/torch.h>

namespace ztrain {

void save_optimizer_state(torch::nn::Module& model, torch::optim::Optimizer& optimizer, const std::string& path,
                          const SaveOptions& options = {});
void load_optimizer_state(torch::nn::Module& model, torch::optim::Optimizer& optimizer, const std::string& path);

/// save_optimizer_state with the writing overlapped with training: the same file, written on
/// the process's background save thread.
///
/// Collective over the world: every rank must call it at the same point of its program. Before
/// it returns it copies the state tensors this rank holds, so the optimizer may step (and the
/// model and optimizer may change or go away) right after; the copy is freed when the write
/// ends. The background thread runs its collectives on the background context of the model's
/// parallel context (duplicates of its communicators, made by the first call, collectively, and
/// reused), so the training thread's collectives go on meanwhile. At most one background save runs in a
/// process: a call first waits for the previous one to finish. `path` is published atomically
/// when the write completes (a reader sees the previous file or the complete new one); the
/// handle's wait() returns then, or rethrows what failed (an unwritable path, a failed
/// transfer). Wait for the handle, or destroy it, before finalize_distributed().
///
///   auto pending = ztrain::save_optimizer_state_async(*model, opt, "optim.safetensors");
///   for (int i = 0; i < 10; ++i) train_step();   // overlaps the write
///   pending.wait();
PendingSave save_optimizer_state_async(torch::nn::Module& model, torch::optim::Optimizer& optimizer,
                                       const std::string& path, const SaveOptions& options = {});

}  // namespace ztrain
