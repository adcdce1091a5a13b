#include "gradient_buckets.h"

#include <ztrain/error.h>

#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function_hook.h>

namespace ztrain::detail {

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

GradientBuckets::GradientBuckets(std::vector<BucketPlan> plans, Keep keep, Start start)
    : keep_(keep), start_(std::move(start)) {
  torch::NoGradGuard no_grad;
  for (auto& plan : plans) {
    Bucket bucket;
    for (const auto& m : plan.members) {
      ZTRAIN_INTERNAL_ASSERT(m.offset + m.param.numel() <= plan.numel, "parameter '", m.name, "' overruns its bucket");
      bucket.slots.push_back(slots_.size());
      slots_.push_back(Slot{.name = m.name, .param = m.param, .bucket = buckets_.size(), .offset = m.offset});
    }
    bucket.pending = bucket.slots.size();
    bucket.plan = std::move(plan);
    buckets_.push_back(std::move(bucket));
    if (keep_ == Keep::kBuffers) {
      for (size_t s : buckets_.back().slots) adopt(slots_[s]);
    }
  }
  stats_.buckets = static_cast<int64_t>(buckets_.size());
}

void GradientBuckets::arm() {
  for (size_t s = 0; s < slots_.size(); ++s) {
    auto& slot = slots_[s];
    slot.accumulator = torch::autograd::impl::grad_accumulator(slot.param);
    ZTRAIN_INTERNAL_ASSERT(slot.accumulator, "parameter '", slot.name, "' has no gradient accumulator");
    slot.accumulator->add_post_hook(std::make_unique<ReadyHook>(weak_from_this(), s));
  }
}

torch::Tensor& GradientBuckets::buffer(Bucket& bucket) {
  if (!bucket.flat.defined()) bucket.flat = torch::zeros({bucket.plan.numel}, bucket.plan.options.requires_grad(false));
  return bucket.flat;
}

torch::Tensor GradientBuckets::view(Slot& slot) {
  return buffer(buckets_[slot.bucket]).narrow(0, slot.offset, slot.param.numel()).view(slot.param.sizes());
}

void GradientBuckets::adopt(Slot& slot) {
  auto& grad = slot.param.mutable_grad();
  if (keep_ == Keep::kNothing) {
    if (grad.defined()) view(slot).add_(grad);
    grad = torch::Tensor();
    return;
  }
  auto into = view(slot);
  if (same_memory(grad, into)) return;
  if (grad.defined()) {
    into.copy_(grad);
  } else {
    into.zero_();
  }
  grad = into;
}

void GradientBuckets::zero() {
  // Also forgets a backward that failed half-way (the engine runs no final callback then).
  for (auto& bucket : buckets_) {
    if (bucket.work.defined()) bucket.work.wait();
    bucket.work = Work();
    if (keep_ == Keep::kBuffers) {
      bucket.flat.zero_();
    } else {
      bucket.flat = torch::Tensor();
    }
    bucket.pending = bucket.slots.size();
  }
  for (auto& slot : slots_) {
    slot.param.mutable_grad() = keep_ == Keep::kBuffers ? view(slot) : torch::Tensor();
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
  bucket.work = start_(b, buffer(bucket));
  if (keep_ == Keep::kNothing) bucket.flat = torch::Tensor();  // the reduction holds it while it needs it
  if (bucket.work.defined()) ++(during_backward ? stats_.reductions_during_backward : stats_.reductions_at_end);
}

void GradientBuckets::finish() {
  in_backward_ = false;
  torch::NoGradGuard no_grad;
  for (auto& bucket : buckets_) {
    // A parameter without a gradient in this backward keeps what it had (accumulated under
    // no_sync) or, when dropped, joins the reduction as zero.
    for (size_t s : bucket.slots) {
      if (!slots_[s].ready && (keep_ == Keep::kBuffers || slots_[s].param.grad().defined())) adopt(slots_[s]);
      slots_[s].ready = false;
    }
    bucket.pending = bucket.slots.size();
  }
  if (!sync_) return;
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

}  // namespace ztrain::detail
