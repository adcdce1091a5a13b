#include <ztrain/zero/level_policy.h>

#include <ztrain/error.h>

namespace ztrain {

namespace {
constexpr LevelPolicy kLevels[] = {
    {.level = 0, .gradient = GradientReduction::kAllReduce},
    {.level = 1, .shards_optimizer_state = true, .gradient = GradientReduction::kReduceScatter},
    {.level = 2, .shards_optimizer_state = true, .shards_parameters = true,
     .gradient = GradientReduction::kReduceScatter},
    {.level = 3, .shards_optimizer_state = true, .shards_parameters = true, .regathers_for_backward = true,
     .gradient = GradientReduction::kReduceScatter},
};
}  // namespace

const LevelPolicy& level_policy(int level, const std::string& who) {
  ZTRAIN_CHECK(level >= 0 && level < static_cast<int>(std::size(kLevels)), who, " must be 0..3, got ", level);
  return kLevels[level];
}

}  // namespace ztrain
