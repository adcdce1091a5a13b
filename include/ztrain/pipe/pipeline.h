#pragma once
/// Pipeline parallelism: a model cut into stages across the ranks of the pipeline group, run by
/// a schedule (schedule.h) over the stage boundary protocol (boundary.h).
///
/// The model is a block list with optional layers before it (embedding) and after it (head and
/// loss). Its blocks are cut into p·v contiguous parts — uniformly, balanced by parameter count
/// or at explicit boundaries, uneven counts allowed — one per virtual stage; rank s holds the
/// parts of virtual stages s, p+s, … (v = 1 unless the schedule is interleaved), each as a
/// `Stage`. `StageModule<M>` is the usual stage: the blocks of its part as a BlockList, the
/// layers before the list on virtual stage 0 and the layers after it on the last. The pipeline
/// runs over a parallel context's pp group (PipelineOptions::context, the default context when
/// not set); each stage uses Blocks at any ZeRO level over that context's data-parallel group,
/// one per stage (init_distributed({.pp_size = p}) lays the default context out so).
///
/// `Pipeline::forward_backward_step` runs one step's micro-batches through the schedule:
/// forward, then backward of (loss / m) on the last stage, so gradients are those of the mean
/// loss over the micro-batches (and, through ZeRO's mean over dp, over the data-parallel
/// replicas). It returns that mean loss on the last stage, and on every rank with
/// `broadcast_loss`. Parameters held by several stages (a token embedding tied to the LM head)
/// are declared with `tie`: their copies start equal, their gradients are summed across the
/// owning stages before the step returns, so the optimizer sees the single-process gradient,
/// and their records count the copies (a global gradient norm counts each once).
///
/// Wrap the layers before and after the list in Blocks, not DistributedParameters: a
/// DistributedParameter hands the same gathered tensor to every forward until its backward,
/// so with several micro-batches in flight the second backward through it raises.
///
/// Every rank of the pipeline group constructs its Pipeline and calls forward_backward_step
/// with the same number of micro-batches (collective over the pipeline group, and over each
/// stage's dp group through the Blocks inside). Not thread-safe.
///
///   auto& rt = ztrain::init_distributed({.pp_size = 2});
///   namespace pipe = ztrain::pipe;
///   const int p = rt.topology().pp_size(), s = rt.pp_rank();
///   auto bounds = pipe::partition_uniform(n_layers, p);             // {0, 6, 12} for 12 layers
///   pipe::StageModuleOptions<Layer> ends;
///   if (s == 0) ends.pre = {embed.ptr(), [&](const auto&, const auto& mb) { return pipe::TensorList{embed(mb[0])}; }};
///   if (s == p - 1) ends.post = {head.ptr(), [&](const auto& x, const auto& mb) { return pipe::TensorList{head(x[0], mb[0])}; }};
///   pipe::StageModule<Layer> stage(
///       ztrain::BlockList<Layer>(bounds[s + 1] - bounds[s], [&](int64_t) { return Layer(d); }, {.zero_level = 3}), ends);
///   pipe::Pipeline pipeline({stage.ptr()}, {.schedule = pipe::ScheduleKind::k1F1B});
///   pipeline.tie("wte", s == 0 ? embed->parameters() : s == p - 1 ? head->parameters() : std::vector<torch::Tensor>{});
///   torch::optim::SGD opt(pipeline.parameters(), 0.1);
///   opt.zero_grad();
///   auto loss = pipeline.forward_backward_step(micro_batches);      // defined on the last stage
///   opt.step();
///
/// (embed and head: ztrain::Block<Embed> and ztrain::Block<Head> holding the tied weight alone;
/// tests/pipe/pipeline_test.cpp builds exactly this.)

#include <ztrain/comm/communicator.h>
#include <ztrain/error.h>
#include <ztrain/pipe/boundary.h>
#include <ztrain/pipe/schedule.h>
#include <ztrain/zero/block_list.h>

#include <torch/torch.h>

#include <functional>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

