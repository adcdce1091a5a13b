#pragma once
/// LayerList: a model's repeated layers, held as torch::nn::ModuleList holds them, that the
/// FullyShard plugin can wrap into ZeRO-3 Blocks without the model's code changing.
///
///   struct ModelImpl : torch::nn::Module {
///     ModelImpl() {
///       for (int i = 0; i < 12; ++i) layers->push_back(Layer(512));
///       register_module("layers", layers);
///     }
///     torch::Tensor forward(torch::Tensor x) {
///       for (auto& layer : *layers) x = layer(x, mask);   // or: x = layers(x, mask)
///       return x;
///     }
///     ztrain::LayerList<Layer> layers;
///   };
///
/// Alone, or under DataParallel and LowLevelZero, it is a list of plain layers called in order;
/// the children are named 0, 1, … as ModuleList names them, so files and names are the same.
/// shard() (FullyShard calls it) wraps every layer in a Block — ZeRO level 3 over the dp group,
/// the next layers prefetched in list order (FullyShard relinks them in the order its first
/// step ran them) — registered in the layer's place under the same name; from then on every
/// call goes through the Blocks, and `layer.module()` is still the user's layer. A layer's
/// forward must be one a Block can wrap: tensors and other arguments in, a tensor, a tuple or
/// pair of tensors, or a vector of tensors out (zero/block.h). hold() (HybridParallel calls it
/// for a pipeline stage) keeps contiguous parts of the layers and lets go of the others.
///
/// A list made with its size and a factory, `layers(12, [&](size_t) { return Layer(512); })`,
/// builds only the layers the enclosing LayerListScope holds (HybridParallel::build opens one
/// for the rank's pipeline stage): the others are never made, and their places hold empty
/// modules as hold() leaves them. Made outside a scope, it builds every layer.

#include <ztrain/error.h>
#include <ztrain/zero/block_list.h>

#include <algorithm>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace ztrain {

/// Which layers the LayerLists made with a size and a factory in this thread build, while it
/// lives: given a list's size, the ranges [first, last) to build. Scopes nest; the innermost
/// applies.
class LayerListScope {
 public:
  using Ranges = std::vector<std::pair<size_t, size_t>>;
  explicit LayerListScope(std::function<Ranges(size_t size)> held);
  ~LayerListScope();
  LayerListScope(const LayerListScope&) = delete;
  LayerListScope& operator=(const LayerListScope&) = delete;
  /// The innermost scope of this thread, or null.
  static const LayerListScope* current();
  /// The ranges to build of a list of `size` layers (checked against the size).
  Ranges held(size_t size) const;
  /// Whether layer `i` lies in one of `ranges`.
  static bool contains(const Ranges& ranges, size_t i) {
    return std::any_of(ranges.begin(), ranges.end(), [i](const auto& r) { return i >= r.first && i < r.second; });
  }

 private:
  std::function<Ranges(size_t)> held_;
  const LayerListScope* outer_;
};

/// What FullyShard and HybridParallel need of any LayerList<M>.
class LayerListBase : public torch::nn::Module {
 public:
  /// The layers of the whole list, held or not.
  virtual size_t size() const = 0;
  /// Keeps the layers of the ranges [first, last) and drops the others (a pipeline stage's
  /// share, before shard(); several ranges for an interleaved schedule's model chunks): each
  /// dropped layer's registration is replaced by an empty module, so parameters(), files and
  /// shard() see the held layers only, under their indices in the whole list, and the list lets
  /// go of the dropped ones. Calling a dropped layer throws.
  virtual void hold(const std::vector<std::pair<size_t, size_t>>& ranges) = 0;
  /// Whether layer i is held (every layer, unless hold() dropped some or a LayerListScope
  /// left it unmade).
  virtual bool holds(size_t i) const = 0;
  /// Whether the list was made under a LayerListScope that left layers unmade.
  virtual bool partial() const = 0;
  /// Wraps every layer in a Block with `options`, its flat groups formed by `grouping`, in
  /// place (collective over the dp group). Once.
  virtual void shard(const BlockOptions& options, const ShardGrouping& grouping) = 0;
  /// The Blocks, in order, after shard(); empty before.
  virtual std::vector<ShardedModule*> blocks() = 0;
};

template <class M>
class LayerListImpl : public LayerListBase {
 public:
  /// One layer, called like the layer itself; through its Block once sharded.
  class Layer {
   public:
    template <class... Args>
    auto operator()(Args&&... args) {
      ZTRAIN_CHECK(list_->holds(index_), "LayerList: layer ", index_, " is not held here (another pipeline stage "
                   "holds it)");
      if (list_->blocks_.empty()) return list_->layers_[index_](std::forward<Args>(args)...);
      return list_->blocks_[index_](std::forward<Args>(args)...);
    }
    /// The user's layer.
    M& module() { return list_->layers_[index_]; }

   private:
    friend class LayerListImpl;
    Layer(LayerListImpl* list, size_t index) : list_(list), index_(index) {}
    LayerListImpl* list_;
    size_t index_;
  };

