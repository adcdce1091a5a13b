// bf16 and fp16 matmuls on x86 CPUs without the units for them: through fp32.
//
// libtorch computes bf16 matmuls on the CPU with oneDNN only where the CPU has AVX-512 (BW, VL,
// DQ; oneDNN then uses the BF16/AMX units or emulates them), and fp16 ones only where it has
// AVX512-FP16 or AMX-FP16. Elsewhere — bf16 on every AVX2 CPU, fp16 on nearly every x86 CPU — they
// fall back to scalar loops: 0.7–1.8 GFLOP/s against 30–34 for fp32 on one Zen core, so a bf16
// GPT step took 11× the fp32 one. There these kernels widen the operands to fp32, call libtorch's
// own fp32 kernel and round the result once. That is what the scalar loops compute too (they
// accumulate in fp32); only the order of the sums differs. The widening is O(n²) against the
// matmul's O(n³).
//
// Having the instructions is not enough: an Emerald Rapids core without AMX runs oneDNN's bf16
// gemm on its AVX-512 BF16 unit at 79 GFLOP/s, against 150 for fp32 and 126–140 widened. So where
// libtorch has a kernel of its own for the type, the first 16-bit matmul of the process times both
// ways once (about 30 ms) and widens only when that is clearly faster.
//
// They replace libtorch's CPU kernels of mm (and its out= form), addmm, bmm, baddbmm and the CPU
// flash attention's forward and backward in the dispatcher, for the whole process once ztrain is
// loaded; autograd's formulas call the same operators, so backward is covered too. Other dtypes, and a 16-bit type on
// a CPU where libtorch's own kernel is the faster, go straight to it (`at::cpu::…`).
// ZTRAIN_CPU_MATMUL16=native keeps libtorch's kernels, =fp32 widens on any CPU, =auto (the
// default) widens where the CPU lacks the units or they are the slower way.

#include <ztrain/cpu_matmul16.h>
#include <ztrain/error.h>

#include <ATen/cpu/Utils.h>
#include <ATen/ops/_scaled_dot_product_flash_attention_for_cpu_backward_cpu_dispatch.h>
#include <ATen/ops/_scaled_dot_product_flash_attention_for_cpu_cpu_dispatch.h>
#include <ATen/ops/addmm_cpu_dispatch.h>
#include <ATen/ops/baddbmm_cpu_dispatch.h>
#include <ATen/ops/bmm_cpu_dispatch.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <ATen/ops/mm_cpu_dispatch.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <optional>
#include <string>
#include <tuple>

