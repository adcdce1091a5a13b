#!/usr/bin/env bash
# Configures and builds ztrain into build/ (or $ZTRAIN_BUILD_DIR). Extra arguments go to cmake.
# libtorch is .venv's (scripts/setup.sh), or that of $ZTRAIN_PYTHON when it is set.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${ZTRAIN_BUILD_DIR:-$root/build}
jobs=${ZTRAIN_JOBS:-$(nproc)}
generator=()
[[ -f $build/CMakeCache.txt ]] || { command -v ninja >/dev/null && generator=(-G Ninja); }
python=()
[[ -z ${ZTRAIN_PYTHON:-} ]] || python=(-DZTRAIN_PYTHON="$ZTRAIN_PYTHON")
cmake -S "$root" -B "$build" "${generator[@]}" -DCMAKE_BUILD_TYPE=RelWithDebInfo "${python[@]}" "$@"
cmake --build "$build" -j "$jobs"