  LayerListImpl() = default;
  /// `size` layers, layer i made by make(i) — only those the current LayerListScope holds.
  LayerListImpl(size_t size, const std::function<M(size_t)>& make) {
    const auto* scope = LayerListScope::current();
    const auto held = scope ? scope->held(size) : LayerListScope::Ranges{{0, size}};
    bool partial = false;
    for (size_t i = 0; i < size; ++i) {
      if (LayerListScope::contains(held, i)) {
        push_back(make(i));
      } else {
        register_module(std::to_string(i), std::make_shared<torch::nn::Module>("DroppedLayer"));
        layers_.push_back(M(nullptr));
        handles_.push_back(Layer(this, i));
        partial = true;
      }
    }
    partial_ = partial;
  }

  void push_back(M layer) {
    ZTRAIN_CHECK(blocks_.empty(), "LayerList: push_back after shard()");
    ZTRAIN_CHECK(!partial_, "LayerList: push_back to a list made for a pipeline stage (under a LayerListScope)");
    ZTRAIN_CHECK(!layer.is_empty(), "LayerList: layer ", layers_.size(), " is empty");
    register_module(std::to_string(layers_.size()), layer.ptr());
    layers_.push_back(std::move(layer));
    handles_.push_back(Layer(this, handles_.size()));
  }
  size_t size() const override { return layers_.size(); }
  Layer& operator[](size_t i) {
    ZTRAIN_CHECK(i < handles_.size(), "LayerList: index ", i, " out of range for ", handles_.size(), " layers");
    return handles_[i];
  }
  auto begin() { return handles_.begin(); }
  auto end() { return handles_.end(); }

  /// Runs every layer in order on x; each must return one tensor.
  template <class... Extra>
  torch::Tensor forward(torch::Tensor x, const Extra&... extra) {
    for (auto& layer : handles_) x = layer(x, extra...);
    return x;
  }

  void hold(const std::vector<std::pair<size_t, size_t>>& ranges) override {
    ZTRAIN_CHECK(blocks_.empty(), "LayerList: hold() after shard()");
    for (const auto& [first, last] : ranges) {
      ZTRAIN_CHECK(first <= last && last <= layers_.size(), "LayerList: cannot hold layers [", first, ", ", last,
                   ") of ", layers_.size());
      for (size_t i = first; i < last; ++i) {
        ZTRAIN_CHECK(!layers_[i].is_empty(), "LayerList: layer ", i, " cannot be held: it is not here (the list "
                     "was made for other layers under a LayerListScope, or an earlier hold() let go of it); make the "
                     "model in the build() of the plugin that boosts it");
      }
    }
    for (size_t i = 0; i < layers_.size(); ++i) {
      if (LayerListScope::contains(ranges, i) || layers_[i].is_empty()) continue;
      replace_module(std::to_string(i), std::make_shared<torch::nn::Module>("DroppedLayer"));
      layers_[i] = M(nullptr);
    }
  }
  bool holds(size_t i) const override { return i < layers_.size() && !layers_[i].is_empty(); }
  bool partial() const override { return partial_; }

  void shard(const BlockOptions& options, const ShardGrouping& grouping) override {
    ZTRAIN_CHECK(blocks_.empty(), "LayerList: shard() was called already; a layer can be wrapped once");
    std::vector<Block<M>> held, blocks;
    for (auto& layer : layers_) {
      blocks.push_back(layer.is_empty() ? Block<M>(nullptr)
                                        : Block<M>(std::make_shared<BlockImpl<M>>(layer, options, grouping)));
      if (!layer.is_empty()) held.push_back(blocks.back());
    }
    BlockListImpl<M> linked(held);  // sets each Block's prefetch neighbours, in list order
    for (size_t i = 0; i < blocks.size(); ++i) {
      if (!blocks[i].is_empty()) replace_module(std::to_string(i), blocks[i].ptr());
    }
    blocks_ = std::move(blocks);
  }
  std::vector<ShardedModule*> blocks() override {
    std::vector<ShardedModule*> out;
    for (auto& b : blocks_) {
      if (!b.is_empty()) out.push_back(b.get());
    }
    return out;
  }

 private:
  std::vector<M> layers_;
  std::vector<Layer> handles_;
  std::vector<Block<M>> blocks_;
  bool partial_ = false;
};

/// The module holder of LayerListImpl<M>, like TORCH_MODULE: `ztrain::LayerList<Layer> layers;`
/// is an empty list.
template <class M>
class LayerList : public torch::nn::ModuleHolder<LayerListImpl<M>> {
 public:
  using torch::nn::ModuleHolder<LayerListImpl<M>>::ModuleHolder;
  LayerList() : torch::nn::ModuleHolder<LayerListImpl<M>>(std::make_shared<LayerListImpl<M>>()) {}
  /// Calls forward (ModuleHolder's operator() cannot see a template forward).
  template <class... Args>
  auto operator()(Args&&... args) {
    return this->get()->forward(std::forward<Args>(args)...);
  }
};

}  // namespace ztrain
