#pragma once
/// Fused CPU kernels for a transformer's element-wise hot spots, drop-ins for the libtorch calls
/// they replace: each does in one pass over memory, with AVX2, what libtorch's CPU kernels do in
/// several. The GPT model (models/gpt.h) uses both; any model may.
///
/// GELU with the tanh approximation (GPT-2's "gelu_new"):
///
///   y = 0.5 · x · (1 + tanh(u)) = x · σ(2u),   u = √(2/π) · (x + 0.044715 · x³)
///   dy/dx = σ(2u) + 2x · σ(2u) · (1 − σ(2u)) · √(2/π) · (1 + 3 · 0.044715 · x²)
///
/// The σ form is the same function without the cancellation of 1 + tanh(u) for negative x.
/// Backward saves only x, as libtorch's does.
///
/// Cross-entropy over logits [N, V] with class targets [N], the mean over the targets that are not
/// ignore_index: forward finds each row's log-sum-exp in two passes over the row (which stays in
/// cache) and writes nothing of the row's size; backward writes softmax − one-hot, times the
/// incoming gradient over the count, in one pass. libtorch writes the whole log-softmax in forward,
/// then a zero-filled gradient, a scatter into it, and the log-softmax backward.
///
/// Results agree with libtorch's to a few float ulps, not bit for bit (the exponential is this
/// library's own). float tensors, and for GELU bf16 ones too (computed in float, rounded once to
/// nearest even), on the CPU take the fused path; any other dtype or device, and a backward that
/// builds a graph (create_graph, for double backward), use libtorch's, so the functions are
/// drop-ins everywhere.

#include <torch/torch.h>

namespace ztrain::models {

/// torch::gelu(x, "tanh"), fused where it can be.
torch::Tensor gelu_tanh(const torch::Tensor& x);

/// torch::nn::functional::cross_entropy(logits, targets) for logits [N, V] and targets [N] with
/// the mean reduction, fused where it can be. Targets outside [0, V) other than ignore_index are
/// an error, as in libtorch.
torch::Tensor cross_entropy(const torch::Tensor& logits, const torch::Tensor& targets, int64_t ignore_index = -100);

namespace detail {
/// Whether the fused kernels run their AVX2 code (the default where the CPU has AVX2 and FMA) or
/// the scalar code that CPUs without run; process-wide. The setter is for tests, and asking for
/// AVX2 on a CPU without it is an error.
bool fused_simd();
void set_fused_simd(bool on);
}  // namespace detail

}  // namespace ztrain::models
