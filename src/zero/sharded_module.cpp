#include <ztrain/zero/sharded_module.h>

#include "flat_buffer.h"

#include <ztrain/comm/comm_stream.h>
#include <ztrain/comm/host_shared.h>
#include <ztrain/error.h>
#include <ztrain/optim/param_groups.h>
#include <ztrain/runtime/init.h>
#include <ztrain/runtime/mapped_file.h>
#include <ztrain/runtime/rng.h>
#include <ztrain/runtime/tp_rng.h>
#include <ztrain/zero/gradient_place.h>

#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>

#include <algorithm>
#include <deque>
#include <mutex>
#include <sstream>
#include <unordered_set>
#include <utility>

// How it works
//
// Forward runs the wrapped module inside one custom autograd node (ShardedBackward). The node's
// inputs are the tensor arguments that require grad; its outputs are detached copies of the
// module's outputs with the node as grad_fn. Without recomputation the module runs on detached
// inputs with grad enabled, building an inner graph the node keeps; with it, the module runs
// without grad and the node keeps the inputs and the states of the CPU's and the device's
// generators. When the engine reaches the node, it (re)builds the inner graph and runs a nested
// backward into one flat gradient buffer per group: operators that compute a parameter's gradient
// themselves write it into its place there (gradient_place.h), and the gradients autograd leaves
// on the parameters are copied in after. The buffer is then reduced on the context's reduction
// stream (all-reduce or reduce-scatter as the level's policy says, a mean over dp), which adds the
// result to the shard's .grad; a callback queued on the engine waits for the stream before
// backward() returns, and at most kMaxPendingReductions buffers are in flight. The streams belong
// to the module's ParallelContext, shared by every sharded module on it, so gathers and reductions
// of consecutive blocks queue in order.
//
// Levels 2 and 3 release the full buffers by detaching their StorageImpl from its memory and
// later attaching fresh memory to the same StorageImpl: the parameters and every tensor the
// inner graph saved point at that StorageImpl, so they see the refilled values, and version
// counters are untouched because nothing writes through a tensor.
//
// Where the dp ranks share a host (and host-shared buffers are on), a group whose shard is at least
// kMappedShardMinBytes is laid out in whole pages and its full buffer instead maps the ranks'
// shards end to end (host_shared_view_of_members), for the module's life: the parameters read the
// peers' memory in place, no gather copies anything, and a "gather" is a barrier on the gather
// stream that each rank joins once its optimizer's writes to its shard are done. A rank writes its
// shard again only in its next optimizer step, after the reduce-scatter of that step, which no rank
// completes before every rank's backward through the module is done.

namespace ztrain {
namespace detail {

namespace {
constexpr size_t kMaxPendingReductions = 2;
// Smaller shards are gathered by copying: mapping pads each one to whole pages.
constexpr int64_t kMappedShardMinBytes = int64_t{256} << 10;

/// A tensor over `base`'s storage at `offset` with `shape`, contiguous, without view tracking.
torch::Tensor alias(const torch::Tensor& base, int64_t offset, at::IntArrayRef shape) {
  torch::NoGradGuard no_grad;
  auto t = torch::empty({0}, base.options());
  t.set_(base.storage(), offset, shape, c10::contiguous_strides(shape));
  return t;
}

std::string describe(const std::string& name, c10::ScalarType dtype, at::IntArrayRef shape, bool rg) {
  return c10::str(name, " ", dtype, " ", shape, rg ? "" : " frozen");
}
}  // namespace

/// One forward call awaiting its backward.
struct ShardedCall {
  ShardedModule::Fn fn;
  std::vector<bool> input_requires_grad;
  std::vector<size_t> edge_inputs;  // inputs with an edge out of the node, in edge order
  std::vector<torch::Tensor> inputs;                        // recomputation: detached inputs
  std::vector<torch::Tensor> rng_states;                    // recomputation: generator states
  std::vector<torch::Tensor> inner_inputs, inner_outputs;  // kept graph
  bool backward_done = false;
};

class ShardedBackward : public torch::autograd::Node {
 public:
  // Holds its module strongly, or weakly where the module keeps this node's output itself.
  ShardedBackward(const std::shared_ptr<ShardedModule>& owner, std::shared_ptr<ShardedCall> call)
      : weak_owner_(owner), kind_(owner->kind_), call_(std::move(call)) {
    if (!owner->keeps_its_output()) owner_ = owner;
  }

  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override {
    auto owner = weak_owner_.lock();
    ZTRAIN_CHECK(owner != nullptr, kind_, ": backward after the module was destroyed; keep the model alive until its "
                 "backward has run");
    ZTRAIN_CHECK(!call_->backward_done, kind_,
                 ": backward through the same forward twice; sharded modules free their graph after "
                 "the first backward (retain_graph is not supported)");
    return owner->backward(*call_, grads);
  }
  std::string name() const override { return c10::str("ztrain::", kind_, "Backward"); }

