#include <ztrain/booster/data_parallel.h>

#include <ztrain/error.h>
#include <ztrain/runtime/init.h>

#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function_hook.h>

#include <sstream>
#include <unordered_set>

namespace ztrain {
namespace detail {

/// The gradient buckets of one boosted model: which parameter lands where, which buckets are
/// complete in the running backward, and the reductions in flight.
class GradientBuckets : public std::enable_shared_from_this<GradientBuckets> {
 public:
  struct Slot {
    std::string name;
    torch::Tensor param;
    size_t bucket = 0;
    torch::Tensor view;  // the parameter's gradient inside its bucket
    std::shared_ptr<torch::autograd::Node> accumulator;
    bool ready = false;
  };
  struct Bucket {
    torch::Tensor flat;
    std::vector<size_t> slots;
    size_t pending = 0;  // slots without a gradient yet in the running backward
    Work work;
  };

  GradientBuckets(ParallelContext& context, torch::nn::Module& model, int64_t bucket_bytes);
  /// Hooks the accumulators (after construction: the hooks hold weak references to this).
  void arm();
  void set_sync(bool on) { sync_ = on; }
  /// Zeroes every gradient (keeping them views of the buckets).
  void zero();
  DataParallelStats stats() const { return stats_; }

  /// A parameter's gradient has been accumulated (the hook, on the backward thread).
  void ready(size_t slot);

 private:
  void start(size_t bucket, bool during_backward);
  void finish();  // the end of a backward (a final callback of the autograd engine)
  void adopt(Slot& slot);

  ParallelContext& context_;
  std::vector<Slot> slots_;
  std::vector<Bucket> buckets_;
  size_t next_ = 0;  // the next bucket to start, in order
  bool sync_ = true;
  bool in_backward_ = false;
  DataParallelStats stats_;
};

namespace {

class ReadyHook final : public torch::autograd::FunctionPostHook {
 public:
  ReadyHook(std::weak_ptr<GradientBuckets> buckets, size_t slot) : buckets_(std::move(buckets)), slot_(slot) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list& /*inputs*/) override {
    if (auto b = buckets_.lock()) b->ready(slot_);
    return outputs;
  }

