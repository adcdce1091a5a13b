#include <ztrain/comm/communicator.h>

#include <torch/torch.h>

namespace ztrain {

torch::Tensor Communicator::all_gather(const torch::Tensor& input) {
  auto output = torch::empty({input.numel() * size()}, input.options());
  all_gather(input, output);
  return output;
}

torch::Tensor Communicator::reduce_scatter(const torch::Tensor& input, ReduceOp op) {
  ZTRAIN_CHECK(input.numel() % size() == 0, "reduce_scatter: input of ", input.numel(),
               " elements does not divide into ", size(), " equal slices; pad it to a multiple of ",
               size());
  auto output = torch::empty({input.numel() / size()}, input.options());
  reduce_scatter(input, output, op);
  return output;
}

double Communicator::all_reduce_scalar(double value, ReduceOp op) {
  auto t = torch::tensor({value}, torch::kFloat64);
  all_reduce(t, op);
  return t.item<double>();
}

int64_t Communicator::all_reduce_scalar(int64_t value, ReduceOp op) {
  auto t = torch::tensor({value}, torch::kInt64);
  all_reduce(t, op);
  return t.item<int64_t>();
}

}  // namespace ztrain
