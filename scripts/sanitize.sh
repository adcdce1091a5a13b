#!/usr/bin/env bash
# Usage: scripts/sanitize.sh [CTEST_ARGS...]
#
# Builds ztrain and its tests with AddressSanitizer and UndefinedBehaviorSanitizer (GCC;
# -DZTRAIN_SANITIZE=address,undefined, every report fatal) into build-asan/ (or
# $ZTRAIN_SANITIZE_BUILD_DIR), then runs the unit tier and every test at 2 ranks. Extra arguments
# go to both ctest runs (for example -R comm). Leaks are reported at exit except those of the
# libraries underneath, which keep allocations for the life of the process
# (scripts/sanitizers/lsan.supp; the slow unwinder, so that their frames are named). Ends non-zero
# on any report or failure.
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${ZTRAIN_SANITIZE_BUILD_DIR:-$root/build-asan}
mkdir -p "$build"
ZTRAIN_BUILD_DIR=$build "$root/scripts/build.sh" -DZTRAIN_SANITIZE=address,undefined -DZTRAIN_BUILD_BENCH=OFF \
  -DZTRAIN_BUILD_APPS=OFF >"$build/build.log" 2>&1 || { tail -30 "$build/build.log"; echo "sanitize: the build failed"; exit 1; }
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:fast_unwind_on_malloc=0}
export LSAN_OPTIONS=${LSAN_OPTIONS:-suppressions=$root/scripts/sanitizers/lsan.supp:print_suppressions=0}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1}
cd "$build" || exit 1
status=0
ctest -L unit -j "$(nproc)" --output-on-failure "$@" || status=1
ctest -R '\.np2$' -j "$(nproc)" --output-on-failure "$@" || status=1
((status == 0)) && echo "sanitize: the unit and 2-rank tiers ran clean" || echo "sanitize: failures above"
exit $status
