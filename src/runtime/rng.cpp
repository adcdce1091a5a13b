#include <ztrain/runtime/rng.h>

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Context.h>

#include <mutex>

namespace ztrain::rng {
namespace {
uint64_t splitmix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}
// Domain tags keep the three streams apart even for coordinates that coincide.
constexpr uint64_t kShared = 0x5348415245440000ull;
constexpr uint64_t kDataParallel = 0x4450000000000000ull;
constexpr uint64_t kRank = 0x52414e4b00000000ull;
}  // namespace

uint64_t derive(uint64_t seed, std::initializer_list<uint64_t> parts) {
  uint64_t h = splitmix64(seed);
  for (uint64_t p : parts) h = splitmix64(h ^ splitmix64(p));
  return h;
}

uint64_t shared_seed(uint64_t seed) { return derive(seed, {kShared}); }

uint64_t data_parallel_seed(uint64_t seed, Coord c) {
  return derive(seed, {kDataParallel, static_cast<uint64_t>(c.dp), static_cast<uint64_t>(c.pp)});
}

uint64_t rank_seed(uint64_t seed, Coord c) {
  return derive(seed, {kRank, static_cast<uint64_t>(c.dp), static_cast<uint64_t>(c.pp),
                       static_cast<uint64_t>(c.tp)});
}

std::vector<at::Generator> default_generators(c10::Device device) {
  std::vector<at::Generator> out{at::detail::getDefaultCPUGenerator()};
  if (!device.is_cpu()) out.push_back(at::globalContext().defaultGenerator(device));
  return out;
}

at::Tensor get_state(at::Generator& gen) {
  std::lock_guard<std::mutex> lock(gen.mutex());
  return gen.get_state();
}

void set_state(at::Generator& gen, const at::Tensor& state) {
  std::lock_guard<std::mutex> lock(gen.mutex());
  gen.set_state(state);
}

}  // namespace ztrain::rng
