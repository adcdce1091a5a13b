#pragma once
/// Seeds derived from the one user seed.
///
/// Ranks that must draw the same numbers (parameter initialisation, dropout in tensor-parallel
/// replicated regions) use a stream that ignores the coordinates they may differ in; ranks that
/// must differ (dropout on different data) mix those coordinates in. Derivation is a keyed
/// SplitMix64 chain, so streams are independent and stable across versions and world sizes.
///
///   torch::manual_seed(ztrain::rng::data_parallel_seed(seed, coord));

#include <ztrain/runtime/topology.h>

#include <ATen/core/Generator.h>

#include <cstdint>
#include <initializer_list>
#include <vector>

namespace ztrain::rng {

/// A well-mixed 64-bit value from `seed` and the parts, in order.
uint64_t derive(uint64_t seed, std::initializer_list<uint64_t> parts);

/// Same on every rank: initialisation and anything every rank must agree on.
uint64_t shared_seed(uint64_t seed);
/// Differs across data-parallel replicas and pipeline stages, shared across a tp group: the
/// default generator's seed (dropout on activations that tp ranks hold replicated).
uint64_t data_parallel_seed(uint64_t seed, Coord c);
/// Differs on every rank: dropout on tensor-parallel split activations.
uint64_t rank_seed(uint64_t seed, Coord c);

/// The default generators that work on `device` draws from: the CPU's, then the device's unless
/// it is the CPU (what recomputation replays and checkpoints keep).
std::vector<at::Generator> default_generators(c10::Device device);

/// A generator's state, read or replaced under the generator's lock (other threads may draw).
at::Tensor get_state(at::Generator& gen);
void set_state(at::Generator& gen, const at::Tensor& state);

}  // namespace ztrain::rng
