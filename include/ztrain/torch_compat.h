#pragma once
/// What differs between libtorch versions, in one place. ztrain builds against 2.x (tested: 2.11);
/// the allocator interface and the optimizer-state key changed within and before it (1.13 is what
/// the older forms were written against). Each difference is detected from libtorch's own
/// declarations, not from version numbers, so releases work as their headers say.

#include <c10/core/Allocator.h>
#include <torch/optim/optimizer.h>

#include <cstring>
#include <sstream>
#include <string>
#include <type_traits>

namespace ztrain::detail {

template <class A>
constexpr bool kConstAllocate = std::is_same_v<decltype(&A::allocate), c10::DataPtr (A::*)(size_t) const>;

template <class Base, bool = kConstAllocate<Base>>
class AllocatorAdapter;

// libtorch 1.x: allocate is const.
template <class Base>
class AllocatorAdapter<Base, true> : public Base {
 public:
  c10::DataPtr allocate(size_t nbytes) const final { return allocate_bytes(nbytes); }

 protected:
  virtual c10::DataPtr allocate_bytes(size_t nbytes) const = 0;
};

// libtorch 2.x: allocate is not const, and an allocator says how to copy its memory.
template <class Base>
class AllocatorAdapter<Base, false> : public Base {
 public:
  c10::DataPtr allocate(size_t nbytes) final { return allocate_bytes(nbytes); }
  void copy_data(void* dest, const void* src, std::size_t count) const final { std::memcpy(dest, src, count); }

 protected:
  virtual c10::DataPtr allocate_bytes(size_t nbytes) const = 0;
};

/// A c10::Allocator of host memory for any libtorch: derive from it and implement
/// `allocate_bytes` (and, as before, `raw_deleter`).
using HostAllocator = AllocatorAdapter<c10::Allocator>;

/// The key type of torch::optim::Optimizer::state(): the parameter's TensorImpl address printed
/// as a string in libtorch 1.x, the address itself in 2.x.
using OptimizerStateKey =
    typename std::decay_t<decltype(std::declval<torch::optim::Optimizer&>().state())>::key_type;

/// The key of `param`'s entry in an optimizer's state(), as libtorch's own optimizers make it.
template <class Key = OptimizerStateKey>
Key optimizer_state_key(const torch::Tensor& param) {
  if constexpr (std::is_same_v<Key, std::string>) {
    std::ostringstream os;
    os << static_cast<const void*>(param.unsafeGetTensorImpl());
    return os.str();
  } else {
    return param.unsafeGetTensorImpl();
  }
}

}  // namespace ztrain::detail
