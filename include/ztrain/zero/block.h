#pragma once
/// Block: a user module trained with ZeRO sharding and optional activation recomputation.
///
/// Wraps any `torch::nn::Module` whose forward takes tensors (and other arguments, passed
/// through unchanged) and returns a tensor, a std::tuple or std::pair of tensors, or a
/// std::vector of tensors — no adapter code. The wrapped module keeps its parameter objects and
/// names; `block->module()` is the user's module. See ShardedModule for the levels, and for what
/// `parameters()` (the shards an optimizer updates) returns.
///
/// Construction is collective over the data-parallel group (the parameters are broadcast from
/// dp rank 0); so is every forward and backward. A module can be wrapped once; calling one Block
/// several times in a forward is fine (each call reduces its own gradient).
///
///   struct LayerImpl : torch::nn::Module { ...; torch::Tensor forward(torch::Tensor x, torch::Tensor mask); };
///   TORCH_MODULE(Layer);
///   ztrain::Block<Layer> block(Layer(64), {.zero_level = 3, .use_checkpoint = true});
///   auto y = block(x, mask);              // like layer(x, mask)
///   torch::optim::SGD opt(block->parameters(), 0.1);

#include <ztrain/zero/sharded_module.h>

#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

namespace ztrain {
namespace detail {

template <class M>
auto module_impl(const M& m) {
  if constexpr (requires { m.ptr(); }) {
    return m.ptr();
  } else {
    return m;
  }
}

template <class T>
inline constexpr bool is_tensor_v = std::is_same_v<std::decay_t<T>, torch::Tensor>;

/// How a forward's result becomes a list of tensors and back.
template <class R>
struct Outputs {
  static_assert(sizeof(R) == 0,
                "ztrain::Block: the wrapped forward must return torch::Tensor, std::tuple or std::pair of "
                "tensors, or std::vector<torch::Tensor>");
};
template <>
struct Outputs<torch::Tensor> {
  static std::vector<torch::Tensor> flatten(torch::Tensor t) { return {std::move(t)}; }
  static torch::Tensor unflatten(std::vector<torch::Tensor> v) { return std::move(v[0]); }
};
template <>
struct Outputs<std::vector<torch::Tensor>> {
  static std::vector<torch::Tensor> flatten(std::vector<torch::Tensor> v) { return v; }
  static std::vector<torch::Tensor> unflatten(std::vector<torch::Tensor> v) { return v; }
};
template <class... Ts>
struct Outputs<std::tuple<Ts...>> {
  static_assert((is_tensor_v<Ts> && ...), "ztrain::Block: a returned tuple must hold only tensors");
  static std::vector<torch::Tensor> flatten(const std::tuple<Ts...>& t) {
    return std::apply([](const auto&... x) { return std::vector<torch::Tensor>{x...}; }, t);
  }
  static std::tuple<Ts...> unflatten(const std::vector<torch::Tensor>& v) {
    return [&]<size_t... I>(std::index_sequence<I...>) { return std::tuple<Ts...>{v[I]...}; }
    (std::index_sequence_for<Ts...>{});
  }
};
template <class A, class B>
struct Outputs<std::pair<A, B>> {
  static_assert(is_tensor_v<A> && is_tensor_v<B>, "ztrain::Block: a returned pair must hold tensors");
  static std::vector<torch::Tensor> flatten(const std::pair<A, B>& p) { return {p.first, p.second}; }
  static std::pair<A, B> unflatten(const std::vector<torch::Tensor>& v) { return {v[0], v[1]}; }
};

template <class A>
void check_argument() {
  using T = std::decay_t<A>;
  static_assert(!std::is_same_v<T, std::vector<torch::Tensor>> && !std::is_same_v<T, torch::TensorList> &&
                    !std::is_same_v<T, c10::optional<torch::Tensor>>,
                "ztrain::Block: pass tensors as separate torch::Tensor arguments (an undefined tensor "
                "stands for 'none'); lists and optionals of tensors would not carry gradients");
}

/// The argument tuple with its tensors replaced, in order, by `tensors`.
template <class... Args>
std::tuple<Args...> substitute(const std::tuple<Args...>& args, const std::vector<torch::Tensor>& tensors) {
  size_t next = 0;
  auto pick = [&](const auto& a) {
    if constexpr (is_tensor_v<decltype(a)>) {
      return tensors[next++];
    } else {
      return a;
    }
  };
  return std::apply([&](const auto&... a) { return std::tuple<Args...>{pick(a)...}; }, args);
}

}  // namespace detail

template <class M>
class BlockImpl : public ShardedModule {
 public:
  explicit BlockImpl(M module, BlockOptions options = {})
      : ShardedModule(detail::module_impl(module), options, "Block"), module_(std::move(module)) {}
  /// With the flat groups formed as `grouping` says (plugins: optimizer parameter groups kept apart).
  BlockImpl(M module, BlockOptions options, const ShardGrouping& grouping)
      : ShardedModule(detail::module_impl(module), options, "Block", grouping), module_(std::move(module)) {}

  template <class... Args>
  auto forward(Args&&... args) {
    (detail::check_argument<Args>(), ...);
    auto impl = detail::module_impl(module_);
    using Result = std::decay_t<decltype(impl->forward(std::forward<Args>(args)...))>;
    std::tuple<std::decay_t<Args>...> packed(std::forward<Args>(args)...);
    std::vector<torch::Tensor> tensors;
    std::apply([&](const auto&... a) { (push(tensors, a), ...); }, packed);
    Fn fn = [impl, packed](const std::vector<torch::Tensor>& in) {
      auto substituted = detail::substitute(packed, in);
      return detail::Outputs<Result>::flatten(std::apply([&](auto&... a) { return impl->forward(a...); }, substituted));
    };
    return detail::Outputs<Result>::unflatten(run(fn, tensors));
  }

  /// The user's module.
  M& module() { return module_; }

 private:
  template <class T>
  static void push(std::vector<torch::Tensor>& out, const T& t) {
    if constexpr (detail::is_tensor_v<T>) out.push_back(t);
  }

  M module_;
};

/// The module holder of BlockImpl<M>, like TORCH_MODULE.
template <class M>
class Block : public torch::nn::ModuleHolder<BlockImpl<M>> {
 public:
  using torch::nn::ModuleHolder<BlockImpl<M>>::ModuleHolder;
  /// Calls forward (ModuleHolder's operator() cannot see a template forward).
  template <class... Args>
  auto operator()(Args&&... args) {
    return this->get()->forward(std::forward<Args>(args)...);
  }
  Block(M module, BlockOptions options = {})
      : torch::nn::ModuleHolder<BlockImpl<M>>(std::make_shared<BlockImpl<M>>(std::move(module), options)) {}
};

}  // namespace ztrain
