#pragma once
// The fused Adam update over one span of elements: scalar reference, AVX2 and AVX-512 kernels.
// Internal to ztrain (used by adam.cpp).

#include <ztrain/optim/adam_kernel.h>

#include <cstdint>

namespace ztrain::optim::detail {

// How weight decay enters the update.
enum class Decay : uint8_t {
  kNone,       // weight_decay == 0
  kDecoupled,  // AdamW: w *= decay before the update
  kCoupled,    // Adam:  g += weight_decay * w
};

// The dtype of the parameter (and of its gradient).
enum class WeightType : uint8_t { kFloat, kBFloat16, kHalf };

// The per-step scalars, computed in double by the caller and rounded to float, as PyTorch does.
struct AdamScalars {
  float beta1 = 0, one_minus_beta1 = 0;
  float beta2 = 0, one_minus_beta2 = 0;
  float bias_correction2_sqrt = 1;  // sqrt(1 - beta2^t)
  float eps = 0;
  float neg_step_size = 0;  // -lr / (1 - beta1^t)
  float decay = 1;          // 1 - lr * weight_decay        (Decay::kDecoupled)
  float weight_decay = 0;   //                              (Decay::kCoupled)
};

// Elements [0, n) of one parameter. For fp32, `weight` is the parameter and `param16` is null;
// for bf16/fp16, `weight` is the fp32 master and `param16` the parameter, written from it.
// `grad` holds n elements of the parameter's dtype.
struct AdamSpan {
  float* weight = nullptr;
  uint16_t* param16 = nullptr;
  const void* grad = nullptr;
  float* exp_avg = nullptr;
  float* exp_avg_sq = nullptr;
  int64_t n = 0;

  // Elements [begin, end) of this span.
  AdamSpan slice(int64_t begin, int64_t end, WeightType type) const;
};

using AdamSpanFn = void (*)(const AdamScalars&, const AdamSpan&);

// The kernel function for one combination. `kernel` must be supported by the CPU.
AdamSpanFn adam_span_fn(AdamKernel kernel, WeightType type, Decay decay);

}  // namespace ztrain::optim::detail
