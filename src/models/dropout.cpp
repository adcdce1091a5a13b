#include <ztrain/error.h>
#include <ztrain/models/fused.h>

#include "simd.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Parallel.h>
#include <ATen/record_function.h>

#include <array>
#include <cmath>
#include <cstring>
#include <mutex>

// How it works
// ------------
// Whether element e of a tensor is kept depends only on a 64-bit seed and e, through the
// counter-based generator Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as
// 1, 2, 3", SC 2011; cuRAND's Philox, behind PyTorch's dropout on CUDA GPUs). The elements go in
// blocks of 32: block B runs Philox on the 8 counters 8B … 8B + 7 under the key `seed`, and word j
// of counter 8B + l decides element 32B + 8j + l, so that in the AVX2 code the 8 counters sit in
// the lanes of 4 registers and register j holds the words of 8 consecutive elements. Element e is
// dropped when its word u is below the threshold round(p · 2³²): with probability p, to 2⁻³³.
//
// Forward draws the seed from the default CPU generator (one draw a call, under its lock) and
// keeps only the seed: backward applies the same mask to the gradient, and recomputation, which
// restores that generator's state, draws the same seed. A kept element is multiplied by
// 1 / (1 − p) as a float, as libtorch's dropout does, a dropped one by 0 (so NaN stays NaN). The
// scalar code (CPUs without AVX2) and the AVX2 code give the same bits, and so does any split of
// the elements over threads.