 private:
  std::shared_ptr<ShardedModule> owner_;  // null when held weakly
  std::weak_ptr<ShardedModule> weak_owner_;
  std::string kind_;
  std::shared_ptr<ShardedCall> call_;
};

namespace {
/// Detached copies of `inputs` that require grad where the originals did: the leaves of an
/// inner graph.
std::vector<torch::Tensor> inner_leaves(const std::vector<torch::Tensor>& inputs, const std::vector<bool>& rg) {
  std::vector<torch::Tensor> out;
  out.reserve(inputs.size());
  for (size_t i = 0; i < inputs.size(); ++i) {
    if (!inputs[i].defined()) {
      out.emplace_back();
      continue;
    }
    auto t = inputs[i].detach();
    if (rg[i]) t.requires_grad_(true);
    out.push_back(std::move(t));
  }
  return out;
}

/// The states of `device`'s default generators, then those of the tensor-parallel tracker
/// (runtime/tp_rng.h): everything a forward draws from.
std::vector<torch::Tensor> generator_states(c10::Device device) {
  std::vector<torch::Tensor> out;
  for (auto& gen : rng::default_generators(device)) out.push_back(rng::get_state(gen));
  for (auto& state : rng::tensor_parallel_states(device)) out.push_back(std::move(state));
  return out;
}

/// Sets the generators of `device` and the tracker to `states` (generator_states) for its
/// lifetime.
class GeneratorStateGuard {
 public:
  GeneratorStateGuard(c10::Device device, const std::vector<torch::Tensor>& states)
      : device_(device), gens_(rng::default_generators(device)), saved_(generator_states(device)) {
    set(states);
  }
  ~GeneratorStateGuard() { set(saved_); }