namespace ztrain::pipe {

using TensorList = std::vector<torch::Tensor>;

// ---- partitions --------------------------------------------------------------------------------

/// Cut points of `n` blocks into `parts` contiguous parts: `bounds[i]` … `bounds[i+1]` is part
/// i, bounds[0] = 0 and bounds[parts] = n. Uniform: sizes differ by at most one, the first
/// parts taking the extra blocks (7 blocks in 4 parts: 2 2 2 1).
std::vector<int64_t> partition_uniform(int64_t n, int parts);
/// Balanced: contiguous parts minimising the largest part's total weight (say, parameter
/// count); among equal maxima the earlier parts take more blocks, as in partition_uniform.
/// Weights must be non-negative.
std::vector<int64_t> partition_balanced(const std::vector<int64_t>& weights, int parts);
/// Explicit cut points, validated (parts + 1 non-decreasing values from 0 to n); returned as is.
std::vector<int64_t> partition_explicit(std::vector<int64_t> bounds, int64_t n, int parts);
/// Parameter counts of factory(0) … factory(n−1), building one module at a time.
template <class M>
std::vector<int64_t> parameter_counts(int64_t n, const std::function<M(int64_t)>& factory) {
  std::vector<int64_t> counts;
  for (int64_t i = 0; i < n; ++i) {
    auto module = factory(i);
    int64_t count = 0;
    for (const auto& p : detail::module_impl(module)->parameters()) count += p.numel();
    counts.push_back(count);
  }
  return counts;
}

// ---- stages ------------------------------------------------------------------------------------

/// One model chunk (virtual stage), what the executor runs.
class StageImpl : public torch::nn::Module {
 public:
  /// `inputs`: what the previous virtual stage sent (empty on virtual stage 0). `micro_batch`:
  /// the step's micro-batch (inputs of the embedding, labels of the loss). The last virtual
  /// stage returns {loss}, a scalar; the others the tensors to send on.
  virtual TensorList forward(const TensorList& inputs, const TensorList& micro_batch) = 0;
};

/// The layers before or after the block list, and how to call them.
struct StageEnd {
  /// Registered in the stage (as "pre" or "post"), so its parameters are the stage's.
  std::shared_ptr<torch::nn::Module> module;
  /// pre: micro_batch → the block list's inputs. post: (block list's outputs, micro_batch) →
  /// {loss}.
  std::function<TensorList(const TensorList& hidden, const TensorList& micro_batch)> forward;
  explicit operator bool() const { return static_cast<bool>(forward); }
};

template <class M>
struct StageModuleOptions {
  /// Virtual stage 0 only: the layers before the block list (its `hidden` argument is empty).
  StageEnd pre;
  /// Last virtual stage only: the layers after the block list, ending in the loss.
  StageEnd post;
  /// How one block transforms the tensors flowing through the stage. Not set: the block is
  /// called on the first tensor and the others pass through unchanged (masks, positions).
  std::function<TensorList(Block<M>& block, const TensorList& x)> call_block;
};

/// A stage made of a BlockList's part and optional pre/post layers.
template <class M>
class StageModuleImpl : public StageImpl {
 public:
  StageModuleImpl(BlockList<M> blocks, StageModuleOptions<M> options = {})
      : blocks_(register_module("blocks", std::move(blocks))), options_(std::move(options)) {
    if (options_.pre.module) register_module("pre", options_.pre.module);
    if (options_.post.module) register_module("post", options_.post.module);
    if (!options_.call_block) options_.call_block = default_call;
  }

  TensorList forward(const TensorList& inputs, const TensorList& micro_batch) override {
    TensorList x = options_.pre ? options_.pre.forward({}, micro_batch) : inputs;
    for (auto& block : *blocks_) x = options_.call_block(block, x);
    if (options_.post) x = options_.post.forward(x, micro_batch);
    return x;
  }

  BlockList<M>& blocks() { return blocks_; }
  bool has_pre() const { return static_cast<bool>(options_.pre); }
  bool has_post() const { return static_cast<bool>(options_.post); }

 private:
  static TensorList default_call(Block<M>& block, const TensorList& x) {
    ZTRAIN_CHECK(!x.empty(), "StageModule: a block needs at least one input tensor");
    if constexpr (std::is_same_v<std::decay_t<decltype(block(x[0]))>, torch::Tensor>) {
      TensorList y = x;
      y[0] = block(x[0]);
      return y;
    } else {
      ZTRAIN_CHECK(false, "StageModule: the block's forward does not return one tensor; set "
                          "StageModuleOptions::call_block");
      return x;
    }
  }

