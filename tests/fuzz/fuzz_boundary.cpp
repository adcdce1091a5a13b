// The header of a pipeline-boundary message (what a stage receives from its neighbour before
// the tensors): int64 entries, decoded as Boundary's receiver does.
#include "fuzz_input.h"

#include <ztrain/error.h>
#include <ztrain/pipe/boundary.h>

#include <cstring>
#include <vector>

ZTRAIN_FUZZ_TARGET(boundary) {
  std::vector<int64_t> header(size / sizeof(int64_t));
  if (!header.empty()) std::memcpy(header.data(), data, header.size() * sizeof(int64_t));
  try {
    int64_t id = 0;
    ztrain::detail::decode_boundary_header(header.data(), static_cast<int64_t>(header.size()), id, 1);
  } catch (const ztrain::Error&) {
  }
  return 0;
}
