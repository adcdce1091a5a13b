#include <ztrain/comm/functional.h>

#include <torch/torch.h>

namespace ztrain::functional {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Autograd contexts hold IValues; the communicator travels as its address. It must outlive
// the backward pass (the runtime's communicators live until finalisation).
void put_comm(AutogradContext* ctx, Communicator& comm) {
  ctx->saved_data["comm"] = static_cast<int64_t>(reinterpret_cast<intptr_t>(&comm));
}
Communicator& get_comm(AutogradContext* ctx) {
  return *reinterpret_cast<Communicator*>(static_cast<intptr_t>(ctx->saved_data["comm"].toInt()));
}

torch::Tensor gather_flat(const torch::Tensor& x, Communicator& comm) {
  return comm.all_gather(x.contiguous().view(-1));
}

torch::Tensor reduce_scatter_flat(const torch::Tensor& x, Communicator& comm) {
  return comm.reduce_scatter(x.contiguous().view(-1), ReduceOp::kSum);
}

torch::Tensor all_reduce_copy(const torch::Tensor& x, Communicator& comm) {
  auto out = x.contiguous().clone();
  comm.all_reduce(out, ReduceOp::kSum);
  return out;
}

int64_t wrap_dim(int64_t dim, const torch::Tensor& x) {
  ZTRAIN_CHECK(x.dim() > 0, "gather/scatter along a dimension needs a tensor with at least one dimension");
  return c10::maybe_wrap_dim(dim, x.dim());
}

torch::Tensor gather_dim(const torch::Tensor& x, Communicator& comm, int64_t dim) {
  auto flat = gather_flat(x, comm);
  std::vector<int64_t> shape{comm.size()};
  shape.insert(shape.end(), x.sizes().begin(), x.sizes().end());
  return torch::cat(flat.view(shape).unbind(0), dim);
}

torch::Tensor own_slice(const torch::Tensor& x, Communicator& comm, int64_t dim) {
  ZTRAIN_CHECK(x.size(dim) % comm.size() == 0, "scatter_to_group: dimension ", dim, " of size ", x.size(dim),
               " does not divide into ", comm.size(), " equal parts over communicator '", comm.name(), "'");
  return x.chunk(comm.size(), dim)[comm.rank()].contiguous();
}

struct AllGather : torch::autograd::Function<AllGather> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x, Communicator* comm) {
    put_comm(ctx, *comm);
    ctx->saved_data["shape"] = x.sizes().vec();
    return gather_flat(x, *comm);
  }
  static variable_list backward(AutogradContext* ctx, variable_list g) {
    auto shape = ctx->saved_data["shape"].toIntVector();
    return {reduce_scatter_flat(g[0], get_comm(ctx)).view(shape), torch::Tensor()};
  }
};

struct ReduceScatter : torch::autograd::Function<ReduceScatter> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x, Communicator* comm) {
    put_comm(ctx, *comm);
    ctx->saved_data["shape"] = x.sizes().vec();
    return reduce_scatter_flat(x, *comm);
  }
  static variable_list backward(AutogradContext* ctx, variable_list g) {
    auto shape = ctx->saved_data["shape"].toIntVector();
    return {gather_flat(g[0], get_comm(ctx)).view(shape), torch::Tensor()};
  }
};

struct AllReduce : torch::autograd::Function<AllReduce> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x, Communicator* comm) {
    put_comm(ctx, *comm);
    return all_reduce_copy(x, *comm);
  }
  static variable_list backward(AutogradContext* ctx, variable_list g) {
    return {all_reduce_copy(g[0], get_comm(ctx)), torch::Tensor()};
  }
};

struct CopyToGroup : torch::autograd::Function<CopyToGroup> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x, Communicator* comm) {
    put_comm(ctx, *comm);
    return x.view_as(x);
  }
  static variable_list backward(AutogradContext* ctx, variable_list g) {
    return {all_reduce_copy(g[0], get_comm(ctx)), torch::Tensor()};
  }
};

struct ReduceFromGroup : torch::autograd::Function<ReduceFromGroup> {
  static torch::Tensor forward(AutogradContext*, const torch::Tensor& x, Communicator* comm) {
    return all_reduce_copy(x, *comm);
  }
  static variable_list backward(AutogradContext*, variable_list g) { return {g[0], torch::Tensor()}; }
};

struct GatherFromGroup : torch::autograd::Function<GatherFromGroup> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x, Communicator* comm, int64_t dim) {
    put_comm(ctx, *comm);
    ctx->saved_data["dim"] = dim;
    return gather_dim(x, *comm, dim);
  }
  static variable_list backward(AutogradContext* ctx, variable_list g) {
    return {own_slice(g[0], get_comm(ctx), ctx->saved_data["dim"].toInt()), torch::Tensor(), torch::Tensor()};
  }
};

struct ScatterToGroup : torch::autograd::Function<ScatterToGroup> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x, Communicator* comm, int64_t dim) {
    put_comm(ctx, *comm);
    ctx->saved_data["dim"] = dim;
    return own_slice(x, *comm, dim);
  }
  static variable_list backward(AutogradContext* ctx, variable_list g) {
    return {gather_dim(g[0], get_comm(ctx), ctx->saved_data["dim"].toInt()), torch::Tensor(), torch::Tensor()};
  }
};

}  // namespace

torch::Tensor all_gather(const torch::Tensor& x, Communicator& comm) { return AllGather::apply(x, &comm); }
torch::Tensor reduce_scatter(const torch::Tensor& x, Communicator& comm) {
  ZTRAIN_CHECK(x.numel() % comm.size() == 0, "reduce_scatter: ", x.numel(), " elements do not divide into ",
               comm.size(), " equal slices over communicator '", comm.name(), "'");
  return ReduceScatter::apply(x, &comm);
}
torch::Tensor all_reduce(const torch::Tensor& x, Communicator& comm) { return AllReduce::apply(x, &comm); }
torch::Tensor copy_to_group(const torch::Tensor& x, Communicator& comm) { return CopyToGroup::apply(x, &comm); }
torch::Tensor reduce_from_group(const torch::Tensor& x, Communicator& comm) {
  return ReduceFromGroup::apply(x, &comm);
}
torch::Tensor gather_from_group(const torch::Tensor& x, Communicator& comm, int64_t dim) {
  return GatherFromGroup::apply(x, &comm, wrap_dim(dim, x));
}
torch::Tensor scatter_to_group(const torch::Tensor& x, Communicator& comm, int64_t dim) {
  return ScatterToGroup::apply(x, &comm, wrap_dim(dim, x));
}

}  // namespace ztrain::functional
