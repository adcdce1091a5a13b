#pragma once
/// Model files: every parameter, full-sized, in one safetensors file under the names a plain
/// libtorch model would give it.
///
/// save() is collective over the data-parallel group. Each rank writes the elements it holds
/// straight into one shared temporary file (no rank ever holds the whole model); when the
/// ranks cannot all see the file — a path that is not on a shared filesystem — they fall back,
/// together, to gathering one module at a time onto rank 0, which writes. Rank 0 then commits
/// the file atomically: a reader of `path` sees the previous file or the complete new one.
///
/// load() works at any world size and on any model whose parameter names and shapes match —
/// a plain libtorch model too, without init_distributed. Each rank reads only the elements it
/// holds. Values are converted to the parameter's dtype (a fp32 file loads into a bf16 model).
/// Unknown or missing names, and shape mismatches, are errors naming the tensor and the file.
/// Buffers are not saved.
///
///   ztrain::save(*model, "model.safetensors");          // all ranks
///   ztrain::load(*model, "model.safetensors");          // all ranks, any world size
///   ztrain::load(*plain_libtorch_model, "model.safetensors");

#include <ztrain/ckpt/safetensors.h>

#include <torch/torch.h>

#include <optional>
#include <string>

namespace ztrain {

class ParallelContext;

struct SaveOptions {
  /// Stored in the file's __metadata__ ("format": "pt" is always added).
  ckpt::Metadata metadata;
  /// Every rank writes its own elements (true) or rank 0 writes what the others gather to it
  /// (false). Not set: parallel when every rank can see the file rank 0 created.
  std::optional<bool> parallel;
  /// The mesh the model lives on. Null: the one its parameters' records name (context_of), which
  /// a plain model under a plugin on a mesh of its own does not (Booster passes the plugin's).
  ParallelContext* context = nullptr;
};

struct LoadOptions {
  /// Entries of the file that the model does not have are an error (true) or ignored.
  bool strict = true;
  /// As SaveOptions::context.
  ParallelContext* context = nullptr;
};

void save(torch::nn::Module& model, const std::string& path, const SaveOptions& options = {});
void load(torch::nn::Module& model, const std::string& path, const LoadOptions& options = {});

}  // namespace ztrain
