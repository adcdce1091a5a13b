#pragma once
/// Fused CPU kernels for a transformer's hot spots outside its linear layers, drop-ins for the
/// libtorch calls they replace: each does in one pass over memory, with AVX2, what libtorch's CPU
/// kernels do in several. The GPT model (models/gpt.h) uses them all; any model may.
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
/// LayerNorm over the last dimension keeps each row's mean and 1/√(variance + ε) in float for
/// backward and makes each pass in one sweep of the row (which stays in cache); backward adds the
/// weight's and bias's gradients over blocks of rows in float, and the blocks in a fixed order.
/// libtorch's bf16 LayerNorm keeps its statistics in bf16, and its backward took 1.3 ms a call on
/// GPT-2's [512, 768] on a Zen 5 core.
///
/// Dropout draws its masks with a counter-based generator (Philox4x32-10) in one pass that also
/// scales, and keeps only a 64-bit seed for backward, no mask; libtorch's CPU dropout draws each
/// element with bernoulli_ (about 11 ns an element on a Zen core, 14× its multiply) and keeps a
/// mask of the input's size. The seed is one draw from the default CPU generator, so
/// torch::manual_seed, recomputation (which restores that generator) and tensor-parallel trackers
/// (which swap its state) govern it as they govern libtorch's; the masks are not libtorch's.
///
/// GELU, LayerNorm and cross-entropy agree with libtorch's to a few float ulps, not bit for bit
/// (the exponential is this library's own, the sums' order too); a kept element of dropout equals
/// libtorch's bit for bit. float tensors, and for GELU, LayerNorm and dropout bf16 ones too
/// (computed in float, rounded once to nearest even), on the CPU take the fused path; any other
/// dtype or device uses libtorch's, and so does a LayerNorm without weight or bias, and a backward
/// that builds a graph (create_graph, for double backward) of GELU, LayerNorm and cross-entropy, so
/// the functions are drop-ins everywhere.

#include <torch/torch.h>

#include <array>
#include <cstdint>
#include <optional>
#include <string>

namespace ztrain::models {

/// torch::gelu(x, "tanh"), fused where it can be.
torch::Tensor gelu_tanh(const torch::Tensor& x);

/// torch::layer_norm(x, {x.size(-1)}, weight, bias, eps): over the last dimension, with an affine
/// weight and bias of that size, fused where it can be.
torch::Tensor layer_norm(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& bias, double eps);

/// torch::dropout(x, p, train), fused where it can be: zeros each element with probability p and
/// scales the others by 1 / (1 − p) when training; x itself when not, or when p is 0. p outside
/// [0, 1] is an error naming it.
torch::Tensor dropout(const torch::Tensor& x, double p, bool train);

/// at::scaled_dot_product_attention(q, k, v, {}, dropout_p, causal, scale, enable_gqa) for q
/// [b, h, t_q, d] and k, v [b, h_kv, t_k, d] (v's head size may differ; h_kv = h, or with
/// enable_gqa any divisor of h, query head i then attending with key head i / (h / h_kv)), fused
/// where it can be: float tensors on the CPU with a positive finite scale (default 1 / √d),
/// except up to 64 keys without dropout, where libtorch's kernel costs less per call; bf16 and
/// fp16 ones where detail::attention_widened says so, widened for it and the output and the
/// gradients rounded once (bf16 ones, on a CPU with AVX-512 BF16, with the gemms in bf16 and float
/// accumulation: the probabilities and their gradient rounded to bf16 before their products, as
/// in libtorch's bf16 flash attention).
/// It computes softmax(q kᵀ · scale) v a block of 64 queries at a time, with the causal mask (query
/// i sees keys 0 … i) and dropout applied to each block's probabilities in cache, and keeps for
/// backward only each query's log-sum-exp, no [t_q, t_k] matrix; key heads shared by several
/// query heads are read in place, not repeated. The dropout is the fused dropout's mask over the
/// [b, h, t_q, t_k] probabilities under one seed from the default CPU generator: the result equals
/// models::dropout applied to the materialised probabilities under the same generator state.
/// libtorch's CPU attention with dropout is its unfused path, which materialises the probabilities
/// and draws the mask with bernoulli_. The output is a [b, h, t_q, d] view of a [b, t_q, h, d]
/// tensor, so that heads → features is a view, not a copy.
torch::Tensor attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, double dropout_p,
                        bool causal, std::optional<double> scale = std::nullopt, bool enable_gqa = false);

