#!/usr/bin/env bash
# Configures and builds ztrain into build/ (or $ZTRAIN_BUILD_DIR). Extra arguments go to cmake.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${ZTRAIN_BUILD_DIR:-$root/build}
jobs=${ZTRAIN_JOBS:-$(nproc)}
generator=()
[[ -f $build/CMakeCache.txt ]] || { command -v ninja >/dev/null && generator=(-G Ninja); }
cmake -S "$root" -B "$build" "${generator[@]}" -DCMAKE_BUILD_TYPE=RelWithDebInfo "$@"
cmake --build "$build" -j "$jobs"
