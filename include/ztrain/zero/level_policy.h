#pragma once
/// What each ZeRO level means, in one table.
///
/// The engine (sharded_module.cpp), checkpoints, initialisation and memory accounting ask a
/// LevelPolicy what to do and never compare level numbers themselves. A level is a combination
/// of four independent decisions:
///
/// | level | optimizer updates       | between steps     | gathered                              | gradient       |
/// |-------|-------------------------|-------------------|---------------------------------------|----------------|
/// | 0     | the full buffer         | full buffer       | never                                 | all-reduce     |
/// | 1     | this rank's shard (a view of the full buffer) | full buffer | in place, after a step changed the shard | reduce-scatter |
/// | 2     | this rank's shard (own buffer) | shard      | in forward, kept until this module's backward | reduce-scatter |
/// | 3     | this rank's shard (own buffer) | shard      | in forward, released, again in backward | reduce-scatter |
///
///   const auto& policy = ztrain::level_policy(3);
///   if (policy.shards_parameters) release_full_buffer();

#include <string>

namespace ztrain {

enum class GradientReduction {
  kAllReduce,      ///< every rank gets the whole mean gradient (DDP)
  kReduceScatter,  ///< every rank gets the mean of its shard only
};

struct LevelPolicy {
  int level = 0;
  /// The optimizer updates this rank's shard of the flat buffer (its state is sharded); else the
  /// whole buffer, replicated on every rank.
  bool shards_optimizer_state = false;
  /// Between steps only the shard is kept, in a buffer of its own; the full buffer is released
  /// and gathered when needed. Else the full buffer stays allocated (and the shard, if any, is a
  /// view into it).
  bool shards_parameters = false;
  /// Release the gathered buffer right after forward and gather it again for backward; else a
  /// gathered buffer is kept until this module's backward.
  bool regathers_for_backward = false;
  GradientReduction gradient = GradientReduction::kAllReduce;

  /// Whether the full buffer ever needs gathering.
  bool gathers() const { return shards_optimizer_state; }
  /// Whether a step changing the shard leaves the kept full buffer stale until re-gathered.
  bool refreshes_after_step() const { return shards_optimizer_state && !shards_parameters; }
};

/// The policy of ZeRO level `level`; throws ztrain::Error naming `who` unless 0 ≤ level ≤ 3.
const LevelPolicy& level_policy(int level, const std::string& who = "zero_level");

}  // namespace ztrain
