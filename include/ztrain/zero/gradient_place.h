#pragma once
/// Gradients written where they end up (Megatron calls the idea gradient accumulation fusion).
///
/// While a sharded module runs its backward, each of its parameters has a place in the module's
/// flat gradient buffer, the buffer that is then reduced. An operator that computes a parameter's
/// gradient itself (a linear's weight-gradient gemm) may write it into that place instead of
/// returning it to autograd, which would hand it to the module to be copied there.

#include <torch/torch.h>

#include <vector>

namespace ztrain {

namespace detail {

/// A parameter's place in a flat gradient buffer: `tensor` has the parameter's shape; `written`
/// says whether this backward has written it yet (before that its memory holds no values).
struct GradientPlace {
  torch::Tensor tensor;
  bool written = false;
};

/// The place of `param`'s gradient in the backward now running over its module, or null.
GradientPlace* gradient_place(const torch::Tensor& param);

/// The places of one backward's parameters, offered to operators (write_gradient) for the
/// object's lifetime.
class GradientPlaces {
 public:
  GradientPlaces() = default;
  GradientPlaces(const GradientPlaces&) = delete;
  GradientPlaces& operator=(const GradientPlaces&) = delete;
  ~GradientPlaces();

  /// Offers `place` (of param's shape) for param's gradient.
  void add(const torch::Tensor& param, torch::Tensor place);
  /// Whether an operator wrote param's gradient into its place.
  bool written(const torch::Tensor& param) const;

 private:
  std::vector<const c10::TensorImpl*> params_;
};

}  // namespace detail

/// Writes a gradient of `param` straight into its place when a sharded module's backward is
/// running over param: calls `write(place, accumulate)`, which sets `place` to the gradient
/// (accumulate false) or adds the gradient to it (true: something was written there before in
/// this backward), and returns true. Returns false and calls nothing otherwise; the caller then
/// returns the gradient to autograd as usual.
template <class Write>
bool write_gradient(const torch::Tensor& param, Write&& write) {
  auto* place = detail::gradient_place(param);
  if (!place) return false;
  write(place->tensor, place->written);
  place->written = true;
  return true;
}

}  // namespace ztrain