namespace ztrain::detail {

namespace {

// Whether libtorch has a CPU matmul of its own for this 16-bit type here, not a scalar loop: its
// conditions for its oneDNN gemms on x86 (mkldnn_bf16_device_check, mkldnn_fp16_device_check).
// On other architectures it is taken to have one, and so is timed.
bool has_own_kernel(at::ScalarType dtype) {
  static const auto caps = at::cpu::get_cpu_capabilities();
  const auto flag = [&](const char* name) {
    const auto it = caps.find(name);
    return it != caps.end() && it->second.isBool() && it->second.toBool();
  };
  const auto arch = caps.find("architecture");
  if (arch == caps.end() || !arch->second.isString() || arch->second.toStringRef() != "x86_64") return true;
  if (dtype == at::kBFloat16) return flag("avx512_bw") && flag("avx512_vl") && flag("avx512_dq");
  return flag("avx512_fp16") || flag("amx_fp16");
}

at::Tensor fp32(const at::Tensor& t) { return t.to(at::kFloat); }

// Whether a square matmul in this 16-bit type runs at least 1.25 times as fast widened as in
// libtorch's own kernel, each way at its best of seven. The operands are constants: the random
// generator is left as it was.
bool widening_is_faster(at::ScalarType dtype) {
  constexpr int64_t n = 512;
  const auto a = at::full({n, n}, 0.5, at::TensorOptions().dtype(dtype));
  const auto b = at::full({n, n}, 0.25, at::TensorOptions().dtype(dtype));
  return widening_pays([&] { at::cpu::mm(a, b); }, [&] { at::cpu::mm(fp32(a), fp32(b)).to(dtype); }, 1.25, 7);
}

// Per 16-bit type (0: bf16, 1: fp16): -1 not yet read from ZTRAIN_CPU_MATMUL16, else 0 or 1.
std::atomic<int> widen_16bit[2] = {-1, -1};
std::atomic<uint64_t> widened_calls{0};

}  // namespace

bool widening_pays(const std::function<void()>& native, const std::function<void()>& widened, double margin,
                   int rounds) {
  native();  // oneDNN generates its kernels on the first call
  widened();
  using Clock = std::chrono::steady_clock;
  auto best_native = Clock::duration::max(), best_widened = best_native;
  for (int i = 0; i < rounds; ++i) {
    auto start = Clock::now();
    native();
    best_native = std::min(best_native, Clock::now() - start);
    start = Clock::now();
    widened();
    best_widened = std::min(best_widened, Clock::now() - start);
  }
  return margin * std::chrono::duration<double>(best_widened).count() <
         std::chrono::duration<double>(best_native).count();
}

Matmul16Mode cpu_matmul16_mode() {
  const char* env = std::getenv("ZTRAIN_CPU_MATMUL16");
  const std::string mode = env && *env ? env : "auto";
  if (mode == "auto") return Matmul16Mode::kAuto;
  if (mode == "fp32") return Matmul16Mode::kFp32;
  ZTRAIN_CHECK(mode == "native", "ZTRAIN_CPU_MATMUL16 must be auto, fp32 or native, got '", mode, "'");
  return Matmul16Mode::kNative;
}

bool cpu_matmul_through_fp32(at::ScalarType dtype) {
  if (dtype != at::kBFloat16 && dtype != at::kHalf) return false;
  auto& slot = widen_16bit[dtype == at::kHalf];
  int widen = slot.load(std::memory_order_relaxed);
  if (widen < 0) {
    const auto mode = cpu_matmul16_mode();
    widen = mode == Matmul16Mode::kFp32 ||
            (mode == Matmul16Mode::kAuto && (!has_own_kernel(dtype) || widening_is_faster(dtype)));
    slot.store(widen, std::memory_order_relaxed);
  }
  return widen != 0;
}

void set_cpu_matmul_through_fp32(std::optional<bool> widen) {
  for (auto& slot : widen_16bit) slot.store(widen ? int{*widen} : -1, std::memory_order_relaxed);
}

uint64_t cpu_matmul_widened_calls() { return widened_calls.load(std::memory_order_relaxed); }

namespace {

using at::Tensor;

// Whether a call goes through fp32: every operand of the same 16-bit type, widened for it.
bool widen(std::initializer_list<const Tensor*> operands) {
  const auto dtype = (*operands.begin())->scalar_type();
  for (const auto* t : operands) {
    if (t->scalar_type() != dtype) return false;
  }
  if (!cpu_matmul_through_fp32(dtype)) return false;
  widened_calls.fetch_add(1, std::memory_order_relaxed);
  return true;
}

std::optional<Tensor> fp32(const std::optional<Tensor>& t) {
  if (!t || !at::isReducedFloatingType(t->scalar_type())) return t;
  return fp32(*t);
}

// Widened elements of one operand per chunk (4 MiB of fp32); see widened_matmul.
constexpr int64_t kChunkElements = int64_t{1} << 20;

int64_t ceil_div(int64_t x, int64_t y) { return (x + y - 1) / y; }

// beta · self + alpha · a b (a b alone without self) for 16-bit [m, k] a and [k, n] b, through
// fp32 and rounded once. An operand of more than kChunkElements goes in chunks along the largest
// of m, n and k, so that the widened copies of a chunk are still in cache when the fp32 kernel
// reads them, and a vocabulary projection's weight is never widened whole (154 MB for GPT-2's):
// along n or m each chunk is a slice of the output; along k the chunks' products add up in fp32.
// The result goes to `into` where given (an [m, n] tensor of a's type), else to a new tensor.
Tensor widened_matmul(const std::optional<Tensor>& self, const Tensor& a, const Tensor& b, const at::Scalar& beta,
                      const at::Scalar& alpha, const Tensor* into = nullptr) {
  const int64_t m = a.size(0), k = a.size(1), n = b.size(1), largest = std::max({m, n, k});
  const auto gemm = [&](const Tensor& a32, const Tensor& b32, const std::optional<Tensor>& s) {
    return s ? at::cpu::addmm(fp32(*s), a32, b32, beta, alpha) : at::cpu::mm(a32, b32);
  };
  const auto rounded = [&](const Tensor& result32) {
    return into ? into->copy_(result32) : result32.to(a.scalar_type());
  };
  const int64_t chunks = std::min(largest, ceil_div(std::max({m * k, k * n, m * n}), kChunkElements));
  if (chunks <= 1) return rounded(gemm(fp32(a), fp32(b), self));
  const int64_t step = ceil_div(largest, chunks);
  if (largest == k && k != n && k != m) {
    Tensor sum;
    for (int64_t i = 0; i < k; i += step) {
      const int64_t len = std::min(step, k - i);
      const auto a32 = fp32(a.narrow(1, i, len)), b32 = fp32(b.narrow(0, i, len));
      if (i == 0) {
        sum = gemm(a32, b32, self);
      } else {
        at::cpu::addmm_(sum, a32, b32, 1, alpha);  // alpha is 1 for mm
      }
    }
    return rounded(sum);
  }
  auto out = into ? *into : at::empty({m, n}, a.options());
  const bool columns = largest == n;
  const auto whole = columns ? fp32(a) : fp32(b);
  for (int64_t i = 0; i < largest; i += step) {
    const int64_t len = std::min(step, largest - i);
    // self's slice where it does not broadcast along the split dimension
    auto s = self;
    if (self && columns && self->dim() > 0 && self->size(-1) == n) s = self->narrow(-1, i, len);
    if (self && !columns && self->dim() == 2 && self->size(0) == m) s = self->narrow(0, i, len);
    out.narrow(columns ? 1 : 0, i, len)
        .copy_(columns ? gemm(whole, fp32(b.narrow(1, i, len)), s) : gemm(fp32(a.narrow(0, i, len)), whole, s));
  }
  return out;
}

Tensor mm(const Tensor& a, const Tensor& b) {
  if (!widen({&a, &b})) return at::cpu::mm(a, b);
  return widened_matmul(std::nullopt, a, b, 1, 1);
}

// The out= form, which gradients computed into their place use (zero/gradient_place.h).
Tensor& mm_out(const Tensor& a, const Tensor& b, Tensor& out) {
  if (!widen({&a, &b, &out})) return at::cpu::mm_out(out, a, b);
  TORCH_CHECK(a.dim() == 2 && b.dim() == 2, "mm: expected 2-D operands, got ", a.dim(), "-D and ", b.dim(), "-D");
  TORCH_CHECK(a.size(1) == b.size(0), "mm: mat1 and mat2 shapes cannot be multiplied (", a.size(0), "x", a.size(1),
              " and ", b.size(0), "x", b.size(1), ")");
  if (out.sizes() != at::IntArrayRef{a.size(0), b.size(1)}) out.resize_({a.size(0), b.size(1)});
  widened_matmul(std::nullopt, a, b, 1, 1, &out);
  return out;
}

Tensor bmm(const Tensor& a, const Tensor& b) {
  if (!widen({&a, &b})) return at::cpu::bmm(a, b);
  return at::cpu::bmm(fp32(a), fp32(b)).to(a.scalar_type());
}

Tensor addmm(const Tensor& self, const Tensor& a, const Tensor& b, const at::Scalar& beta, const at::Scalar& alpha) {
  if (!widen({&self, &a, &b})) return at::cpu::addmm(self, a, b, beta, alpha);
  return widened_matmul(self, a, b, beta, alpha);
}

Tensor baddbmm(const Tensor& self, const Tensor& a, const Tensor& b, const at::Scalar& beta,
               const at::Scalar& alpha) {
  if (!widen({&self, &a, &b})) return at::cpu::baddbmm(self, a, b, beta, alpha);
  return at::cpu::baddbmm(fp32(self), fp32(a), fp32(b), beta, alpha).to(a.scalar_type());
}

std::tuple<Tensor, Tensor> flash_attention(const Tensor& q, const Tensor& k, const Tensor& v, double dropout_p,
                                           bool is_causal, const std::optional<Tensor>& attn_mask,
                                           std::optional<double> scale) {
  if (!widen({&q, &k, &v})) {
    return at::cpu::_scaled_dot_product_flash_attention_for_cpu(q, k, v, dropout_p, is_causal, attn_mask, scale);
  }
  auto [out, logsumexp] = at::cpu::_scaled_dot_product_flash_attention_for_cpu(
      fp32(q), fp32(k), fp32(v), dropout_p, is_causal, fp32(attn_mask), scale);
  return {out.to(q.scalar_type()), logsumexp};  // logsumexp is fp32 for 16-bit inputs too
}

std::tuple<Tensor, Tensor, Tensor> flash_attention_backward(const Tensor& grad_out, const Tensor& q,
                                                            const Tensor& k, const Tensor& v, const Tensor& out,
                                                            const Tensor& logsumexp, double dropout_p,
                                                            bool is_causal, const std::optional<Tensor>& attn_mask,
                                                            std::optional<double> scale) {
  if (!widen({&grad_out, &q, &k, &v, &out})) {
    return at::cpu::_scaled_dot_product_flash_attention_for_cpu_backward(grad_out, q, k, v, out, logsumexp,
                                                                         dropout_p, is_causal, attn_mask, scale);
  }
  auto [dq, dk, dv] = at::cpu::_scaled_dot_product_flash_attention_for_cpu_backward(
      fp32(grad_out), fp32(q), fp32(k), fp32(v), fp32(out), logsumexp, dropout_p, is_causal, fp32(attn_mask), scale);
  const auto dtype = q.scalar_type();
  return {dq.to(dtype), dk.to(dtype), dv.to(dtype)};
}

// Replacing a kernel that libtorch registered makes the dispatcher warn once; these replace on
// purpose, so the warning is held back while they register.
struct QuietHandler final : c10::WarningHandler {
  void process(const c10::Warning&) override {}
};

torch::Library register_kernels() {
  QuietHandler quiet;
  c10::WarningUtils::WarningHandlerGuard guard(&quiet);
  torch::Library lib(torch::Library::IMPL, "aten", c10::DispatchKey::CPU, __FILE__, __LINE__);
  lib.impl("mm", TORCH_FN(mm));
  lib.impl("mm.out", TORCH_FN(mm_out));
  lib.impl("bmm", TORCH_FN(bmm));
  lib.impl("addmm", TORCH_FN(addmm));
  lib.impl("baddbmm", TORCH_FN(baddbmm));
  lib.impl("_scaled_dot_product_flash_attention_for_cpu", TORCH_FN(flash_attention));
  lib.impl("_scaled_dot_product_flash_attention_for_cpu_backward", TORCH_FN(flash_attention_backward));
  return lib;
}

// Registered while the library is loaded; unloading it gives libtorch's kernels back.
const auto kernels = register_kernels();

}  // namespace

}  // namespace ztrain::detail
