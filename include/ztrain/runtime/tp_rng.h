#pragma once
/// The tensor-parallel RNG tracker (Megatron's model-parallel RNG state): the generators for
/// dropout on activations that are split across a tensor-parallel group.
///
/// The default generators are seeded alike across a tp group (rng::data_parallel_seed), as
/// dropout on activations the group holds replicated needs: every tp rank must drop the same
/// elements of them. Activations split across the group — each rank's attention heads — need the
/// opposite: every rank its own mask, or the heads of different ranks would share theirs. A
/// TensorParallelRng scope swaps the tracker's generator states, seeded from rng::rank_seed and
/// so different on every rank, into the default generators and back, so that whatever draws
/// inside draws from them:
///
///   {
///     ztrain::TensorParallelRng split_rng(x.device());
///     probs = dropout(probs);        // heads of this tp rank: a mask of their own
///   }
///
/// Recomputation replays the tracker too: sharded modules save and restore its states with the
/// default generators'. Without init_distributed a scope changes nothing (one rank, no split).
/// Scopes nest; a thread that draws from the default generators while another holds a scope
/// draws from the tracker's states.

#include <ATen/core/Generator.h>
#include <c10/core/Device.h>

#include <vector>

namespace ztrain {

class TensorParallelRng {
 public:
  explicit TensorParallelRng(c10::Device device = c10::Device(c10::kCPU));
  ~TensorParallelRng();
  TensorParallelRng(const TensorParallelRng&) = delete;
  TensorParallelRng& operator=(const TensorParallelRng&) = delete;

 private:
  c10::Device device_;
  std::vector<at::Generator> generators_;
  std::vector<at::Tensor> saved_;  // the default generators' states while the scope lives
};

namespace rng {
/// The tracker's states, one per default generator of `device` (rng::default_generators),
/// seeded on first use; empty without a runtime.
std::vector<at::Tensor> tensor_parallel_states(c10::Device device);
/// Replaces them (with states from tensor_parallel_states).
void set_tensor_parallel_states(c10::Device device, std::vector<at::Tensor> states);
}  // namespace rng

}  // namespace ztrain