/// attention(q, k, v, dropout_p, causal, scale) of q, k and v packed in one [b, t, 3, h, d] tensor
/// (a linear's [b, t, 3 · h · d] output viewed so; q its [:, :, 0] transposed to [b, h, t, d], k
/// and v the next): the same result, and one gradient of the packed layout, which goes back to
/// the linear as a view, where unbound views' three gradients would be stacked and then copied
/// into that layout.
torch::Tensor packed_attention(const torch::Tensor& qkv, double dropout_p, bool causal,
                               std::optional<double> scale = std::nullopt);

/// torch::nn::functional::cross_entropy(logits, targets) for logits [N, V] and targets [N] with
/// the mean reduction, fused where it can be. Targets outside [0, V) other than ignore_index are
/// an error, as in libtorch. 16-bit logits count as their float widening: the loss is a float, and
/// the gradient that of the widened logits rounded once to their type (for bf16 on the CPU without
/// a float copy of the logits).
torch::Tensor cross_entropy(const torch::Tensor& logits, const torch::Tensor& targets, int64_t ignore_index = -100);

namespace detail {
/// The code the fused kernels run, process-wide: the scalar code any CPU runs, their AVX2 + FMA
/// code, AVX-512 (GELU's float code and attention's row passes; the other kernels run their AVX2
/// code there), AVX-512 with its BF16 dot products, which also run the gemms of bf16 attention's
/// blocks in bf16 with float accumulation (otherwise they run in float on the widened operands),
/// or that with AMX's tiles, which then run those gemms. The default is the widest this CPU has.
/// The setter is for tests and benchmarks; asking for code the CPU cannot run is an error.
enum class Simd { kScalar, kAvx2, kAvx512, kAvx512Bf16, kAmx };
Simd fused_simd();
void set_fused_simd(Simd simd);
/// Whether this CPU runs `simd`.
bool cpu_runs(Simd simd);
/// The codes' names, for benchmarks and the Python module: scalar, avx2, avx512, avx512_bf16, amx.
std::string simd_name(Simd simd);
/// The code of that name; any other is an error naming the five.
Simd simd_named(const std::string& name);

/// Whether attention on CPU tensors of this 16-bit type runs the fused kernel on their widening,
/// in this process: where its matmuls run through fp32 (ztrain/cpu_matmul16.h), and, with
/// ZTRAIN_CPU_MATMUL16 auto, where the first such call times the fused kernel on the widened
/// operands at least 1.1× as fast as libtorch's own kernel in the type, forward and backward
/// (about 40 ms once; on a Zen 4 core bf16 widened is 1.6× as fast at 256 tokens, 1.07× at 2048);
/// never for other dtypes. The setter is for tests and benchmarks; nullopt chooses again at the
/// next call.
bool attention_widened(c10::ScalarType dtype);
void set_attention_widened(std::optional<bool> widen);

/// Whether the fused attention's float gemms call the BLAS gemm libtorch links (sgemm_) directly,
/// where libtorch's libraries export it (PyPI's x86 builds do, from MKL), rather than libtorch's
/// CPU kernel, which adds the work of an operator call to each of a block's small gemms. The
/// setter is for tests and benchmarks: false takes libtorch's kernel; true without an exported
/// sgemm_ is an error.
bool attention_blas();
void set_attention_blas(bool direct);

/// Philox4x32-10 on one counter under one key, as dropout's masks use it (dropout.cpp).
std::array<uint32_t, 4> philox4x32_10(std::array<uint32_t, 4> counter, std::array<uint32_t, 2> key);

/// One draw from the default CPU generator, as dropout takes its seed.
uint64_t dropout_seed();

/// The factors dropout under `seed` multiplies elements first … first + n − 1 of a tensor by (0
/// where dropped, 1 / (1 − p) where kept), into out[0, n): the mask of any slice of a tensor
/// without the tensor, as attention draws it for its probabilities row by row.
void dropout_factors(uint64_t seed, double p, int64_t first, int64_t n, float* out);
}  // namespace detail

}  // namespace ztrain::models
