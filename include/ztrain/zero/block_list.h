#pragma once
/// BlockList: blocks run in order, with the next block's parameters gathered while the current
/// one computes.
///
/// Call it as one (`list(x, extra...)` runs `x = block(x, extra...)` through every block; the
/// extra arguments — masks, positions — reach every block unchanged), ask for every block's
/// output (`forward_all`), or loop over the blocks yourself. In forward, block i starts the
/// gathers of blocks i+1 … i+prefetch_depth before it computes; in backward, of blocks
/// i−1 … i−prefetch_depth. At level 3 that bounds the gathered blocks to 1 + prefetch_depth, and
/// the last block (with prefetch_depth ≥ 1 and more than one block) keeps its parameters from
/// its forward to its backward, the first to run.
/// Gradient reduce-scatters run on their own stream while backward goes on.
///
/// Blocks are registered as children "0", "1", … so parameter names match a
/// torch::nn::ModuleList of the same modules. A list holding layers `first_index` … of a longer
/// one (a pipeline stage's part) numbers its children from there, so the names are those of
/// the whole model. Construction and every call are collective over the data-parallel group.
///
///   ztrain::BlockList<Layer> layers(12, [](int64_t) { return Layer(256); }, {.zero_level = 3});
///   auto h = layers(x, mask);
///   for (auto& block : *layers) h = block(h, mask);   // the same, block by block

#include <ztrain/error.h>
#include <ztrain/zero/block.h>

#include <functional>
#include <unordered_set>

namespace ztrain {

template <class M>
class BlockListImpl : public torch::nn::Module {
 public:
  /// `n` blocks, block i wrapping `factory(first_index + i)` and named first_index + i, all
  /// with `options`.
  BlockListImpl(int64_t n, const std::function<M(int64_t)>& factory, BlockOptions options = {},
                int64_t first_index = 0)
      : first_index_(first_index) {
    ZTRAIN_CHECK(n >= 0, "BlockList: the number of blocks must be >= 0, got ", n);
    ZTRAIN_CHECK(first_index >= 0, "BlockList: first_index must be >= 0, got ", first_index);
    for (int64_t i = 0; i < n; ++i) add(Block<M>(factory(first_index + i), options));
    link();
  }
  /// Blocks built by the caller (each with its own options).
  explicit BlockListImpl(std::vector<Block<M>> blocks, int64_t first_index = 0) : first_index_(first_index) {
    ZTRAIN_CHECK(first_index >= 0, "BlockList: first_index must be >= 0, got ", first_index);
    for (auto& b : blocks) add(std::move(b));
    link();
  }

  size_t size() const { return blocks_.size(); }
  Block<M>& operator[](size_t i) {
    ZTRAIN_CHECK(i < blocks_.size(), "BlockList: index ", i, " out of range for ", blocks_.size(), " blocks");
    return blocks_[i];
  }
  auto begin() { return blocks_.begin(); }
  auto end() { return blocks_.end(); }

  /// Runs every block in order on x; each block must return one tensor.
  template <class... Extra>
  torch::Tensor forward(torch::Tensor x, const Extra&... extra) {
    for (auto& b : blocks_) x = b->forward(x, extra...);
    return x;
  }

  /// Like forward, returning every block's output (the last is forward's result).
  template <class... Extra>
  std::vector<torch::Tensor> forward_all(torch::Tensor x, const Extra&... extra) {
    std::vector<torch::Tensor> hidden;
    for (auto& b : blocks_) hidden.push_back(x = b->forward(x, extra...));
    return hidden;
  }

 private:
  void add(Block<M> block) {
    ZTRAIN_CHECK(!block.is_empty(), "BlockList: block ", blocks_.size(), " is empty");
    ZTRAIN_CHECK(seen_.insert(block.get()).second, "BlockList: block ", blocks_.size(),
                 " is the same instance as an earlier block; each position needs its own Block");
    register_module(std::to_string(first_index_ + static_cast<int64_t>(blocks_.size())), block.ptr());
    blocks_.push_back(std::move(block));
  }

  void link() {
    const auto n = static_cast<int64_t>(blocks_.size());
    for (int64_t i = 0; i < n; ++i) {
      std::vector<ShardedModule*> ahead, behind;
      const int depth = blocks_[i]->options().prefetch_depth;
      for (int64_t d = 1; d <= depth; ++d) {
        if (i + d < n) ahead.push_back(blocks_[i + d].get());
        if (i - d >= 0) behind.push_back(blocks_[i - d].get());
      }
      blocks_[i]->set_prefetch_neighbours(std::move(ahead), std::move(behind));
    }
  }

  int64_t first_index_ = 0;
  std::vector<Block<M>> blocks_;
  std::unordered_set<const void*> seen_;
};

/// The module holder of BlockListImpl<M>.
template <class M>
class BlockList : public torch::nn::ModuleHolder<BlockListImpl<M>> {
 public:
  using torch::nn::ModuleHolder<BlockListImpl<M>>::ModuleHolder;
  /// Calls forward (ModuleHolder's operator() cannot see a template forward).
  template <class... Args>
  auto operator()(Args&&... args) {
    return this->get()->forward(std::forward<Args>(args)...);
  }
  BlockList(int64_t n, const std::function<M(int64_t)>& factory, BlockOptions options = {}, int64_t first_index = 0)
      : torch::nn::ModuleHolder<BlockListImpl<M>>(std::make_shared<BlockListImpl<M>>(n, factory, options, first_index)) {}
  explicit BlockList(std::vector<Block<M>> blocks, int64_t first_index = 0)
      : torch::nn::ModuleHolder<BlockListImpl<M>>(std::make_shared<BlockListImpl<M>>(std::move(blocks), first_index)) {}
};

}  // namespace ztrain
