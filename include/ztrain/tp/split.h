#pragma once
/// How a tensor-parallel parameter relates to its full tensor.
///
/// A tensor-parallel layer holds on each rank of the tp group one slice of a full parameter.
/// It declares how with `set_split`; everything that must see full tensors — init_parameters,
/// gathered model files, gathered optimizer state, full_parameter — asks `split_of` and slices
/// or reassembles, so checkpoints hold the full unsplit tensors and move between tp sizes.
///
/// A split is a dimension and a number of equal parts along it: the full dimension is `parts`
/// consecutive blocks (a fused QKV projection has three: q, k and v), and each block is divided
/// into tp equal chunks, chunk r going to tp rank r. With parts = 1 rank r holds the r-th
/// 1/tp of the dimension, as in Megatron-LM.
///
///   auto w = register_parameter("weight", torch::empty({out / tp, in}));
///   ztrain::tp::set_split(w, {.dim = 0});
///   ztrain::tp::split_of(w);                      // {dim 0, parts 1}
///   auto full = ztrain::tp::assemble(w, *ztrain::tp::split_of(w), ztrain::runtime().tp());

#include <ztrain/comm/communicator.h>

#include <torch/torch.h>

#include <optional>
#include <vector>

namespace ztrain::tp {

struct Split {
  int64_t dim = 0;
  int64_t parts = 1;
};

/// Declares that `param` holds this tp rank's slice of a full tensor split as `split`. The
/// declaration follows the tensor object (set_data keeps it) and dies with it.
void set_split(const torch::Tensor& param, Split split);
/// The split declared for `t`, if any.
std::optional<Split> split_of(const torch::Tensor& t);
/// Whether `t` holds different elements on the ranks of a tp group: a split parameter, or a
/// flat shard of split parameters (gradient norms count such tensors on every tp rank and
/// replicated ones once).
bool is_tp_distinct(const torch::Tensor& t);
/// Marks a tensor that is distinct across the tp group without being a slice of one full
/// tensor (the flat shards of sharded modules).
void mark_tp_distinct(const torch::Tensor& t);

/// The tp group size of the runtime (1 without one).
int group_size();
/// The runtime's tp rank (0 without one).
int group_rank();

/// The full shape of a slice shaped `local` split `split` over `size` ranks.
std::vector<int64_t> full_shape(c10::IntArrayRef local, Split split, int size);
/// Rank `rank`'s slice (contiguous) of `full` split `split` over `size` ranks. Throws
/// ztrain::Error when the split dimension does not divide evenly.
torch::Tensor slice(const torch::Tensor& full, Split split, int rank, int size);
/// The full tensor from every rank's `local` slice (collective over `group`; not autograd).
torch::Tensor assemble(const torch::Tensor& local, Split split, Communicator& group);

}  // namespace ztrain::tp
