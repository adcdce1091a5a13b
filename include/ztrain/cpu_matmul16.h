#pragma once
/// bf16 and fp16 matmuls on CPUs without the units for them, or with slow ones (src/cpu_matmul16.cpp):
/// libtorch's own kernels there are scalar loops or slower than fp32, so ztrain replaces them, for
/// the whole process, with libtorch's fp32 kernels on widened operands and one rounding of the
/// result. ZTRAIN_CPU_MATMUL16 chooses: auto (the default: widen where the CPU lacks the units, and
/// where the first 16-bit matmul finds widening 1.25× as fast or more), fp32 (always) or native (never).

#include <c10/core/ScalarType.h>

#include <cstdint>
#include <functional>
#include <optional>

namespace ztrain::detail {

/// ZTRAIN_CPU_MATMUL16 as set now: auto (also when unset or empty), fp32 or native. Throws
/// ztrain::Error naming any other value.
enum class Matmul16Mode { kAuto, kFp32, kNative };
Matmul16Mode cpu_matmul16_mode();

/// Whether mm (and mm_out), addmm, bmm, baddbmm and the CPU flash attention on operands of this
/// dtype run through fp32 in this process (never for a dtype other than bf16 and fp16). Throws
/// ztrain::Error naming a ZTRAIN_CPU_MATMUL16 other than the three.
bool cpu_matmul_through_fp32(at::ScalarType dtype);

/// Whether `widened` runs at least `margin` times as fast as `native`: one untimed call of each,
/// then each timed `rounds` times, taking turns so that a burst of other load slows both, and the
/// best of each compared (the timed choices of the 16-bit matmuls and of models::attention).
bool widening_pays(const std::function<void()>& native, const std::function<void()>& widened, double margin,
                   int rounds);

/// Sets the choice for both 16-bit types in this process (tests, benchmarks); nullopt reads
/// ZTRAIN_CPU_MATMUL16 again at the next 16-bit matmul.
void set_cpu_matmul_through_fp32(std::optional<bool> widen);

/// How many operator calls have gone through fp32 in this process.
uint64_t cpu_matmul_widened_calls();

}  // namespace ztrain::detail