namespace ztrain::models {

namespace {
constexpr uint32_t kM0 = 0xD2511F53, kM1 = 0xCD9E8D57;  // Philox's multipliers
constexpr uint32_t kW0 = 0x9E3779B9, kW1 = 0xBB67AE85;  // its key increments (golden ratio, √3 − 1)
}  // namespace

std::array<uint32_t, 4> detail::philox4x32_10(std::array<uint32_t, 4> c, std::array<uint32_t, 2> key) {
  auto [k0, k1] = key;
  for (int round = 0; round < 10; ++round) {
    if (round > 0) {
      k0 += kW0;
      k1 += kW1;
    }
    const uint64_t p0 = uint64_t{kM0} * c[0], p1 = uint64_t{kM1} * c[2];
    c = {static_cast<uint32_t>(p1 >> 32) ^ c[1] ^ k0, static_cast<uint32_t>(p1),
         static_cast<uint32_t>(p0 >> 32) ^ c[3] ^ k1, static_cast<uint32_t>(p0)};
  }
  return c;
}

namespace {

constexpr int64_t kBlock = 32;         // elements per 8 counters
constexpr int64_t kGrainBlocks = 512;  // blocks per task of at::parallel_for

// What a call applies: the key, the threshold and the factor of a kept element.
struct Mask {
  uint32_t k0, k1;
  uint32_t threshold;  // u < threshold: dropped
  float scale;
};

// ---- scalar ------------------------------------------------------------------------------------

using detail::simd::to_float;

// The 32 words of block b, in element order.
void block_words(const Mask& m, uint64_t b, uint32_t* words) {
  for (uint32_t lane = 0; lane < 8; ++lane) {
    const uint64_t counter = 8 * b + lane;
    const auto r = detail::philox4x32_10({static_cast<uint32_t>(counter), static_cast<uint32_t>(counter >> 32), 0, 0},
                                         {m.k0, m.k1});
    for (int j = 0; j < 4; ++j) words[8 * j + lane] = r[j];
  }
}

template <class T>
void apply_scalar(const Mask& m, const T* x, T* y, int64_t begin_block, int64_t end_block, int64_t n) {
  uint32_t words[kBlock];
  for (int64_t b = begin_block; b < end_block; ++b) {
    block_words(m, static_cast<uint64_t>(b), words);
    const int64_t first = b * kBlock, count = std::min(kBlock, n - first);
    for (int64_t i = 0; i < count; ++i) {
      y[first + i] = static_cast<T>(to_float(x[first + i]) * (words[i] < m.threshold ? 0.0f : m.scale));
    }
  }
}

// ---- AVX2 --------------------------------------------------------------------------------------

using detail::simd::load8;
using detail::simd::store8;

// The high and low halves of the 64-bit products m · x, lane by lane.
ZTRAIN_AVX2 inline void mulhilo8(__m256i m, __m256i x, __m256i& hi, __m256i& lo) {
  const __m256i even = _mm256_mul_epu32(x, m);                        // lanes 0, 2, 4, 6
  const __m256i odd = _mm256_mul_epu32(_mm256_srli_epi64(x, 32), m);  // lanes 1, 3, 5, 7
  hi = _mm256_blend_epi32(_mm256_srli_epi64(even, 32), odd, 0b10101010);
  lo = _mm256_blend_epi32(even, _mm256_slli_epi64(odd, 32), 0b10101010);
}

// Philox on the 8 counters of block b; c[j] holds word j of each.
ZTRAIN_AVX2 inline void block_words8(const Mask& m, uint64_t b, __m256i c[4]) {
  const uint64_t first = 8 * b;  // a multiple of 8: adding the lane never carries into the high word
  c[0] = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int>(static_cast<uint32_t>(first))),
                          _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  c[1] = _mm256_set1_epi32(static_cast<int>(static_cast<uint32_t>(first >> 32)));
  c[2] = c[3] = _mm256_setzero_si256();
  const __m256i m0 = _mm256_set1_epi32(static_cast<int>(kM0)), m1 = _mm256_set1_epi32(static_cast<int>(kM1));
  uint32_t k0 = m.k0, k1 = m.k1;
  for (int round = 0; round < 10; ++round) {
    if (round > 0) {
      k0 += kW0;
      k1 += kW1;
    }
    __m256i hi0, lo0, hi1, lo1;
    mulhilo8(m0, c[0], hi0, lo0);
    mulhilo8(m1, c[2], hi1, lo1);
    c[0] = _mm256_xor_si256(_mm256_xor_si256(hi1, c[1]), _mm256_set1_epi32(static_cast<int>(k0)));
    c[1] = lo1;
    c[2] = _mm256_xor_si256(_mm256_xor_si256(hi0, c[3]), _mm256_set1_epi32(static_cast<int>(k1)));
    c[3] = lo0;
  }
}

// 0 where the word drops its element, the scale where it keeps it. Unsigned u < t is signed
// (u ^ 2³¹) < (t ^ 2³¹).
ZTRAIN_AVX2 inline __m256 factors8(__m256i words, __m256i threshold_signed, __m256 scale) {
  const __m256i dropped = _mm256_cmpgt_epi32(threshold_signed, _mm256_xor_si256(words, _mm256_set1_epi32(INT32_MIN)));
  return _mm256_andnot_ps(_mm256_castsi256_ps(dropped), scale);
}

template <class T>
ZTRAIN_AVX2 void apply_avx2(const Mask& m, const T* x, T* y, int64_t begin_block, int64_t end_block, int64_t n) {
  const __m256i threshold = _mm256_set1_epi32(static_cast<int>(m.threshold ^ 0x80000000u));
  const __m256 scale = _mm256_set1_ps(m.scale);
  __m256i words[4];
  for (int64_t b = begin_block; b < end_block; ++b) {
    block_words8(m, static_cast<uint64_t>(b), words);
    const int64_t first = b * kBlock;
    if (first + kBlock <= n) {
      for (int j = 0; j < 4; ++j) {
        const int64_t at = first + 8 * j;
        store8(y + at, _mm256_mul_ps(load8(x + at), factors8(words[j], threshold, scale)));
      }
      continue;
    }
    T in[kBlock] = {}, out[kBlock];  // the last, partial block: through the same vector code
    std::memcpy(in, x + first, (n - first) * sizeof(T));
    for (int j = 0; j < 4; ++j) {
      store8(out + 8 * j, _mm256_mul_ps(load8(in + 8 * j), factors8(words[j], threshold, scale)));
    }
    std::memcpy(y + first, out, (n - first) * sizeof(T));
  }
}

// The 32 factors of block b (0 or the scale), in element order.
void block_factors_scalar(const Mask& m, uint64_t b, float* f) {
  uint32_t words[kBlock];
  block_words(m, b, words);
  for (int64_t i = 0; i < kBlock; ++i) f[i] = words[i] < m.threshold ? 0.0f : m.scale;
}

ZTRAIN_AVX2 void block_factors_avx2(const Mask& m, uint64_t b, float* f) {
  const __m256i threshold = _mm256_set1_epi32(static_cast<int>(m.threshold ^ 0x80000000u));
  __m256i words[4];
  block_words8(m, b, words);
  for (int j = 0; j < 4; ++j) store8(f + 8 * j, factors8(words[j], threshold, _mm256_set1_ps(m.scale)));
}

// ---- the operation -----------------------------------------------------------------------------

Mask mask_of(uint64_t seed, double p) {
  const double threshold = std::min(std::round(std::ldexp(p, 32)), 4294967295.0);
  return {.k0 = static_cast<uint32_t>(seed),
          .k1 = static_cast<uint32_t>(seed >> 32),
          .threshold = static_cast<uint32_t>(threshold),
          .scale = static_cast<float>(1.0 / (1.0 - p))};
}

// x with the mask of (seed, p) applied, as a new contiguous tensor of x's shape.
torch::Tensor apply_mask(const torch::Tensor& input, uint64_t seed, double p) {
  const auto x = input.contiguous();
  auto y = torch::empty_like(x);
  const Mask m = mask_of(seed, p);
  const int64_t n = x.numel();
  const bool simd = detail::fused_simd() != detail::Simd::kScalar;
  detail::simd::for_type(x.scalar_type(), [&]<class T>(T) {
    const T* px = x.data_ptr<T>();
    T* py = y.data_ptr<T>();
    at::parallel_for(0, (n + kBlock - 1) / kBlock, kGrainBlocks, [&](int64_t begin, int64_t end) {
      if (simd) {
        apply_avx2(m, px, py, begin, end, n);
      } else {
        apply_scalar(m, px, py, begin, end, n);
      }
    });
  });
  return y;
}

}  // namespace