 private:
  std::weak_ptr<GradientBuckets> buckets_;
  size_t slot_;
};

bool same_memory(const torch::Tensor& a, const torch::Tensor& b) {
  return a.defined() && b.defined() && a.data_ptr() == b.data_ptr() && a.sizes() == b.sizes() &&
         a.strides() == b.strides();
}

}  // namespace

GradientBuckets::GradientBuckets(ParallelContext& context, torch::nn::Module& model, int64_t bucket_bytes)
    : context_(context) {
  ZTRAIN_CHECK(bucket_bytes > 0, "DataParallel: bucket_bytes must be positive, got ", bucket_bytes);
  auto& dp = context_.dp();
  const auto device = context_.device();
  // Every rank must hold the same parameters, or the broadcasts and reductions would mismatch.
  std::ostringstream signature;
  std::vector<std::pair<std::string, torch::Tensor>> params;
  std::unordered_set<const void*> seen;
  for (const auto& item : model.named_parameters()) {
    const auto& p = item.value();
    if (!seen.insert(p.unsafeGetTensorImpl()).second) continue;  // one tensor under two names
    ZTRAIN_CHECK(p.device() == device, "DataParallel: parameter '", item.key(), "' is on ", p.device(),
                 ", the context's device is ", device, "; move the model there before boost()");
    signature << item.key() << ' ' << p.scalar_type() << ' ' << p.sizes() << (p.requires_grad() ? "" : " frozen")
              << '\n';
    params.emplace_back(item.key(), p);
  }
  for (const auto& item : model.named_buffers()) {
    signature << "buffer " << item.key() << ' ' << item.value().scalar_type() << ' ' << item.value().sizes() << '\n';
  }
  const auto all = dp.all_gather_bytes(signature.str());
  for (size_t r = 1; r < all.size(); ++r) {
    ZTRAIN_CHECK(all[r] == all[0], "DataParallel: dp ranks 0 and ", r,
                 " hold different models (parameter or buffer names, dtypes or shapes differ).\nrank 0:\n", all[0],
                 "rank ", r, ":\n", all[r]);
  }

  torch::NoGradGuard no_grad;
  // Replicas start equal: rank 0's values, in one broadcast per dtype.
  std::vector<torch::Tensor> state;
  for (auto& [name, p] : params) state.push_back(p);
  for (const auto& item : model.named_buffers()) state.push_back(item.value());
  std::vector<bool> done(state.size(), false);
  for (size_t i = 0; i < state.size(); ++i) {
    if (done[i] || dp.size() == 1) continue;
    std::vector<torch::Tensor> same;
    for (size_t j = i; j < state.size(); ++j) {
      if (!done[j] && state[j].scalar_type() == state[i].scalar_type()) {
        same.push_back(state[j]);
        done[j] = true;
      }
    }
    std::vector<torch::Tensor> flat_parts;
    for (const auto& t : same) flat_parts.push_back(t.reshape(-1));
    auto flat = torch::cat(flat_parts);
    dp.broadcast(flat, 0);
    int64_t offset = 0;
    for (auto& t : same) {
      t.copy_(flat.narrow(0, offset, t.numel()).view(t.sizes()));
      offset += t.numel();
    }
  }

  // Buckets over the trainable parameters, last registered first.
  for (auto it = params.rbegin(); it != params.rend(); ++it) {
    if (!it->second.requires_grad()) continue;
    slots_.push_back(Slot{.name = it->first, .param = it->second});
  }
  std::vector<int64_t> offsets(slots_.size());
  int64_t filled = 0;
  for (size_t s = 0; s < slots_.size(); ++s) {
    const auto& p = slots_[s].param;
    const int64_t bytes = p.numel() * static_cast<int64_t>(p.element_size());
    const bool fresh = buckets_.empty() || (filled > 0 && filled + bytes > bucket_bytes) ||
                       slots_[buckets_.back().slots.front()].param.scalar_type() != p.scalar_type();
    if (fresh) {
      buckets_.emplace_back();
      filled = 0;
    }
    buckets_.back().slots.push_back(s);
    slots_[s].bucket = buckets_.size() - 1;
    offsets[s] = filled / static_cast<int64_t>(p.element_size());
    filled += bytes;
  }
  for (auto& bucket : buckets_) {
    const auto& last = slots_[bucket.slots.back()].param;
    const int64_t numel = offsets[bucket.slots.back()] + last.numel();
    bucket.flat = torch::zeros({numel}, last.options().requires_grad(false));
    for (size_t s : bucket.slots) {
      auto& slot = slots_[s];
      slot.view = bucket.flat.narrow(0, offsets[s], slot.param.numel()).view(slot.param.sizes());
      adopt(slot);
    }
    bucket.pending = bucket.slots.size();
  }
  stats_.buckets = static_cast<int64_t>(buckets_.size());
  if (dp.size() > 1) context_.reduce_stream();  // made now: collective, the same point on every rank
}

void GradientBuckets::arm() {
  for (size_t s = 0; s < slots_.size(); ++s) {
    auto& slot = slots_[s];
    slot.accumulator = torch::autograd::impl::grad_accumulator(slot.param);
    ZTRAIN_INTERNAL_ASSERT(slot.accumulator, "parameter '", slot.name, "' has no gradient accumulator");
    slot.accumulator->add_post_hook(std::make_unique<ReadyHook>(weak_from_this(), s));
  }
}

void GradientBuckets::adopt(Slot& slot) {
  auto& grad = slot.param.mutable_grad();
  if (same_memory(grad, slot.view)) return;
  if (grad.defined()) {
    slot.view.copy_(grad);
  } else {
    slot.view.zero_();
  }
  grad = slot.view;
}

void GradientBuckets::zero() {
  // Also forgets a backward that failed half-way (the engine runs no final callback then).
  for (auto& bucket : buckets_) {
    if (bucket.work.defined()) bucket.work.wait();
    bucket.work = Work();
    bucket.flat.zero_();
    bucket.pending = bucket.slots.size();
  }
  for (auto& slot : slots_) {
    slot.param.mutable_grad() = slot.view;
    slot.ready = false;
  }
  next_ = 0;
  in_backward_ = false;
}

void GradientBuckets::ready(size_t s) {
  auto& slot = slots_[s];
  if (!in_backward_) {
    in_backward_ = true;
    // Runs when this backward has finished, on the thread that started it.
    torch::autograd::Engine::get_default_engine().queue_callback([self = shared_from_this()] { self->finish(); });
  }
  if (slot.ready) return;  // its bucket may be reducing already
  torch::NoGradGuard no_grad;
  adopt(slot);
  slot.ready = true;
  auto& bucket = buckets_[slot.bucket];
  --bucket.pending;
  if (!sync_) return;
  while (next_ < buckets_.size() && buckets_[next_].pending == 0) start(next_++, true);
}

void GradientBuckets::start(size_t b, bool during_backward) {
  auto& bucket = buckets_[b];
  if (context_.dp().size() == 1) return;
  bucket.work = context_.reduce_stream().all_reduce(bucket.flat, ReduceOp::kAvg);
  ++(during_backward ? stats_.reductions_during_backward : stats_.reductions_at_end);
}

void GradientBuckets::finish() {
  in_backward_ = false;
  torch::NoGradGuard no_grad;
  const bool sync = sync_;
  for (auto& bucket : buckets_) {
    // A parameter without a gradient in this backward keeps what it had (accumulated under
    // no_sync) or, when dropped, joins the reduction as zero.
    for (size_t s : bucket.slots) {
      if (!slots_[s].ready) adopt(slots_[s]);
      slots_[s].ready = false;
    }
    bucket.pending = bucket.slots.size();
  }
  if (!sync) return;
  while (next_ < buckets_.size()) start(next_++, false);
  next_ = 0;
  std::exception_ptr error;
  for (auto& bucket : buckets_) {
    if (!bucket.work.defined()) continue;
    try {
      bucket.work.wait();
    } catch (...) {
      if (!error) error = std::current_exception();
    }
    bucket.work = Work();
  }
  if (error) std::rethrow_exception(error);
}

}  // namespace detail

