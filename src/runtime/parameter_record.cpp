#include <ztrain/runtime/parameter_record.h>

#include <ztrain/error.h>
#include <ztrain/runtime/init.h>


namespace ztrain {

namespace {
int64_t wrap(const TensorSplit& s, int64_t ndim) { return c10::maybe_wrap_dim(s.dim, ndim); }
}  // namespace

// ---- splits ------------------------------------------------------------------------------------

std::vector<int64_t> full_shape(c10::IntArrayRef local, TensorSplit split, int size) {
  auto out = local.vec();
  auto& n = out[wrap(split, static_cast<int64_t>(out.size()))];
  n = n * size - split.padding;
  return out;
}

torch::Tensor slice(const torch::Tensor& unpadded, TensorSplit split, int rank, int size) {
  const int64_t dim = wrap(split, unpadded.dim());
  auto full = unpadded;
  if (split.padding > 0) {
    auto extra = unpadded.sizes().vec();
    extra[dim] = split.padding;
    full = torch::cat({unpadded, torch::zeros(extra, unpadded.options())}, dim);
  }
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

torch::Tensor assemble(const torch::Tensor& local, TensorSplit split, Communicator& group) {
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
  auto padded = local.sizes().vec();
  padded[dim] *= size;
  auto full = moved.reshape(padded);
  return split.padding > 0 ? full.narrow(dim, 0, padded[dim] - split.padding).contiguous() : full;
}

// ---- fences ------------------------------------------------------------------------------------

void UpdateFence::set(std::shared_future<void> done) {
  std::lock_guard<std::mutex> lock(mutex_);
  done_ = std::move(done);
}

bool UpdateFence::pending() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return done_.valid() && done_.wait_for(std::chrono::seconds(0)) != std::future_status::ready;
}

void UpdateFence::wait() const {
  std::shared_future<void> done;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    done = done_;
  }
  if (done.valid()) done.get();  // rethrows the writer's error
}

// ---- records -----------------------------------------------------------------------------------

const ParameterRecord* ParameterRecords::find_record(const std::string& name) const {
  auto it = records_.find(name);
  return it == records_.end() ? nullptr : &it->second;
}

void ParameterRecords::declare_split(const std::string& name, const torch::Tensor& param, TensorSplit split,
                                     Communicator* group) {
  ZTRAIN_CHECK(param.defined(), "declare_split('", name, "'): the tensor is undefined");
  ZTRAIN_CHECK(param.dim() > 0 && split.dim >= -param.dim() && split.dim < param.dim(), "declare_split('", name,
               "'): dimension ", split.dim, " is out of range for a tensor of shape ", param.sizes());
  ZTRAIN_CHECK(split.parts >= 1 && param.size(wrap(split, param.dim())) % split.parts == 0, "declare_split('", name,
               "'): ", split.parts, " parts do not divide dimension ", split.dim, " of shape ", param.sizes());
  const int group_size = group ? group->size() : 1;
  ZTRAIN_CHECK(split.padding >= 0 && (split.padding == 0 || split.parts == 1) &&
                   split.padding < param.size(wrap(split, param.dim())) * group_size,
               "declare_split('", name, "'): padding ", split.padding, " needs parts = 1 and must be shorter than ",
               "the padded dimension (", param.size(wrap(split, param.dim())), " x ", group_size, ")");
  split.dim = wrap(split, param.dim());
  auto& r = record(name);
  r.tp_split = split;
  r.tp_group = group;
  r.tp_distinct = true;
}

const ParameterRecord* record_of(const torch::nn::Module& module, const std::string& name) {
  const auto* owner = dynamic_cast<const ParameterRecords*>(&module);
  return owner ? owner->find_record(name) : nullptr;
}

std::vector<RecordedParameter> recorded_parameters(torch::nn::Module& module) {
  std::vector<RecordedParameter> out;
  for (const auto& m : module.named_modules()) {
    const std::string prefix = m.key().empty() ? "" : m.key() + ".";
    for (const auto& p : m.value()->named_parameters(/*recurse=*/false)) {
      out.push_back({prefix + p.key(), p.value(), record_of(*m.value(), p.key())});
    }
  }
  return out;
}

void wait_for_updates(torch::nn::Module& module) {
  for (const auto& p : recorded_parameters(module)) {
    if (p.record && p.record->update) p.record->update->wait();
  }
}

ParallelContext* context_of(torch::nn::Module& module) {
  ParallelContext* fallback = is_initialized() ? &default_context() : nullptr;
  ParallelContext* found = nullptr;
  std::string first;
  for (const auto& p : recorded_parameters(module)) {
    if (!p.record) continue;
    auto* ctx = p.record->context ? p.record->context : fallback;
    if (!found) {
      found = ctx;
      first = p.name;
    }
    ZTRAIN_CHECK(ctx == found, "the parameters of one model live on different parallel contexts ('", first,
                 "' and '", p.name, "'); train each context's modules as a model of its own");
  }
  return found ? found : fallback;
}

}  // namespace ztrain
