#pragma once
/// Reduction operations of the collectives.

namespace ztrain {

/// Reductions. kAvg divides the sum by the group size and needs a floating dtype. For bool,
/// kSum and kMax are logical or, kMin is logical and.
enum class ReduceOp { kSum, kAvg, kMax, kMin };

const char* to_string(ReduceOp op);

}  // namespace ztrain
