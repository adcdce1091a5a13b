#!/usr/bin/env bash
# Configures and builds ztrain into build/ (or $ZTRAIN_BUILD_DIR). Extra arguments go to cmake.
# libtorch is that of $ZTRAIN_PYTHON when it is set, else $ZTRAIN_VENV's or .venv's (scripts/setup.sh).
# $ZTRAIN_BUILD_TARGETS (space-separated) builds those targets only.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${ZTRAIN_BUILD_DIR:-$root/build}
jobs=${ZTRAIN_JOBS:-$(nproc)}
generator=()
[[ -f $build/CMakeCache.txt ]] || { command -v ninja >/dev/null && generator=(-G Ninja); }
python=()
py=${ZTRAIN_PYTHON:-${ZTRAIN_VENV:+$ZTRAIN_VENV/bin/python}}
[[ -z $py ]] || python=(-DZTRAIN_PYTHON="$py")
# A configured tree is configured again when asked to (arguments, a Python) or when the project's
# environment was installed since; the build itself re-runs CMake when a CMake file changed.
stamp=${ZTRAIN_VENV:-$root/.venv}/.ztrain-packages
if [[ ! -f $build/CMakeCache.txt || $# -gt 0 || -n $py || $stamp -nt $build/CMakeCache.txt ]]; then
  cmake -S "$root" -B "$build" "${generator[@]}" -DCMAKE_BUILD_TYPE=RelWithDebInfo "${python[@]}" "$@"
fi
targets=()
[[ -z ${ZTRAIN_BUILD_TARGETS:-} ]] || targets=(--target $ZTRAIN_BUILD_TARGETS)
cmake --build "$build" -j "$jobs" "${targets[@]}"
