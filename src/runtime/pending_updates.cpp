#include <ztrain/runtime/pending_updates.h>

#include <mutex>
#include <unordered_map>

namespace ztrain {

namespace {
struct Registry {
  std::mutex mutex;
  std::unordered_map<const c10::TensorImpl*, std::shared_future<void>> writes;
};
Registry& registry() {
  static Registry r;
  return r;
}

/// Waits for `done`, then forgets it if it is still the registration of `key`.
void finish(const c10::TensorImpl* key, const std::shared_future<void>& done) {
  done.wait();
  {
    auto& r = registry();
    std::lock_guard<std::mutex> lock(r.mutex);
    auto it = r.writes.find(key);
    if (it != r.writes.end() && it->second.valid() && done.valid() &&
        it->second.wait_for(std::chrono::seconds(0)) == std::future_status::ready) {
      r.writes.erase(it);
    }
  }
  done.get();  // rethrows the writer's error
}
}  // namespace

void mark_pending_update(const torch::Tensor& t, std::shared_future<void> done) {
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  r.writes.insert_or_assign(t.unsafeGetTensorImpl(), std::move(done));
}

bool update_pending(const torch::Tensor& t) {
  if (!t.defined()) return false;
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  auto it = r.writes.find(t.unsafeGetTensorImpl());
  return it != r.writes.end() && it->second.wait_for(std::chrono::seconds(0)) != std::future_status::ready;
}

void wait_for_update(const torch::Tensor& t) {
  if (!t.defined()) return;
  std::shared_future<void> done;
  {
    auto& r = registry();
    std::lock_guard<std::mutex> lock(r.mutex);
    auto it = r.writes.find(t.unsafeGetTensorImpl());
    if (it == r.writes.end()) return;
    done = it->second;
  }
  finish(t.unsafeGetTensorImpl(), done);
}

void wait_for_all_updates() {
  std::vector<std::pair<const c10::TensorImpl*, std::shared_future<void>>> all;
  {
    auto& r = registry();
    std::lock_guard<std::mutex> lock(r.mutex);
    all.assign(r.writes.begin(), r.writes.end());
  }
  for (const auto& [key, done] : all) finish(key, done);
}

}  // namespace ztrain
