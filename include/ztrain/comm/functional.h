#pragma once
/// Autograd-aware collectives: each forward communication has its adjoint in backward, so
/// gradients stay exact when a model's computation spans ranks (tensor parallelism, sharded
/// parameters).
///
/// Two conventions, one per use. The flat trio (all_gather, reduce_scatter, all_reduce) serves
/// data-parallel and sharded-parameter code: ranks compute different losses and the objective
/// is their sum, so a tensor every rank consumed gets the sum of their gradients. The *_group
/// functions are Megatron-LM's tensor-parallel regions: the ranks of the group compute one
/// replicated loss, so replicated activations carry the same gradient everywhere and no
/// gradient is counted twice. All functions are collective over `comm`, in forward and again
/// in backward.
///
/// | function          | forward                          | backward                        |
/// |-------------------|----------------------------------|---------------------------------|
/// | all_gather        | flat gather, size()·n elements   | reduce_scatter (sum)            |
/// | reduce_scatter    | sum, keep slice rank()           | all_gather                      |
/// | all_reduce        | sum                              | all_reduce (sum)                |
/// | copy_to_group     | identity                         | all_reduce (sum)                |
/// | reduce_from_group | all_reduce (sum)                 | identity                        |
/// | gather_from_group | concatenate along `dim`          | keep own slice along `dim`      |
/// | scatter_to_group  | keep own slice along `dim`       | concatenate along `dim`         |
///
///   // Megatron column-parallel linear followed by row-parallel linear:
///   auto h = torch::matmul(ztrain::functional::copy_to_group(x, tp), w1_shard);
///   auto y = ztrain::functional::reduce_from_group(torch::matmul(h, w2_shard), tp);

#include <ztrain/comm/communicator.h>

namespace ztrain::functional {

torch::Tensor all_gather(const torch::Tensor& x, Communicator& comm);
torch::Tensor reduce_scatter(const torch::Tensor& x, Communicator& comm);
torch::Tensor all_reduce(const torch::Tensor& x, Communicator& comm);
torch::Tensor copy_to_group(const torch::Tensor& x, Communicator& comm);
torch::Tensor reduce_from_group(const torch::Tensor& x, Communicator& comm);
torch::Tensor gather_from_group(const torch::Tensor& x, Communicator& comm, int64_t dim = -1);
torch::Tensor scatter_to_group(const torch::Tensor& x, Communicator& comm, int64_t dim = -1);

}  // namespace ztrain::functional
