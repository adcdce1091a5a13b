#include <ztrain/runtime/tp_rng.h>

#include <ztrain/runtime/init.h>
#include <ztrain/runtime/parallel_context.h>
#include <ztrain/runtime/rng.h>

#include <map>
#include <mutex>
#include <string>

namespace ztrain {
namespace {

struct Tracker {
  std::mutex mutex;
  std::map<std::string, std::vector<at::Tensor>> states;  // by device
};
Tracker& tracker() {
  static Tracker t;
  return t;
}

std::vector<at::Tensor> get_states(std::vector<at::Generator>& gens) {
  std::vector<at::Tensor> out;
  for (auto& g : gens) out.push_back(rng::get_state(g));
  return out;
}

void set_states(std::vector<at::Generator>& gens, const std::vector<at::Tensor>& states) {
  for (size_t i = 0; i < gens.size() && i < states.size(); ++i) rng::set_state(gens[i], states[i]);
}

}  // namespace

namespace rng {

std::vector<at::Tensor> tensor_parallel_states(c10::Device device) {
  if (!is_initialized()) return {};
  auto& t = tracker();
  std::lock_guard<std::mutex> lock(t.mutex);
  auto& states = t.states[device.str()];
  if (states.empty()) {
    // Every default generator of the device cloned and reseeded from this rank's own seed: the
    // stream differs across the tp group (and every other coordinate).
    const auto& ctx = default_context();
    const uint64_t seed = rank_seed(ctx.seed(), ctx.coord());
    uint64_t part = 0;
    for (auto g : default_generators(device)) {
      at::Generator mine;
      {
        std::lock_guard<std::mutex> gen_lock(g.mutex());
        mine = g.clone();
      }
      mine.set_current_seed(derive(seed, {part++}));
      states.push_back(mine.get_state());
    }
  }
  return states;
}

void set_tensor_parallel_states(c10::Device device, std::vector<at::Tensor> states) {
  if (!is_initialized()) return;
  auto& t = tracker();
  std::lock_guard<std::mutex> lock(t.mutex);
  t.states[device.str()] = std::move(states);
}

}  // namespace rng

TensorParallelRng::TensorParallelRng(c10::Device device) : device_(device) {
  auto mine = rng::tensor_parallel_states(device_);
  if (mine.empty()) return;
  generators_ = rng::default_generators(device_);
  saved_ = get_states(generators_);
  set_states(generators_, mine);
}

TensorParallelRng::~TensorParallelRng() {
  if (generators_.empty()) return;
  rng::set_tensor_parallel_states(device_, get_states(generators_));  // where the scope left them
  set_states(generators_, saved_);
}

}  // namespace ztrain