  BlockList<M> blocks_;
  StageModuleOptions<M> options_;
};

/// The module holder of StageModuleImpl<M>.
template <class M>
class StageModule : public torch::nn::ModuleHolder<StageModuleImpl<M>> {
 public:
  using torch::nn::ModuleHolder<StageModuleImpl<M>>::ModuleHolder;
  StageModule(BlockList<M> blocks, StageModuleOptions<M> options = {})
      : torch::nn::ModuleHolder<StageModuleImpl<M>>(
            std::make_shared<StageModuleImpl<M>>(std::move(blocks), std::move(options))) {}
};

// ---- the executor ------------------------------------------------------------------------------

struct PipelineOptions {
  ScheduleKind schedule = ScheduleKind::k1F1B;
  /// Return the step's loss on every rank (broadcast from the last stage), not only there.
  bool broadcast_loss = false;
  /// The mesh whose pp group the stages span. Not set: the default context.
  std::shared_ptr<ParallelContext> context;
  /// Called before each backward this rank runs in forward_backward_step, with whether it is
  /// the last of its model chunk in the step (after it, that chunk's gradients are complete
  /// here; with one chunk per rank, the rank's last): what a data-parallel plugin needs to
  /// reduce gradients once per step rather than per micro-batch.
  std::function<void(bool last)> before_backward;
};

class Pipeline {
 public:
  /// This rank's chunks: chunk c is virtual stage c·p + s of p·v (v = chunks.size(), 1 unless
  /// the schedule is interleaved). Collective over the context's pp group; every stage passes
  /// the same number of chunks.
  explicit Pipeline(std::vector<std::shared_ptr<StageImpl>> chunks, PipelineOptions options = {});

  /// Declares tied copies of one parameter: `local` are the tensors the optimizer updates for
  /// it on this rank (a plain parameter, or the shards of a Block / DistributedParameter
  /// holding only it; empty where this stage holds none). Collective over the pipeline group:
  /// every stage calls tie with the same names in the same order. The copies are set to the
  /// lowest owning stage's values now (same initial value), their records count the copies,
  /// and forward_backward_step sums their gradients over all copies. Shards line up only when
  /// each copy is wrapped alone, with the same ZeRO level, on every owning stage (checked).
  void tie(const std::string& name, std::vector<torch::Tensor> local);

  /// Forward and backward of every micro-batch (each a list of tensors, as the stages'
  /// pre/post expect) by the schedule; gradients accumulate into the parameters' .grad, tied
  /// gradients are summed. Returns the mean loss over the micro-batches on the last stage (and
  /// every rank with broadcast_loss), an undefined tensor elsewhere. The backward is that of
  /// the mean loss × `loss_scale` (OptimManager::loss_scale() with a loss scaler, which then
  /// unscales the gradients as after its own backward). Collective.
  torch::Tensor forward_backward_step(const std::vector<TensorList>& micro_batches, double loss_scale = 1.0);
  /// Forward of every micro-batch without gradients (evaluation): each stage runs its
  /// micro-batches in order as soon as their inputs arrive. Returns the mean loss as
  /// forward_backward_step does. Collective.
  torch::Tensor evaluate(const std::vector<TensorList>& micro_batches);

  /// What the optimizer updates: every chunk's parameters.
  std::vector<torch::Tensor> parameters() const;
  const std::vector<std::shared_ptr<StageImpl>>& chunks() const { return chunks_; }
  int stages() const { return stages_; }
  int stage() const { return stage_; }
  /// The instruction list this rank runs for `micro_batches`.
  std::vector<Instruction> schedule(int micro_batches) const;
  /// The virtual stage of chunk c, and whether it is the first or last of the model.
  int virtual_stage_of(int chunk) const { return virtual_stage(stage_, chunk, stages_); }
  int virtual_stages() const { return stages_ * static_cast<int>(chunks_.size()); }

 private:
  struct Tie {
    std::string name;
    std::vector<torch::Tensor> local;
    std::unique_ptr<Communicator> group;  // the pipeline ranks of the owning stages
  };
  void reduce_tied_gradients();
  /// The record its owning module keeps of `t`, a parameter of this rank's chunks.
  ParameterRecord& record_of_chunk_parameter(const torch::Tensor& t, const std::string& tie);
  /// Checks that every stage passed `m` micro-batches.
  void check_micro_batches(int m, const char* what);
  /// The mean of the last stage's per-micro-batch losses, where `losses` are held (and on
  /// every rank with broadcast_loss).
  torch::Tensor mean_loss(const std::vector<torch::Tensor>& losses);

  std::vector<std::shared_ptr<StageImpl>> chunks_;
  PipelineOptions options_;
  std::shared_ptr<ParallelContext> context_;
  Communicator& pp_;
  int stages_ = 1;
  int stage_ = 0;
  Boundary boundary_;
  std::vector<Tie> ties_;
};

}  // namespace ztrain::pipe
