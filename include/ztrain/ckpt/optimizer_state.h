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

#include <torch/torch.h>

namespace ztrain {

void save_optimizer_state(torch::nn::Module& model, torch::optim::Optimizer& optimizer, const std::string& path,
                          const SaveOptions& options = {});
void load_optimizer_state(torch::nn::Module& model, torch::optim::Optimizer& optimizer, const std::string& path);

}  // namespace ztrain