 private:
  void set(const std::vector<torch::Tensor>& states) {
    for (size_t i = 0; i < gens_.size(); ++i) rng::set_state(gens_[i], states[i]);
    if (states.size() > gens_.size()) {
      rng::set_tensor_parallel_states(device_, {states.begin() + static_cast<std::ptrdiff_t>(gens_.size()), states.end()});
    }
  }
  c10::Device device_;
  std::vector<at::Generator> gens_;
  std::vector<torch::Tensor> saved_;
};

/// Group g's flat gradient buffer after a backward: what operators wrote into their places
/// (`places`), plus what autograd left on the parameters (copied, or added where both), and the
/// parameters' gradients undefined again. What no gradient reached (a parameter the forward did
/// not use, the alignment gaps, the padding) is zero.
void finish_gradients(ShardGroup& g, const torch::Tensor& flat, const GradientPlaces& places) {
  torch::NoGradGuard no_grad;
  int64_t end = 0;  // of the last entry: the entries are in offset order
  for (size_t e = 0; e < g.params.size(); ++e) {
    const auto& entry = g.layout.entries()[e];
    if (entry.offset > end) flat.narrow(0, end, entry.offset - end).zero_();
    auto place = flat.narrow(0, entry.offset, entry.numel).view(entry.shape);
    auto& grad = g.params[e].mutable_grad();
    if (places.written(g.params[e])) {
      if (grad.defined()) place.add_(grad);
    } else if (grad.defined()) {
      // A gradient computed in its place (ShardedModule::gradient_buffer_ahead) is there already.
      const bool in_place = grad.data_ptr() == place.data_ptr() && grad.scalar_type() == place.scalar_type() &&
                            grad.sizes() == place.sizes() && grad.strides() == place.strides();
      if (!in_place) place.copy_(grad);
    } else {
      place.zero_();
    }
    grad.reset();
    end = entry.offset + entry.numel;
  }
  if (end < flat.numel()) flat.narrow(0, end, flat.numel() - end).zero_();
}
}  // namespace
}  // namespace detail

// ---- construction ------------------------------------------------------------------------------

ShardedModule::ShardedModule(std::shared_ptr<torch::nn::Module> wrapped, BlockOptions options, std::string kind)
    : ShardedModule(std::move(wrapped), options, std::move(kind), ShardGrouping{}) {}

ShardedModule::ShardedModule(std::shared_ptr<torch::nn::Module> wrapped, BlockOptions options, std::string kind,
                             const ShardGrouping& grouping)
    : wrapped_(std::move(wrapped)), options_(options), kind_(std::move(kind)) {
  ZTRAIN_CHECK(wrapped_ != nullptr, kind_, ": the module to wrap is null");
  policy_ = &level_policy(options_.zero_level, kind_ + ": zero_level");
  ZTRAIN_CHECK(options_.prefetch_depth >= 0, kind_, ": prefetch_depth must be >= 0, got ", options_.prefetch_depth);
  context_ = context_or_default(options_.context);
  auto& dp = context_->dp();
  if (options_.offload_dir) {
    ZTRAIN_CHECK(policy_->shards_parameters, kind_, ": offload_dir keeps parameter shards on disk, which needs "
                 "zero_level 2 or 3 (got ", options_.zero_level, "); for the optimizer state alone use AdamW's state_dir");
    ZTRAIN_CHECK(context_->device().is_cpu(), kind_, ": offload_dir keeps CPU parameter shards on disk; on ",
                 context_->device(), " keep the optimizer state on the host or disk with AdamOffload (state_dir)");
  }

  std::unordered_set<const void*> seen;
  std::ostringstream signature;
  struct Key {
    c10::ScalarType dtype;
    bool requires_grad;
    bool tp_distinct;  // tensor-parallel slices, kept apart from replicated parameters
    bool decays;       // weight decay applies (optim::default_weight_decay), kept apart from the rest
    int unit;          // ShardGrouping::unit
    bool operator==(const Key&) const = default;
  };
  std::vector<Key> keys;  // one per group; a key's groups after its last are closed
  std::vector<int64_t> group_bytes;
  std::vector<std::vector<std::pair<std::string, std::vector<int64_t>>>> members;
  std::vector<std::vector<torch::Tensor>> member_tensors;
  std::vector<std::vector<const ParameterRecord*>> member_records;
  std::vector<std::pair<size_t, size_t>> order;
  const auto decays = optim::default_weight_decay(*wrapped_);
  const auto items = recorded_parameters(*wrapped_);
  for (size_t i = 0; i < items.size(); ++i) {
    const auto& item = items[i];
    const auto& p = item.tensor;
    ZTRAIN_CHECK(p.defined(), kind_, ": parameter '", item.name, "' is undefined");
    ZTRAIN_CHECK(!p.is_meta(), kind_, ": parameter '", item.name, "' is on the meta device and has no values; "
                 "build the module on a real device (its parameters move to the context's device, ",
                 context_->device(), ")");
    ZTRAIN_CHECK(seen.insert(p.unsafeGetTensorImpl()).second, kind_, ": parameter '", item.name,
                 "' is registered twice inside the wrapped module; tie parameters across blocks "
                 "with a DistributedParameter instead");
    ZTRAIN_CHECK(!detail::is_flat_buffer(p), kind_, ": parameter '", item.name,
                 "' already belongs to another Block or DistributedParameter; a module can be wrapped "
                 "only once (build a new module for each block)");
    const int unit = grouping.unit ? grouping.unit(p) : 0;
    signature << detail::describe(item.name, p.scalar_type(), p.sizes(), p.requires_grad())
              << (unit != 0 ? c10::str(" (unit ", unit, ")") : "") << "\n";
    const auto* record = item.record;
    const bool split = record && record->tp_split && record->tp_group && record->tp_group->size() > 1;
    const Key key{p.scalar_type(), p.requires_grad(), split, p.requires_grad() && decays[i], unit};
    const int64_t bytes = p.numel() * static_cast<int64_t>(p.element_size());
    size_t g = keys.size();
    while (g > 0 && !(keys[g - 1] == key)) --g;
    const bool full = g > 0 && grouping.max_group_bytes > 0 && group_bytes[g - 1] > 0 &&
                      group_bytes[g - 1] + bytes > grouping.max_group_bytes;
    g = (g == 0 || full) ? keys.size() : g - 1;
    if (g == keys.size()) {
      keys.push_back(key);
      group_bytes.push_back(0);
      members.emplace_back();
      member_tensors.emplace_back();
      member_records.emplace_back();
    }
    group_bytes[g] += bytes;
    order.emplace_back(g, members[g].size());
    members[g].emplace_back(item.name, p.sizes().vec());
    member_tensors[g].push_back(p);
    member_records[g].push_back(record);
  }

  // Every rank must wrap the same parameters, or the collectives below would mismatch.
  const auto all = dp.all_gather_bytes(signature.str());
  for (size_t r = 1; r < all.size(); ++r) {
    ZTRAIN_CHECK(all[r] == all[0], kind_, ": dp ranks 0 and ", r,
                 " wrap different parameters (names, dtypes, shapes or requires_grad differ).\nrank 0:\n",
                 all[0], "rank ", r, ":\n", all[r]);
  }

  torch::NoGradGuard no_grad;
  const bool shared = context_->host_shared_buffers();
  const auto device = context_->device();
  // With the dp ranks on one host, the full buffers of large groups map the ranks' shards, which
  // then start on whole pages: the ranks agree first, as their layouts must match.
  const bool could_map = policy_->shards_parameters && !options_.offload_dir && shared && dp.size() > 1 &&
                         dp.host_local();
  const bool map_shards = dp.all_reduce_scalar(int64_t{could_map}, ReduceOp::kMin) == 1;
  for (size_t g = 0; g < keys.size(); ++g) {
    const bool map_group = map_shards && group_bytes[g] / dp.size() >= detail::kMappedShardMinBytes;
    const int64_t shard_align = map_group ? host_shared_page_bytes() : FlatParamLayout::kAlignBytes;
    ShardGroup group{.layout = FlatParamLayout(members[g], keys[g].dtype, dp.size(), shard_align),
                     .requires_grad = keys[g].requires_grad,
                     .tp_distinct = keys[g].tp_distinct};
    const auto& layout = group.layout;
    group.full = detail::flat_buffer(layout.total_numel(), keys[g].dtype, device, shared).zero_();
    for (size_t e = 0; e < layout.entries().size(); ++e) {
      const auto& entry = layout.entries()[e];
      group.full.narrow(0, entry.offset, entry.numel).copy_(member_tensors[g][e].detach().reshape(-1));
    }
    dp.broadcast(group.full, 0);
    for (size_t e = 0; e < layout.entries().size(); ++e) {
      const auto& entry = layout.entries()[e];
      const auto* record = member_records[g][e];
      group.splits.push_back(record ? record->tp_split : std::nullopt);
      if (group.tp_distinct) {
        ZTRAIN_CHECK(!group.tp_group || group.tp_group == record->tp_group, kind_, ": parameter '", entry.name,
                     "' is split over another tensor-parallel group than the module's other split parameters");
        group.tp_group = record->tp_group;
      }
      auto& p = member_tensors[g][e];
      p.set_data(detail::alias(group.full, entry.offset, entry.shape));
      group.params.push_back(p);
    }
    const auto [begin, end] = layout.shard_range(dp.rank());
    if (!policy_->shards_optimizer_state) {
      group.shard = detail::alias(group.full, 0, {layout.total_numel()});
    } else if (!policy_->shards_parameters) {
      group.shard = detail::alias(group.full, begin, {end - begin});
    } else {
      group.shard = options_.offload_dir
                        ? detail::mapped_zeros(*options_.offload_dir, {end - begin}, keys[g].dtype, kind_ + ": offload_dir")
                        : detail::flat_buffer(end - begin, keys[g].dtype, device, shared);
      group.shard.copy_(group.full.narrow(0, begin, end - begin));
      detail::write_behind(group.shard);
      if (map_group) {  // collective; undefined on every rank where one cannot map
        if (const auto view = host_shared_view_of_members(dp, group.shard); view.defined()) {
          detail::adopt_storage(group.full, view);
          group.mapped = true;
        }
      }
      if (!group.mapped) detail::free_storage(group.full);
    }
    const auto name = c10::str("zero_shard_", g);
    register_parameter(name, group.shard, group.requires_grad);
    auto& record = this->record(name);
    record.context = context_.get();
    record.dp_sharded = policy_->shards_optimizer_state;
    record.tp_distinct = group.tp_distinct;
    record.tp_group = group.tp_group;
    record.no_weight_decay = !keys[g].decays;
    record.flat = true;
    record.update = std::make_shared<UpdateFence>();
    fences_.push_back(record.update);
    gathered_versions_.push_back(group.shard._version());
    gathering_versions_.push_back(-1);
    groups_.push_back(std::move(group));
  }
  order_ = std::move(order);
  held_grads_.resize(groups_.size());
  ahead_grads_.resize(groups_.size());
  gathered_ = !policy_->shards_parameters;
}

ShardedModule::~ShardedModule() {
  try {
    for (auto& w : gathering_) w.wait();
  } catch (...) {
    // Never throw from a destructor; the failure was or will be reported by its collective.
  }
}

void ShardedModule::train(bool on) {
  torch::nn::Module::train(on);
  wrapped_->train(on);
}

void ShardedModule::set_prefetch_neighbours(std::vector<ShardedModule*> forward, std::vector<ShardedModule*> backward) {
  forward_neighbours_ = std::move(forward);
  backward_neighbours_ = std::move(backward);
}

// ---- gathering ---------------------------------------------------------------------------------

bool ShardedModule::is_gathered() const {
  if (!policy_->gathers()) return true;
  if (!gathered_ || stale_) return false;
  for (size_t g = 0; g < groups_.size(); ++g) {
    if (groups_[g].shard._version() != gathered_versions_[g]) return false;
  }
  return true;
}

bool ShardedModule::maps_shards() const {
  return std::any_of(groups_.begin(), groups_.end(), [](const ShardGroup& g) { return g.mapped; });
}

void ShardedModule::start_gather() {
  ZTRAIN_INTERNAL_ASSERT(gathering_.empty());
  auto& stream = context_->gather_stream();
  const int rank = context_->dp().rank();
  bool mapped = false;  // a group whose full buffer shows the ranks' shards: wait until all are written
  for (size_t g = 0; g < groups_.size(); ++g) {
    auto& group = groups_[g];
    gathering_versions_[g] = group.shard._version();
    if (fence(g).pending()) {
      // An asynchronous optimizer is still writing the shard: wait on the gather stream, so
      // the forward thread goes on until it needs these parameters.
      stream.submit([fence = fences_[g]](Communicator&) { fence->wait(); }, "wait for the optimizer");
      gathering_versions_[g] = -1;  // the version it leaves, known once the gather is waited on
    }
    if (group.mapped) {
      mapped = true;
    } else if (!policy_->shards_parameters) {
      const auto [begin, end] = group.layout.shard_range(rank);
      gathering_.push_back(stream.all_gather(group.full.narrow(0, begin, end - begin), group.full));
    } else {
      detail::allocate_storage(group.full);
      detail::read_ahead(group.shard);  // a shard on disk
      gathering_.push_back(stream.all_gather(group.shard.detach(), group.full));
    }
  }
  // Each rank's barrier comes after its optimizer's writes (waited for above where still pending).
  if (mapped) gathering_.push_back(stream.barrier());
}

void ShardedModule::finish_gather() {
  auto works = std::move(gathering_);
  gathering_.clear();
  for (auto& w : works) w.wait();
  // The version the gather started from; where an asynchronous optimizer was still writing the
  // shard then (the gather stream waited for it), the version it left.
  bool written_since = std::exchange(changed_while_gathering_, false);
  for (size_t g = 0; g < groups_.size(); ++g) {
    const int64_t now = groups_[g].shard._version();
    gathered_versions_[g] = gathering_versions_[g] < 0 ? now : gathering_versions_[g];
    written_since = written_since || gathered_versions_[g] != now;
  }
  gathered_ = true;
  stale_ = false;
  // A shard written after its gather began (an optimizer step after a prefetch that its
  // forward did not use): gather the new values. Every rank sees the same writes.
  if (written_since) {
    start_gather();
    finish_gather();
  }
}

void ShardedModule::shards_changed() {
  stale_ = true;
  changed_while_gathering_ = changed_while_gathering_ || !gathering_.empty();
}

void ShardedModule::prefetch() {
  if (is_gathered() || !gathering_.empty()) return;
  start_gather();
}

void ShardedModule::gather() {
  if (is_gathered() && gathering_.empty()) return;
  if (gathering_.empty()) start_gather();
  finish_gather();
}

void ShardedModule::release() {
  if (!policy_->shards_parameters) return;
  if (!gathering_.empty()) finish_gather();
  for (auto& g : groups_) {
    if (!g.mapped) detail::free_storage(g.full);
  }
  gathered_ = false;
}

void ShardedModule::before(const std::vector<ShardedModule*>& neighbours) {
  const bool need = !is_gathered() || !gathering_.empty();
  if (!need) wait_for_updates();  // a kept full buffer is computed from directly
  if (need && gathering_.empty()) {
    ++gathers_on_demand_;
    start_gather();
  }
  for (auto* n : neighbours) n->prefetch();
  if (need) finish_gather();
}

// ---- forward and backward ----------------------------------------------------------------------

// An output that is (a view of) a gathered buffer release() will free is copied out first. A
// mapped group's buffer is never freed, so what aliases it is returned as it is, as at levels
// 0 and 1: a live view of the parameters, which the next optimizer step changes.
std::vector<torch::Tensor> ShardedModule::own_outputs(std::vector<torch::Tensor> outputs) const {
  for (auto& out : outputs) {
    if (!out.defined() || out.numel() == 0) continue;
    for (const auto& g : groups_) {
      if (!g.mapped && out.storage().unsafeGetStorageImpl() == g.full.storage().unsafeGetStorageImpl()) {
        out = out.clone();
        break;
      }
    }
  }
  return outputs;
}

bool ShardedModule::last_call_pending_backward() const {
  auto call = last_call_.lock();
  return call && !call->backward_done;
}

std::vector<torch::Tensor> ShardedModule::run(const Fn& fn, const std::vector<torch::Tensor>& inputs) {
  bool any_input_grad = false;
  std::vector<bool> input_rg;
  for (const auto& t : inputs) {
    input_rg.push_back(t.defined() && t.requires_grad());
    any_input_grad = any_input_grad || input_rg.back();
  }
  bool any_trainable = false;
  for (const auto& g : groups_) any_trainable = any_trainable || g.requires_grad;
  const bool record = torch::GradMode::is_enabled() && (any_trainable || any_input_grad);

  if (forward_observer_) forward_observer_(*this);
  before(forward_neighbours_);
  if (!record) {
    auto outputs = fn(inputs);
    if (policy_->shards_parameters) {
      outputs = own_outputs(std::move(outputs));
      release();
    }
    return outputs;
  }

  std::shared_ptr<ShardedModule> self;
  try {
    self = std::static_pointer_cast<ShardedModule>(shared_from_this());
  } catch (const std::bad_weak_ptr&) {
    ZTRAIN_CHECK(false, kind_, " must be owned by a std::shared_ptr (construct it through its module holder, "
                               "e.g. ztrain::Block<M>, or std::make_shared) to take part in autograd");
  }
  auto call = std::make_shared<detail::ShardedCall>();
  call->fn = fn;
  call->input_requires_grad = input_rg;
  std::vector<torch::Tensor> outputs;
  if (options_.use_checkpoint) {
    call->rng_states = detail::generator_states(context_->device());
    {
      torch::NoGradGuard no_grad;
      outputs = fn(inputs);
    }
    for (const auto& t : inputs) call->inputs.push_back(t.defined() ? t.detach() : t);
  } else {
    call->inner_inputs = detail::inner_leaves(inputs, input_rg);
    {
      torch::AutoGradMode grad_on(true);
      call->inner_outputs = fn(call->inner_inputs);
    }
    for (const auto& t : call->inner_outputs) outputs.push_back(t.defined() ? t.detach() : t);
  }
  if (policy_->regathers_for_backward) {
    outputs = own_outputs(std::move(outputs));
    // The last module of a prefetch chain (BlockList's last block, FullyShard's last layer run)
    // is the first whose backward runs, right after the loss, with nothing before it to
    // prefetch it: releasing it here would only make that backward wait for a whole gather.
    // It keeps its parameters until its backward, one more module gathered meanwhile.
    if (!(forward_neighbours_.empty() && !backward_neighbours_.empty())) release();
  }

  std::shared_ptr<detail::ShardedBackward> node(new detail::ShardedBackward(self, call), torch::autograd::deleteNode);
  for (size_t i = 0; i < inputs.size(); ++i) {
    if (!input_rg[i]) continue;
    node->add_next_edge(torch::autograd::impl::gradient_edge(inputs[i]));
    call->edge_inputs.push_back(i);
  }
  for (auto& out : outputs) {
    if (out.defined() && torch::autograd::isDifferentiableType(out.scalar_type())) {
      out = out.detach();  // a fresh tensor, never one of the inputs
      torch::autograd::set_history(out, node);
    } else {
      node->add_input_metadata(torch::autograd::Node::undefined_input());
    }
  }
  last_call_ = call;
  return outputs;
}

std::vector<torch::Tensor> ShardedModule::backward(detail::ShardedCall& call, const std::vector<torch::Tensor>& grads) {
  on_backward();
  before(backward_neighbours_);
  std::vector<torch::Tensor> leaves, outputs;
  if (options_.use_checkpoint) {
    leaves = detail::inner_leaves(call.inputs, call.input_requires_grad);
    detail::GeneratorStateGuard same_rng(context_->device(), call.rng_states);
    torch::AutoGradMode grad_on(true);
    outputs = call.fn(leaves);
  } else {
    leaves = std::move(call.inner_inputs);
    outputs = std::move(call.inner_outputs);
  }
  call.backward_done = true;
  call.inputs.clear();
  ZTRAIN_CHECK(outputs.size() == grads.size(), kind_, ": the recomputed forward returned ", outputs.size(),
               " tensors, the original ", grads.size(), "; the wrapped forward must be deterministic in structure");

  std::vector<torch::Tensor> roots, root_grads;
  for (size_t i = 0; i < outputs.size(); ++i) {
    if (grads[i].defined() && outputs[i].defined() && outputs[i].requires_grad()) {
      roots.push_back(outputs[i]);
      root_grads.push_back(grads[i]);
    }
  }
  // Each group's flat gradient buffer exists before the backward, uninitialised, and each
  // parameter's place in it is offered to the operators that compute gradients themselves
  // (gradient_place.h): a linear's weight-gradient gemm writes there directly. The other
  // gradients start undefined, so that autograd hands over each one as the backward made it (or
  // the sum, for a parameter used more than once), to be copied to its place; accumulating into
  // a zeroed buffer instead would cost a pass of zeros and a read-add-write pass.
  // A buffer made ahead (gradient_buffer_ahead) is this backward's where a gradient arriving here
  // was computed in it; another backward of this module may be the one it was made for.
  const auto arrived_in = [&](const torch::Tensor& buffer) {
    return std::any_of(root_grads.begin(), root_grads.end(), [&](const torch::Tensor& g) {
      return g.has_storage() && g.storage().is_alias_of(buffer.storage());
    });
  };
  std::vector<torch::Tensor> targets, flats(groups_.size());
  detail::GradientPlaces places;
  for (size_t g = 0; g < groups_.size(); ++g) {
    auto& group = groups_[g];
    if (!group.requires_grad) continue;
    auto& ahead = ahead_grads_[g];
    flats[g] = ahead.defined() && arrived_in(ahead)
                   ? std::exchange(ahead, torch::Tensor())
                   : detail::flat_buffer(group.layout.total_numel(), group.full.scalar_type(), context_->device(),
                                         context_->host_shared_buffers());
    for (size_t e = 0; e < group.params.size(); ++e) {
      const auto& entry = group.layout.entries()[e];
      auto& p = group.params[e];
      places.add(p, flats[g].narrow(0, entry.offset, entry.numel).view(entry.shape));
      p.mutable_grad().reset();
      targets.push_back(p);
    }
  }
  for (size_t i : call.edge_inputs) targets.push_back(leaves[i]);
  if (!roots.empty()) {
    torch::autograd::backward(roots, root_grads, /*retain_graph=*/false, /*create_graph=*/false, targets);
  }
  bool reduced = false;
  for (size_t g = 0; g < groups_.size(); ++g) {
    if (!groups_[g].requires_grad) continue;
    detail::finish_gradients(groups_[g], flats[g], places);
    reduce_gradient(g, std::move(flats[g]));
    reduced = true;
  }
  // An optimizer may now update the shards without a trace in their version counters
  // (torch::optim writes through .data()), so level 1 refreshes the full buffer next time.
  // Held gradients reach no shard: nothing can step on them.
  if (reduced && gradient_sync_) stale_ = true;
  release();
  // Made ahead and not used, with no backward of this module still to come: let go. (An operator
  // that wrote there keeps it alive; its gradient, arriving later, is copied like any other.)
  if (!last_call_pending_backward()) {
    for (auto& ahead : ahead_grads_) ahead = torch::Tensor();
  }

  std::vector<torch::Tensor> input_grads;
  for (size_t i : call.edge_inputs) input_grads.push_back(leaves[i].grad());
  return input_grads;
}

torch::Tensor ShardedModule::gradient_buffer_ahead(size_t g) {
  ZTRAIN_CHECK(g < groups_.size() && groups_[g].requires_grad, kind_, ": group ", g, " takes no gradient");
  auto& ahead = ahead_grads_[g];
  if (ahead.defined()) return {};  // handed out for the next backward already
  ahead = detail::flat_buffer(groups_[g].layout.total_numel(), groups_[g].full.scalar_type(), context_->device(),
                              context_->host_shared_buffers());
  return ahead;
}

void ShardedModule::reduce_gradient(size_t g, torch::Tensor flat_grad) {
  auto& held = held_grads_[g];
  torch::NoGradGuard no_grad;
  if (!gradient_sync_) {
    if (held.defined()) {
      held.add_(flat_grad);
    } else {
      held = flat_grad;
    }
    return;
  }
  if (held.defined()) {
    flat_grad.add_(held);
    held = torch::Tensor();
  }
  auto& stream = context_->reduce_stream();
  stream.throttle(detail::kMaxPendingReductions - 1);  // a flat gradient per reduction in flight
  const bool all_reduce = policy_->gradient == GradientReduction::kAllReduce;
  auto shard = groups_[g].shard;
  stream.submit(
      [shard, flat_grad, all_reduce, dir = options_.offload_dir, what = kind_ + ": offload_dir"](Communicator& dp) mutable {
        torch::Tensor result = flat_grad;
        if (all_reduce) {
          dp.all_reduce(flat_grad, ReduceOp::kAvg);
        } else {
          // With offload_dir the gradient shard is a file too, unless one exists to add into.
          const int64_t numel = flat_grad.numel() / dp.size();
          result = dir && !shard.grad().defined() ? detail::mapped_zeros(*dir, {numel}, flat_grad.scalar_type(), what)
                                                  : torch::empty({numel}, flat_grad.options());
          dp.reduce_scatter(flat_grad, result, ReduceOp::kAvg);
        }
        flat_grad = torch::Tensor();  // the buffer goes as soon as it is reduced
        torch::NoGradGuard no_grad;
        auto& grad = shard.mutable_grad();
        if (grad.defined()) {
          grad.add_(result);
        } else {
          grad = result;
        }
      },
      all_reduce ? "gradient all_reduce" : "gradient reduce_scatter", flat_grad.device());
  // Backward returns only once every reduction has landed in its shard's .grad.
  torch::autograd::Engine::get_default_engine().queue_callback(
      [context = context_] { context->reduce_stream().synchronize(); });
}

// ---- accounting and names ------------------------------------------------------------------

int64_t ShardedModule::parameter_bytes() const {
  int64_t bytes = 0;
  for (const auto& g : groups_) bytes += (policy_->shards_parameters ? g.shard : g.full).nbytes();
  return bytes;
}

int64_t ShardedModule::gathered_bytes() const {
  if (!policy_->shards_parameters) return 0;
  int64_t bytes = 0;
  for (const auto& g : groups_) bytes += g.mapped ? 0 : g.full.storage().nbytes();
  return bytes;
}

int64_t ShardedModule::gradient_bytes() const {
  int64_t bytes = 0;
  for (const auto& g : groups_) {
    if (g.shard.grad().defined()) bytes += g.shard.grad().nbytes();
  }
  for (const auto& held : held_grads_) {
    if (held.defined()) bytes += held.nbytes();
  }
  return bytes;
}

NoGradientSync::NoGradientSync(torch::nn::Module& module) {
  auto visit = [&](torch::nn::Module& m) {
    if (auto* sharded = dynamic_cast<ShardedModule*>(&m)) {
      switched_.emplace_back(sharded, sharded->gradient_sync());
      sharded->set_gradient_sync(false);
    }
  };
  visit(module);
  for (const auto& child : module.modules(/*include_self=*/false)) visit(*child);
}

NoGradientSync::~NoGradientSync() {
  for (auto [module, was] : switched_) module->set_gradient_sync(was);
}

namespace {
void collect(torch::nn::Module& module, const std::string& prefix, std::vector<NamedParameterRef>& out) {
  if (auto* sharded = dynamic_cast<ShardedModule*>(&module)) {
    for (const auto& [g, e] : sharded->parameter_order()) {
      const auto& group = sharded->groups()[g];
      const auto& entry = group.layout.entries()[e];
      out.push_back({.name = prefix + entry.name, .shape = entry.shape, .dtype = group.layout.dtype(),
                     .owner = sharded, .group = g, .entry = e, .split = group.splits[e],
                     .tp_group = group.splits[e] ? group.tp_group : nullptr});
    }
    return;
  }
  for (const auto& item : module.named_parameters(/*recurse=*/false)) {
    const auto* record = record_of(module, item.key());
    out.push_back({.name = prefix + item.key(), .shape = item.value().sizes().vec(),
                   .dtype = item.value().scalar_type(), .tensor = item.value(),
                   .split = record ? record->tp_split : std::nullopt, .tp_group = record ? record->tp_group : nullptr});
  }
  for (const auto& child : module.named_children()) {
    const size_t first = out.size();
    collect(*child.value(), prefix + child.key() + ".", out);
    const auto* sharded = dynamic_cast<const ShardedModule*>(child.value().get());
    if (sharded && sharded->named_by_key()) {
      ZTRAIN_CHECK(out.size() == first + 1, "a module named by its key '", prefix, child.key(), "' holds ",
                   out.size() - first, " parameters, not one");
      out.back().name = prefix + child.key();
    }
  }
}
}  // namespace

std::optional<TensorSplit> NamedParameterRef::tp_split() const {
  return tp_group && tp_group->size() > 1 ? split : std::nullopt;
}

std::vector<int64_t> NamedParameterRef::full_shape() const {
  const auto s = tp_split();
  return s ? ztrain::full_shape(shape, *s, tp_group->size()) : shape;
}

std::vector<NamedParameterRef> named_parameter_refs(torch::nn::Module& module) {
  std::vector<NamedParameterRef> out;
  collect(module, "", out);
  return out;
}

namespace {
/// This rank's value of `ref` (its module gathered), a copy.
torch::Tensor local_value(const NamedParameterRef& ref) {
  if (!ref.owner) return ref.tensor.detach().clone();
  const auto& group = ref.owner->groups()[ref.group];
  const auto& entry = group.layout.entries()[ref.entry];
  return group.full.narrow(0, entry.offset, entry.numel).view(entry.shape).clone();
}

/// The full tensor of `ref` from the tp group's slices (collective over tp for split ones).
torch::Tensor unsplit(const NamedParameterRef& ref, torch::Tensor local) {
  const auto split = ref.tp_split();
  return split ? assemble(local, *split, *ref.tp_group) : local;
}
}  // namespace

torch::Tensor full_parameter(const NamedParameterRef& ref) {
  if (!ref.owner) return unsplit(ref, local_value(ref));
  ref.owner->wait_for_updates();
  const bool was_gathered = ref.owner->is_gathered();
  ref.owner->gather();
  auto value = local_value(ref);
  if (!was_gathered) ref.owner->release();
  return unsplit(ref, std::move(value));
}

std::vector<std::pair<std::string, torch::Tensor>> gathered_parameters(torch::nn::Module& module) {
  wait_for_updates(module);
  std::vector<std::pair<std::string, torch::Tensor>> out;
  ShardedModule* current = nullptr;  // the sharded module whose parameters are being copied
  bool release_current = false;       // gathered here, so released here
  for (const auto& ref : named_parameter_refs(module)) {
    if (ref.owner && ref.owner != current) {
      if (release_current) current->release();
      current = ref.owner;
      release_current = !current->is_gathered();
      current->gather();
    }
    out.emplace_back(ref.name, unsplit(ref, local_value(ref)));
  }
  if (release_current) current->release();
  return out;
}

void ShardedModule::wait_for_updates() const {
  for (const auto& f : fences_) f->wait();
}

void wait_gradient_reductions(ParallelContext* context) {
  auto& ctx = context ? *context : default_context();
  if (ctx.has_zero_streams()) ctx.reduce_stream().synchronize();
}

}  // namespace ztrain
