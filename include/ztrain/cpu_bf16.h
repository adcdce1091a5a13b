#pragma once
/// bf16 matmuls on CPUs without AVX-512 (src/cpu_bf16_matmul.cpp): libtorch's own kernels there are
/// a scalar loop, so ztrain replaces them, for the whole process, with its fp32 kernels on widened
/// operands and one rounding of the result. ZTRAIN_CPU_BF16_MATMUL chooses: auto (the default:
/// widen where the CPU lacks AVX-512), fp32 (always) or native (never).

#include <cstdint>
#include <optional>

namespace ztrain::detail {

/// Whether bf16 mm, addmm, bmm, baddbmm and the CPU flash attention run through fp32 in this
/// process. Throws ztrain::Error naming a ZTRAIN_CPU_BF16_MATMUL other than the three.
bool cpu_bf16_matmul_through_fp32();

/// Sets the choice for this process (tests, benchmarks); nullopt reads ZTRAIN_CPU_BF16_MATMUL
/// again at the next bf16 matmul.
void set_cpu_bf16_matmul_through_fp32(std::optional<bool> widen);

/// How many operator calls have gone through fp32 in this process.
uint64_t cpu_bf16_widened_calls();

}  // namespace ztrain::detail
