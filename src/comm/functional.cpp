#include <ztrain/comm/functional.h>

#include <torch/torch.h>

namespace ztrain::functional {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// The communication steps, all with one signature so that Conjugate below can pair any two.
torch::Tensor gather_flat(const torch::Tensor& x, Communicator& comm, int64_t) {
  return comm.all_gather(x.contiguous().view(-1));
}

torch::Tensor reduce_scatter_flat(const torch::Tensor& x, Communicator& comm, int64_t) {
  return comm.reduce_scatter(x.contiguous().view(-1), ReduceOp::kSum);
}

torch::Tensor all_reduce_copy(const torch::Tensor& x, Communicator& comm, int64_t) {
  auto out = x.contiguous().clone();
  comm.all_reduce(out, ReduceOp::kSum);
  return out;
}

torch::Tensor identity(const torch::Tensor& x, Communicator&, int64_t) { return x.view_as(x); }

torch::Tensor gather_dim(const torch::Tensor& x, Communicator& comm, int64_t dim) {
  auto flat = gather_flat(x, comm, dim);
  std::vector<int64_t> shape{comm.size()};
  shape.insert(shape.end(), x.sizes().begin(), x.sizes().end());
  return torch::cat(flat.view(shape).unbind(0), dim);
}

torch::Tensor own_slice(const torch::Tensor& x, Communicator& comm, int64_t dim) {
  ZTRAIN_CHECK(x.size(dim) % comm.size() == 0, "scatter_to_group: dimension ", dim, " of size ", x.size(dim),
               " does not divide into ", comm.size(), " equal parts over communicator '", comm.name(), "'");
  return x.chunk(comm.size(), dim)[comm.rank()].contiguous();
}

int64_t wrap_dim(int64_t dim, const torch::Tensor& x) {
  ZTRAIN_CHECK(x.dim() > 0, "gather/scatter along a dimension needs a tensor with at least one dimension");
  return c10::maybe_wrap_dim(dim, x.dim());
}

using Step = torch::Tensor (*)(const torch::Tensor&, Communicator&, int64_t);

// An autograd function that runs Forward, and Backward on the incoming gradient (which always
// comes back in the input's shape).
template <Step Forward, Step Backward>
struct Conjugate : torch::autograd::Function<Conjugate<Forward, Backward>> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x, Communicator* comm, int64_t dim) {
    // Autograd contexts hold IValues; the communicator travels as its address. It must outlive
    // the backward pass (a context's communicators live as long as the context).
    ctx->saved_data["comm"] = static_cast<int64_t>(reinterpret_cast<intptr_t>(comm));
    ctx->saved_data["dim"] = dim;
    ctx->saved_data["shape"] = x.sizes().vec();
    return Forward(x, *comm, dim);
  }
  static variable_list backward(AutogradContext* ctx, variable_list g) {
    auto& comm = *reinterpret_cast<Communicator*>(static_cast<intptr_t>(ctx->saved_data["comm"].toInt()));
    auto grad = Backward(g[0], comm, ctx->saved_data["dim"].toInt());
    return {grad.reshape(ctx->saved_data["shape"].toIntVector()), torch::Tensor(), torch::Tensor()};
  }
};

}  // namespace

torch::Tensor all_gather(const torch::Tensor& x, Communicator& comm) {
  return Conjugate<gather_flat, reduce_scatter_flat>::apply(x, &comm, 0);
}
torch::Tensor reduce_scatter(const torch::Tensor& x, Communicator& comm) {
  ZTRAIN_CHECK(x.numel() % comm.size() == 0, "reduce_scatter: ", x.numel(), " elements do not divide into ",
               comm.size(), " equal slices over communicator '", comm.name(), "'");
  return Conjugate<reduce_scatter_flat, gather_flat>::apply(x, &comm, 0);
}
torch::Tensor all_reduce(const torch::Tensor& x, Communicator& comm) {
  return Conjugate<all_reduce_copy, all_reduce_copy>::apply(x, &comm, 0);
}
torch::Tensor copy_to_group(const torch::Tensor& x, Communicator& comm) {
  return Conjugate<identity, all_reduce_copy>::apply(x, &comm, 0);
}
torch::Tensor reduce_from_group(const torch::Tensor& x, Communicator& comm) {
  return Conjugate<all_reduce_copy, identity>::apply(x, &comm, 0);
}
torch::Tensor gather_from_group(const torch::Tensor& x, Communicator& comm, int64_t dim) {
  return Conjugate<gather_dim, own_slice>::apply(x, &comm, wrap_dim(dim, x));
}
torch::Tensor scatter_to_group(const torch::Tensor& x, Communicator& comm, int64_t dim) {
  return Conjugate<own_slice, gather_dim>::apply(x, &comm, wrap_dim(dim, x));
}

}  // namespace ztrain::functional