DataParallel::DataParallel(DataParallelOptions options) : options_(options) {}

DataParallel::~DataParallel() = default;

void DataParallel::boost(torch::nn::Module& model, torch::optim::Optimizer& optimizer) {
  ZTRAIN_CHECK(!buckets_, "DataParallel: this plugin has boosted a model already; make one plugin per model");
  // Every trainable parameter the optimizer updates must be the model's: the reductions cover
  // the model's parameters only.
  std::unordered_set<const void*> owned;
  for (const auto& p : model.parameters()) owned.insert(p.unsafeGetTensorImpl());
  for (const auto& group : optimizer.param_groups()) {
    for (const auto& p : group.params()) {
      ZTRAIN_CHECK(owned.count(p.unsafeGetTensorImpl()), "DataParallel: the optimizer updates a tensor of shape ",
                   p.sizes(), " that is not a parameter of the model; build the optimizer over model->parameters()");
    }
  }
  // One device per rank: a model built elsewhere moves to the context's, as modules wrapped by
  // the ZeRO engine do. Module::to keeps the parameter objects, so the optimizer's stay valid;
  // state it already holds would not follow.
  const auto device = default_context().device();
  bool elsewhere = false;
  for (const auto& p : model.parameters()) elsewhere = elsewhere || p.device() != device;
  for (const auto& b : model.buffers()) elsewhere = elsewhere || b.device() != device;
  if (elsewhere) {
    ZTRAIN_CHECK(optimizer.state().empty(), "DataParallel: the model is not on the context's device ", device,
                 " and its optimizer holds state already; boost() before the first step, or move both there first");
    model.to(device);
  }
  buckets_ = std::make_shared<detail::GradientBuckets>(default_context(), model, options_.bucket_bytes);
  buckets_->arm();
}

void DataParallel::set_gradient_sync(bool on) {
  ZTRAIN_CHECK(buckets_, "DataParallel: no_sync before boost()");
  buckets_->set_sync(on);
}

void DataParallel::after_zero_grad() {
  if (buckets_) buckets_->zero();
}

DataParallelStats DataParallel::stats() const { return buckets_ ? buckets_->stats() : DataParallelStats{}; }

}  // namespace ztrain
