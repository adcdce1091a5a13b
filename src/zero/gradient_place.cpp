#include <ztrain/zero/gradient_place.h>

#include <ztrain/error.h>

#include <mutex>
#include <unordered_map>

namespace ztrain::detail {

namespace {
// Every backward's places, by parameter: sharded modules' backwards may run at once on several
// threads (one per device), each over parameters of its own.
std::mutex g_mutex;
std::unordered_map<const c10::TensorImpl*, GradientPlace> g_places;
}  // namespace

GradientPlace* gradient_place(const torch::Tensor& param) {
  std::lock_guard<std::mutex> lock(g_mutex);
  auto it = g_places.find(param.unsafeGetTensorImpl());
  return it == g_places.end() ? nullptr : &it->second;  // a node's address stays until it is erased
}

void GradientPlaces::add(const torch::Tensor& param, torch::Tensor place) {
  TORCH_INTERNAL_ASSERT(place.sizes() == param.sizes() && place.scalar_type() == param.scalar_type());
  std::lock_guard<std::mutex> lock(g_mutex);
  const auto* key = param.unsafeGetTensorImpl();
  ZTRAIN_CHECK(g_places.emplace(key, GradientPlace{std::move(place)}).second,
               "a parameter of shape ", param.sizes(), " is in two backwards at once; a sharded module's "
               "backward cannot run while another backward over the same module runs");
  params_.push_back(key);
}

bool GradientPlaces::written(const torch::Tensor& param) const {
  std::lock_guard<std::mutex> lock(g_mutex);
  auto it = g_places.find(param.unsafeGetTensorImpl());
  return it != g_places.end() && it->second.written;
}

GradientPlaces::~GradientPlaces() {
  std::lock_guard<std::mutex> lock(g_mutex);
  for (const auto* key : params_) g_places.erase(key);
}

}  // namespace ztrain::detail
