#include <ztrain/zero/layer_list.h>

namespace ztrain {

namespace {
thread_local const LayerListScope* innermost = nullptr;
}  // namespace

LayerListScope::LayerListScope(std::function<Ranges(size_t)> held) : held_(std::move(held)), outer_(innermost) {
  ZTRAIN_CHECK(held_, "LayerListScope: no rule for the layers to build");
  innermost = this;
}

LayerListScope::~LayerListScope() { innermost = outer_; }

const LayerListScope* LayerListScope::current() { return innermost; }

LayerListScope::Ranges LayerListScope::held(size_t size) const {
  auto ranges = held_(size);
  for (const auto& [first, last] : ranges) {
    ZTRAIN_CHECK(first <= last && last <= size, "LayerListScope: layers [", first, ", ", last, ") of a list of ", size);
  }
  return ranges;
}

}  // namespace ztrain
