// The switch between the fused kernels' AVX2 and scalar code (gelu.cpp, cross_entropy.cpp).

#include <ztrain/error.h>
#include <ztrain/models/fused.h>

#include "simd.h"

#include <atomic>

namespace ztrain::models::detail {

namespace {
std::atomic<bool> g_simd{simd::avx2_supported()};
}  // namespace

bool fused_simd() { return g_simd.load(std::memory_order_relaxed); }

void set_fused_simd(bool on) {
  ZTRAIN_CHECK(!on || simd::avx2_supported(), "the fused kernels' AVX2 code needs a CPU with AVX2 and FMA");
  g_simd.store(on);
}

}  // namespace ztrain::models::detail