uint64_t detail::dropout_seed() {
  auto gen = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(gen.mutex());
  return at::check_generator<at::CPUGeneratorImpl>(gen)->random64();
}

void detail::dropout_factors(uint64_t seed, double p, int64_t first, int64_t n, float* out) {
  const Mask m = mask_of(seed, p);
  const auto block_factors = fused_simd() != Simd::kScalar ? block_factors_avx2 : block_factors_scalar;
  for (int64_t e = first; e < first + n;) {
    const int64_t b = e / kBlock, from = e - b * kBlock, to = std::min(kBlock, first + n - b * kBlock);
    if (from == 0 && to == kBlock) {
      block_factors(m, static_cast<uint64_t>(b), out + (e - first));
    } else {  // a block the range starts or ends inside
      float f[kBlock];
      block_factors(m, static_cast<uint64_t>(b), f);
      std::memcpy(out + (e - first), f + from, (to - from) * sizeof(float));
    }
    e = b * kBlock + to;
  }
}

namespace {

struct FusedDropout : torch::autograd::Function<FusedDropout> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x, double p) {
    RECORD_FUNCTION("ztrain::dropout", std::vector<c10::IValue>({x}));
    const uint64_t seed = detail::dropout_seed();
    ctx->saved_data["seed"] = static_cast<int64_t>(seed);
    ctx->saved_data["p"] = p;
    return apply_mask(x, seed, p);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    RECORD_FUNCTION("ztrain::dropout_backward", std::vector<c10::IValue>({grads[0]}));
    const auto seed = static_cast<uint64_t>(ctx->saved_data["seed"].toInt());
    const double p = ctx->saved_data["p"].toDouble();
    // A graph is being built (create_graph): the mask as a tensor, a product autograd can follow.
    if (torch::GradMode::is_enabled()) return {grads[0] * apply_mask(torch::ones_like(grads[0]), seed, p), {}};
    return {apply_mask(grads[0], seed, p), {}};
  }
};

}  // namespace

torch::Tensor dropout(const torch::Tensor& x, double p, bool train) {
  ZTRAIN_CHECK(p >= 0 && p <= 1, "dropout: the probability must be in [0, 1], got ", p);
  if (!train || p == 0) return x;
  if (p == 1 || !detail::simd::float_or_bf16_on_cpu(x)) return torch::dropout(x, p, train);
  return FusedDropout::apply(x, p);
}

}  // namespace ztrain::models
