#pragma once
/// How a tensor-parallel parameter relates to its full tensor.
///
/// A tensor-parallel layer holds on each rank of the tp group one slice of a full parameter and
/// declares how in its parameter record (runtime/parameter_record.h); everything that must see
/// full tensors — init_parameters, gathered model files, gathered optimizer state,
/// full_parameter — reads the record and slices or reassembles, so checkpoints hold the full
/// unsplit tensors and move between tp sizes.
///
/// A split is a dimension and a number of equal parts along it: the full dimension is `parts`
/// consecutive blocks (a fused QKV projection has three: q, k and v), and each block is divided
/// into tp equal chunks, chunk r going to tp rank r. With parts = 1 rank r holds the r-th
/// 1/tp of the dimension, as in Megatron-LM.
///
///   struct MyImpl : torch::nn::Module, ztrain::ParameterRecords { ... };
///   auto w = register_parameter("weight", torch::empty({out / tp, in}));
///   ztrain::tp::set_split(*this, "weight", {.dim = 0}, &ctx.tp());
///   ztrain::tp::split_of(*module, "weight");            // {dim 0, parts 1}
///   auto full = ztrain::tp::assemble(w, {.dim = 0}, ctx.tp());

#include <ztrain/runtime/parameter_record.h>

#include <torch/torch.h>

#include <optional>
#include <string>

namespace ztrain::tp {

using Split = TensorSplit;
using ztrain::assemble;
using ztrain::full_shape;
using ztrain::slice;

/// Declares `owner`'s parameter `name` this tp rank's slice of a full tensor split as `split`
/// over `group` (null: one rank). Throws ztrain::Error when the split does not fit its shape.
void set_split(ParameterRecords& owner, const std::string& name, Split split, Communicator* group);
/// Replaces the values of `owner`'s whole parameter `name` (the tensor `param`) with this rank's
/// slice of them, split `split` over `group`, and declares it: the parameter object stays, so
/// optimizers and holders keep referring to it. How a layer built whole is split afterwards.
void split_in_place(ParameterRecords& owner, const std::string& name, torch::Tensor& param, Split split,
                    Communicator& group);
/// The split `module` declared for its own parameter `name`, if any.
std::optional<Split> split_of(const torch::nn::Module& module, const std::string& name);

}  // namespace ztrain::tp
