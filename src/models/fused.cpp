// Which code the fused kernels run: scalar, AVX2, AVX-512, AVX-512 BF16 or AMX (simd.h, bf16_gemm.h).

#include <ztrain/error.h>
#include <ztrain/models/fused.h>

#include "bf16_gemm.h"
#include "simd.h"

#include <algorithm>
#include <array>
#include <atomic>

namespace ztrain::models::detail {

namespace {
Simd widest() {
  if (simd::avx512_supported() && bf16_dot_supported()) return amx_supported() ? Simd::kAmx : Simd::kAvx512Bf16;
  if (simd::avx512_supported()) return Simd::kAvx512;
  return simd::avx2_supported() ? Simd::kAvx2 : Simd::kScalar;
}

std::atomic<Simd> g_simd{widest()};

// Simd's values by name, in order.
const std::array<std::string, 5> kNames{"scalar", "avx2", "avx512", "avx512_bf16", "amx"};
}  // namespace

Simd fused_simd() { return g_simd.load(std::memory_order_relaxed); }

bool cpu_runs(Simd simd) { return simd <= widest(); }

void set_fused_simd(Simd simd) {
  ZTRAIN_CHECK(cpu_runs(simd), "the fused kernels' ",
               simd == Simd::kAmx ? "AMX code needs a CPU with AMX-TILE, AMX-BF16 and AVX-512 BF16, enabled by its OS"
               : simd == Simd::kAvx512Bf16 ? "AVX-512 BF16 code needs a CPU with AVX-512F, BW, VL, DQ and BF16"
               : simd == Simd::kAvx512   ? "AVX-512 code needs a CPU with AVX-512F, AVX-512DQ, AVX2 and FMA"
                                         : "AVX2 code needs a CPU with AVX2 and FMA");
  g_simd.store(simd);
}

std::string simd_name(Simd simd) { return kNames.at(static_cast<size_t>(simd)); }

Simd simd_named(const std::string& name) {
  const auto at = std::find(kNames.begin(), kNames.end(), name);
  ZTRAIN_CHECK(at != kNames.end(), "the fused kernels' code is scalar, avx2, avx512, avx512_bf16 or amx, got '",
               name, "'");
  return static_cast<Simd>(at - kNames.begin());
}

}  // namespace ztrain::models::detail
