#include <ztrain/runtime/parallel_context.h>

#include <ztrain/runtime/device.h>

namespace ztrain {

namespace {
int size_of(const std::unique_ptr<Communicator>& world) {
  ZTRAIN_CHECK(world != nullptr, "ParallelContext: the world communicator is null");
  return world->size();
}
}  // namespace

// Each split's color numbers the group; its key orders members by their coordinate.
ParallelContext::ParallelContext(std::unique_ptr<Communicator> world, ParallelOptions options)
    : options_(std::move(options)),
      world_(std::move(world)),
      topology_(size_of(world_), options_.tp_size, options_.pp_size) {
  const Coord c = coord();
  const Topology& t = topology_;
  tp_ = world_->split(c.pp * t.dp_size() + c.dp, c.tp, group_name("tp"));
  dp_ = world_->split(c.pp * t.tp_size() + c.tp, c.dp, group_name("dp"));
  pp_ = world_->split(c.dp * t.tp_size() + c.tp, c.pp, group_name("pp"));
  stage_ = world_->split(c.pp, rank(), group_name("stage"));
}

std::shared_ptr<ParallelContext> ParallelContext::create(std::unique_ptr<Communicator> world, ParallelOptions options) {
  options.device = resolve_device(options.device.value_or(c10::Device(c10::kCPU)), "ParallelOptions::device");
  return std::shared_ptr<ParallelContext>(new ParallelContext(std::move(world), std::move(options)));
}

std::shared_ptr<ParallelContext> ParallelContext::split(int color, ParallelOptions options) {
  options.device = resolve_device(options.device.value_or(device()), "ParallelOptions::device");
  auto members = world_->split(color, rank(), options.name);
  return create(std::move(members), std::move(options));
}

ParallelContext::~ParallelContext() {
  // The streams join their workers before the communicators they were duplicated from go.
  gather_.reset();
  reduce_.reset();
  background_.reset();
}

std::string ParallelContext::group_name(const char* group) const {
  return options_.name == "world" ? std::string(group) : options_.name + "." + group;
}

void ParallelContext::set_timeout(std::chrono::milliseconds timeout) {
  for (auto* c : {world_.get(), tp_.get(), dp_.get(), pp_.get(), stage_.get()}) c->set_timeout(timeout);
}

CommStream& ParallelContext::gather_stream() {
  std::lock_guard<std::mutex> lock(lazy_mutex_);
  if (!gather_) {
    gather_ = std::make_unique<CommStream>(*dp_, "zero.gather");
    reduce_ = std::make_unique<CommStream>(*dp_, "zero.reduce");
  }
  return *gather_;
}

bool ParallelContext::has_zero_streams() const {
  std::lock_guard<std::mutex> lock(lazy_mutex_);
  return gather_ != nullptr;
}

CommStream& ParallelContext::reduce_stream() {
  gather_stream();  // both are made together, in one order on every rank
  return *reduce_;
}

ParallelContext& ParallelContext::background_context() {
  std::lock_guard<std::mutex> lock(lazy_mutex_);
  if (!background_) {
    auto options = options_;
    options.name = options_.name + ".save";
    background_ = create(world_->dup(options.name), options);
  }
  return *background_;
}

}  // namespace ztrain
