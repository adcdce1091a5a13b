#pragma once
// Attributes attached to tensor objects from outside (a tensor-parallel split, the number of
// tied copies): keyed by TensorImpl address, and an entry counts only while its tensor is
// alive, so a new tensor at a reused address does not inherit it. Thread-safe.

#include <torch/torch.h>

#include <mutex>
#include <optional>
#include <unordered_map>

namespace ztrain::detail {

template <class T>
class TensorAttributes {
 public:
  void put(const torch::Tensor& t, T value) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (++puts_ % 256 == 0) {
      std::erase_if(entries_, [](const auto& kv) { return kv.second.impl.expired(); });
    }
    entries_.insert_or_assign(t.unsafeGetTensorImpl(), Entry{WeakImpl(t.getIntrusivePtr()), std::move(value)});
  }

  /// The value put for `t`, if `t` is defined and has one.
  std::optional<T> find(const torch::Tensor& t) const {
    if (!t.defined()) return std::nullopt;
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = entries_.find(t.unsafeGetTensorImpl());
    if (it == entries_.end() || it->second.impl.expired()) return std::nullopt;
    return it->second.value;
  }

 private:
  using WeakImpl = c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>;
  struct Entry {
    WeakImpl impl;
    T value;
  };
  mutable std::mutex mutex_;
  std::unordered_map<const c10::TensorImpl*, Entry> entries_;
  size_t puts_ = 0;
};

}  // namespace ztrain::detail
