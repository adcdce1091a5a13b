#pragma once
/// The fused Adam update's implementations (the SIMD kernels), apart from <ztrain/optim/adam.h>
/// so that code choosing or reporting one needs no libtorch header.

namespace ztrain::optim {

/// The implementations of the fused update. Each gives the same bits as kScalar.
enum class AdamKernel {
  kScalar,  ///< plain C++, the reference
  kAvx2,    ///< AVX2 + FMA + F16C, 8 floats per instruction
  kAvx512,  ///< AVX-512 F/BW/VL, 16 floats per instruction
  /// libtorch's fused kernel (aten::_fused_adamw_ / _fused_adam_): what parameters on a CUDA
  /// device always use; on the CPU only when asked for.
  kTorchFused,
};

/// "scalar", "avx2", "avx512" or "torch_fused".
const char* to_string(AdamKernel kernel);
/// Whether this CPU (and OS) can run `kernel`.
bool adam_kernel_supported(AdamKernel kernel);
/// The fastest kernel this CPU supports.
AdamKernel best_adam_kernel();

}  // namespace ztrain::optim
