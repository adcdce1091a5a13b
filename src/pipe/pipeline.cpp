#include <ztrain/pipe/pipeline.h>

#include <ztrain/runtime/init.h>

#include <algorithm>
#include <deque>
#include <functional>
#include <limits>

// How it works
//
// forward_backward_step walks this rank's instruction list (schedule.h). A forward receives
// its chunk's inputs (leaves; those sent requiring grad require grad), runs the chunk and keeps
// inputs and outputs until the micro-batch's backward; the last virtual stage's output is the
// loss, whose backward is seeded with 1/m. A backward on another stage runs autograd from the
// outputs that crossed the boundary requiring grad with the gradients received for them, then
// collects the inputs' gradients to send back. Sends are non-blocking; for receives, one
// message per direction is always posted ahead of the instruction that needs it, so a transfer
// overlaps the compute before it. Every message's id is (micro-batch, sending virtual stage),
// checked on arrival. After the list, the sends are waited for and tied gradients summed.

namespace ztrain::pipe {

// ---- partitions --------------------------------------------------------------------------------

std::vector<int64_t> partition_uniform(int64_t n, int parts) {
  ZTRAIN_CHECK(n >= 0, "partition_uniform: the number of blocks must be >= 0, got ", n);
  ZTRAIN_CHECK(parts >= 1, "partition_uniform: parts must be >= 1, got ", parts);
  std::vector<int64_t> bounds{0};
  for (int i = 0; i < parts; ++i) bounds.push_back(bounds.back() + n / parts + (i < n % parts ? 1 : 0));
  return bounds;
}

std::vector<int64_t> partition_balanced(const std::vector<int64_t>& weights, int parts) {
  ZTRAIN_CHECK(parts >= 1, "partition_balanced: parts must be >= 1, got ", parts);
  const auto n = static_cast<int64_t>(weights.size());
  std::vector<int64_t> prefix{0};
  for (auto w : weights) {
    ZTRAIN_CHECK(w >= 0, "partition_balanced: weights must be >= 0, got ", w);
    prefix.push_back(prefix.back() + w);
  }
  // best[k][i]: the smallest largest part over cuts of the first i blocks into k parts.
  constexpr int64_t kInf = std::numeric_limits<int64_t>::max();
  std::vector<std::vector<int64_t>> best(parts + 1, std::vector<int64_t>(n + 1, kInf));
  std::vector<std::vector<int64_t>> cut(parts + 1, std::vector<int64_t>(n + 1, 0));
  best[0][0] = 0;
  for (int k = 1; k <= parts; ++k) {
    for (int64_t i = 0; i <= n; ++i) {
      for (int64_t j = 0; j <= i; ++j) {  // the last part is [j, i); the latest j wins a tie
        if (best[k - 1][j] == kInf) continue;
        const int64_t cost = std::max(best[k - 1][j], prefix[i] - prefix[j]);
        if (cost <= best[k][i]) {
          best[k][i] = cost;
          cut[k][i] = j;
        }
      }
    }
  }
  std::vector<int64_t> bounds(parts + 1, n);
  for (int k = parts; k >= 1; --k) bounds[k - 1] = cut[k][bounds[k]];
  return bounds;
}

std::vector<int64_t> partition_explicit(std::vector<int64_t> bounds, int64_t n, int parts) {
  ZTRAIN_CHECK(static_cast<int64_t>(bounds.size()) == parts + 1, "partition_explicit: ", parts,
               " parts need ", parts + 1, " cut points (from 0 to ", n, "), got ", bounds.size());
  ZTRAIN_CHECK(bounds.front() == 0 && bounds.back() == n, "partition_explicit: the cut points must start at 0 and end "
               "at the number of blocks ", n, ", got ", c10::str(c10::ArrayRef<int64_t>(bounds)));
  ZTRAIN_CHECK(std::is_sorted(bounds.begin(), bounds.end()), "partition_explicit: the cut points must not decrease, got ",
               c10::str(c10::ArrayRef<int64_t>(bounds)));
  return bounds;
}

// ---- Pipeline ----------------------------------------------------------------------------------

Pipeline::Pipeline(std::vector<std::shared_ptr<StageImpl>> chunks, PipelineOptions options)
    : chunks_(std::move(chunks)),
      options_(options),
      context_(context_or_default(options_.context)),
      pp_(context_->pp()),
      stages_(pp_.size()),
      stage_(pp_.rank()),
      boundary_(pp_, context_->device()) {
  ZTRAIN_CHECK(!chunks_.empty(), "Pipeline: this rank holds no model chunk; pass at least one");
  for (size_t c = 0; c < chunks_.size(); ++c) {
    ZTRAIN_CHECK(chunks_[c] != nullptr, "Pipeline: chunk ", c, " is null");
  }
  ZTRAIN_CHECK(options_.schedule == ScheduleKind::kInterleaved1F1B || chunks_.size() == 1, "Pipeline: the ",
               to_string(options_.schedule), " schedule runs one chunk per rank, got ", chunks_.size(),
               "; use the interleaved schedule for several");
  const auto counts = pp_.all_gather_object(static_cast<int64_t>(chunks_.size()));
  for (size_t r = 0; r < counts.size(); ++r) {
    ZTRAIN_CHECK(counts[r] == counts[0], "Pipeline: pipeline ranks 0 and ", r, " hold ", counts[0], " and ", counts[r],
                 " chunks; every stage must hold the same number");
  }
}

std::vector<torch::Tensor> Pipeline::parameters() const {
  std::vector<torch::Tensor> out;
  for (const auto& c : chunks_) {
    for (auto& p : c->parameters()) out.push_back(p);
  }
  return out;
}

std::vector<Instruction> Pipeline::schedule(int micro_batches) const {
  return make_schedule(options_.schedule, {.stages = stages_,
                                           .stage = stage_,
                                           .micro_batches = micro_batches,
                                           .chunks = static_cast<int>(chunks_.size())});
}

void Pipeline::tie(const std::string& name, std::vector<torch::Tensor> local) {
  const bool owner = !local.empty();
  int64_t numel = -1;
  for (const auto& t : local) {
    ZTRAIN_CHECK(t.defined() && c10::isFloatingType(t.scalar_type()), "Pipeline::tie('", name,
                 "'): tied tensors must be defined floating-point tensors");
    ZTRAIN_CHECK(numel < 0 || t.numel() == numel, "Pipeline::tie('", name, "'): the local copies differ in size (",
                 numel, " and ", t.numel(), " elements)");
    numel = t.numel();
  }
  for (const auto& other : ties_) {
    ZTRAIN_CHECK(other.name != name, "Pipeline::tie: '", name, "' is already tied");
  }
  // Every pipeline rank takes part in the split; the owners form the group.
  auto group = pp_.split(owner ? 0 : 1, stage_, c10::str("pipe.tie.", name));
  if (owner) {
    const auto sizes = group->all_gather_object(numel);
    for (size_t r = 0; r < sizes.size(); ++r) {
      ZTRAIN_CHECK(sizes[r] == numel, "Pipeline::tie('", name, "'): the copy on one owning stage has ", sizes[r],
                   " elements, on another ", numel, "; wrap each copy alone, at the same ZeRO level, on every stage");
    }
    // Same initial value: the lowest owning stage's first copy.
    torch::NoGradGuard no_grad;
    auto value = local[0].detach().clone();
    group->broadcast(value, 0);
    for (auto& t : local) t.copy_(value.view_as(t));
    const int copies = static_cast<int>(group->all_reduce_scalar(static_cast<int64_t>(local.size())));
    for (const auto& t : local) record_of_chunk_parameter(t, name).tied_copies = copies;
  }
  ties_.push_back({name, std::move(local), std::move(group)});
}

ParameterRecord& Pipeline::record_of_chunk_parameter(const torch::Tensor& t, const std::string& tie) {
  for (const auto& chunk : chunks_) {
    for (const auto& module : chunk->modules()) {
      auto* owner = dynamic_cast<ParameterRecords*>(module.get());
      if (!owner) continue;
      for (const auto& p : module->named_parameters(/*recurse=*/false)) {
        if (p.value().is_same(t)) return owner->record(p.key());
      }
    }
  }
  throw Error(c10::str("Pipeline::tie('", tie, "'): a tied tensor is not a parameter of this rank's chunks that its "
                       "module keeps a record of; tie the parameters of Blocks or DistributedParameters (their shards)"));
}

void Pipeline::reduce_tied_gradients() {
  torch::NoGradGuard no_grad;
  for (auto& tie : ties_) {
    if (tie.local.empty()) continue;
    if (tie.local.size() == 1 && tie.group->size() == 1) continue;
    auto sum = torch::zeros_like(tie.local[0]);
    for (const auto& t : tie.local) {
      if (t.grad().defined()) sum.add_(t.grad());
    }
    tie.group->all_reduce(sum, ReduceOp::kSum);
    for (auto& t : tie.local) {
      if (t.grad().defined()) {
        t.mutable_grad().copy_(sum);
      } else {
        t.mutable_grad() = sum.clone();
      }
    }
  }
}

void Pipeline::check_micro_batches(int m, const char* what) {
  ZTRAIN_CHECK(m >= 1, "Pipeline::", what, ": needs at least one micro-batch");
  const auto all_m = pp_.all_gather_object(static_cast<int64_t>(m));
  for (size_t r = 0; r < all_m.size(); ++r) {
    ZTRAIN_CHECK(all_m[r] == m, "Pipeline::", what, ": pipeline rank ", r, " passed ", all_m[r],
                 " micro-batches and rank ", stage_, " ", m, "; every stage must run the same number");
  }
}

torch::Tensor Pipeline::mean_loss(const std::vector<torch::Tensor>& losses) {
  torch::Tensor loss;
  const bool holds_loss = virtual_stage_of(static_cast<int>(chunks_.size()) - 1) == virtual_stages() - 1;
  if (holds_loss) loss = torch::stack(losses).to(torch::kFloat64).mean().to(losses[0].scalar_type());
  if (options_.broadcast_loss) {
    auto buffer = holds_loss ? loss.to(torch::kFloat64).reshape({1}).contiguous() : torch::zeros({1}, torch::dtype(torch::kFloat64).device(context_->device()));
    pp_.broadcast(buffer, stages_ - 1);
    loss = buffer.reshape({}).to(torch::kFloat32);
    if (holds_loss) loss = loss.to(losses[0].scalar_type());
  }
  return loss;
}

torch::Tensor Pipeline::evaluate(const std::vector<TensorList>& micro_batches) {
  const int m = static_cast<int>(micro_batches.size());
  check_micro_batches(m, "evaluate");
  torch::NoGradGuard no_grad;
  const int last_virtual = virtual_stages() - 1;
  auto id_of = [&](int mb, int vs) { return static_cast<int64_t>(mb) * virtual_stages() + vs; };
  std::vector<torch::Tensor> losses(m);
  // Micro-batch by micro-batch, chunk by chunk: what (mb, c) waits for was sent at an earlier
  // (mb, c') on this or the previous rank, and sends do not block, so no rank waits on a later
  // step of another.
  for (int mb = 0; mb < m; ++mb) {
    for (int c = 0; c < static_cast<int>(chunks_.size()); ++c) {
      const int vs = virtual_stage_of(c);
      TensorList inputs;
      if (vs > 0) inputs = boundary_.recv_forward(id_of(mb, vs - 1)).wait().tensors;
      auto out = chunks_[c]->forward(inputs, micro_batches[mb]);
      if (vs == last_virtual) {
        ZTRAIN_CHECK(out.size() == 1 && out[0].defined() && out[0].numel() == 1,
                     "Pipeline: the last stage must return {loss}, one scalar; got ", out.size(), " tensors");
        losses[mb] = out[0].clone();  // not a view keeping its base alive (see forward_backward_step)
      } else {
        boundary_.send_forward(out, id_of(mb, vs));
      }
    }
  }
  boundary_.synchronize();
  return mean_loss(losses);
}

torch::Tensor Pipeline::forward_backward_step(const std::vector<TensorList>& micro_batches, double loss_scale) {
  const int m = static_cast<int>(micro_batches.size());
  check_micro_batches(m, "forward_backward_step");
  const auto list = schedule(m);
  const int v = static_cast<int>(chunks_.size());
  const int last_virtual = virtual_stages() - 1;
  auto id_of = [&](int mb, int vs) { return static_cast<int64_t>(mb) * virtual_stages() + vs; };

  // Per (chunk, micro-batch): what forward received and produced, what backward received.
  auto slot = [&](int chunk, int mb) { return static_cast<size_t>(chunk) * m + mb; };
  std::vector<TensorList> inputs(static_cast<size_t>(v) * m), outputs(inputs.size()), grads(inputs.size());
  std::vector<TensorList> input_grads(inputs.size());
  std::vector<torch::Tensor> losses(m);

  // Receives, posted one ahead per direction: take() waits for the instruction's message and
  // posts the next one.
  struct Inbox {
    std::deque<Instruction> upcoming;
    std::function<PendingMessage(const Instruction&)> post;
    PendingMessage next;
    void post_next() {
      if (!upcoming.empty()) next = post(upcoming.front());
    }
    TensorList take(const Instruction& ins) {
      ZTRAIN_INTERNAL_ASSERT(!upcoming.empty() && upcoming.front() == ins);
      auto tensors = next.wait().tensors;
      upcoming.pop_front();
      post_next();
      return tensors;
    }
  };
  Inbox forward{{}, [&](const Instruction& i) {
                  return boundary_.recv_forward(id_of(i.micro_batch, virtual_stage_of(i.chunk) - 1));
                }};
  Inbox backward{{}, [&](const Instruction& i) {
                   return boundary_.recv_backward(id_of(i.micro_batch, virtual_stage_of(i.chunk) + 1));
                 }};
  for (const auto& ins : list) {
    if (ins.op == Op::kRecvForward) forward.upcoming.push_back(ins);
    if (ins.op == Op::kRecvBackward) backward.upcoming.push_back(ins);
  }
  forward.post_next();
  backward.post_next();
  std::vector<int> backwards_left(chunks_.size());  // per model chunk
  for (const auto& ins : list) backwards_left[ins.chunk] += ins.op == Op::kBackward;

  for (const auto& ins : list) {
    const int c = ins.chunk, mb = ins.micro_batch, vs = virtual_stage_of(c);
    const size_t k = slot(c, mb);
    switch (ins.op) {
      case Op::kRecvForward:
        inputs[k] = forward.take(ins);
        break;
      case Op::kForward: {
        auto out = chunks_[c]->forward(inputs[k], micro_batches[mb]);
        if (vs == last_virtual) {
          ZTRAIN_CHECK(out.size() == 1 && out[0].defined() && out[0].numel() == 1 &&
                           c10::isFloatingType(out[0].scalar_type()),
                       "Pipeline: the last stage must return {loss}, one floating-point scalar; got ", out.size(),
                       " tensors");
          // A copy: a scalar loss may share a larger storage (libtorch's mse_loss returns a
          // 0-dim tensor over its per-element buffer), which would stay alive to the step's end.
          losses[mb] = out[0].detach().clone();
        }
        outputs[k] = std::move(out);
        break;
      }
      case Op::kSendForward:
        boundary_.send_forward(outputs[k], id_of(mb, vs));
        break;
      case Op::kRecvBackward:
        grads[k] = backward.take(ins);
        break;
      case Op::kBackward: {
        if (options_.before_backward) options_.before_backward(--backwards_left[ins.chunk] == 0);
        if (vs == last_virtual) {
          if (outputs[k][0].requires_grad()) (outputs[k][0] * (loss_scale / m)).backward();
        } else {
          backward_from(outputs[k], grads[k]);
        }
        input_grads[k] = input_gradients(inputs[k]);
        outputs[k].clear();
        grads[k].clear();
        inputs[k].clear();
        break;
      }
      case Op::kSendBackward:
        boundary_.send_backward(input_grads[k], id_of(mb, vs));
        input_grads[k].clear();
        break;
    }
  }
  boundary_.synchronize();
  reduce_tied_gradients();
  return mean_loss(losses);
}

}  // namespace ztrain::pipe
