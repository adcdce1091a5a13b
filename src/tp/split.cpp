#include <ztrain/tp/split.h>

#include <ztrain/error.h>
#include <ztrain/runtime/init.h>

#include "../runtime/tensor_attributes.h"

namespace ztrain::tp {

namespace {

/// A split, or empty for a tensor distinct across the tp group without being a slice.
detail::TensorAttributes<std::optional<Split>>& registry() {
  static detail::TensorAttributes<std::optional<Split>> r;
  return r;
}

int64_t wrap(const Split& s, int64_t ndim) { return c10::maybe_wrap_dim(s.dim, ndim); }

}  // namespace

void set_split(const torch::Tensor& param, Split split) {
  ZTRAIN_CHECK(param.defined(), "tp::set_split: the tensor is undefined");
  ZTRAIN_CHECK(param.dim() > 0 && split.dim >= -param.dim() && split.dim < param.dim(), "tp::set_split: dimension ",
               split.dim, " is out of range for a tensor of shape ", param.sizes());
  ZTRAIN_CHECK(split.parts >= 1 && param.size(wrap(split, param.dim())) % split.parts == 0, "tp::set_split: ",
               split.parts, " parts do not divide dimension ", split.dim, " of shape ", param.sizes());
  split.dim = wrap(split, param.dim());
  registry().put(param, split);
}

std::optional<Split> split_of(const torch::Tensor& t) {
  const auto d = registry().find(t);
  return d ? *d : std::nullopt;
}

bool is_tp_distinct(const torch::Tensor& t) { return registry().find(t).has_value(); }

void mark_tp_distinct(const torch::Tensor& t) { registry().put(t, std::nullopt); }

int group_size() { return is_initialized() ? runtime().tp().size() : 1; }
int group_rank() { return is_initialized() ? runtime().tp().rank() : 0; }

std::vector<int64_t> full_shape(c10::IntArrayRef local, Split split, int size) {
  auto out = local.vec();
  out[wrap(split, static_cast<int64_t>(out.size()))] *= size;
  return out;
}

torch::Tensor slice(const torch::Tensor& full, Split split, int rank, int size) {
  const int64_t dim = wrap(split, full.dim());
  const int64_t n = full.size(dim);
  ZTRAIN_CHECK(n % (split.parts * size) == 0, "tensor parallelism: dimension ", dim, " of shape ", full.sizes(),
               " does not divide into ", split.parts, " part(s) x ", size, " ranks");
  if (size == 1) return full.contiguous();
  std::vector<int64_t> shape(full.sizes().begin(), full.sizes().end());
  shape[dim] = split.parts;
  shape.insert(shape.begin() + dim + 1, {static_cast<int64_t>(size), n / (split.parts * size)});
  auto local_shape = full.sizes().vec();
  local_shape[dim] = n / size;
  return full.reshape(shape).select(dim + 1, rank).reshape(local_shape).contiguous();
}

torch::Tensor assemble(const torch::Tensor& local, Split split, Communicator& group) {
  const int size = group.size();
  if (size == 1) return local.clone();
  const int64_t dim = wrap(split, local.dim());
  const int64_t chunk = local.size(dim) / split.parts;
  auto all = group.all_gather(local.contiguous().view(-1));  // [size · numel]
  // [size, ..., parts, chunk, ...] → [..., parts, size, chunk, ...] → full
  std::vector<int64_t> shape{size};
  for (int64_t d = 0; d < local.dim(); ++d) {
    if (d == dim) {
      shape.push_back(split.parts);
      shape.push_back(chunk);
    } else {
      shape.push_back(local.size(d));
    }
  }
  auto moved = all.view(shape).movedim(0, dim + 1);
  return moved.reshape(full_shape(local.sizes(), split, size));
}

}  // namespace ztrain::tp
