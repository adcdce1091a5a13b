#!/usr/bin/env bash
# Usage: scripts/sanitize.sh [--thread] [CTEST_ARGS...]
#
# Builds ztrain and its tests with sanitizers (GCC; every report fatal) and runs them:
#
# - default: AddressSanitizer and UndefinedBehaviorSanitizer (-DZTRAIN_SANITIZE=address,undefined)
#   into build-asan/, over the unit tier and every test at 2 ranks. Leaks are reported at exit
#   except those of the libraries underneath, which keep allocations for the life of the process
#   (scripts/sanitizers/lsan.supp; the slow unwinder, so that their frames are named).
# - --thread: ThreadSanitizer (-DZTRAIN_SANITIZE=thread) into build-tsan/, over the tests whose
#   code runs threads of its own — communication streams (ZeRO prefetch and reductions, the
#   booster's gradient buckets), the offloaded optimizer's thread pool, background saves — at
#   1 and 2 ranks. libtorch, Open MPI and libgomp are not instrumented: what TSan cannot see
#   through them is suppressed in scripts/sanitizers/tsan.supp, each entry with its reason, and
#   libtorch runs one compute thread (OMP_NUM_THREADS=1), as the multi-rank tests do anyway.
#
# Neither builds the Python package: an instrumented extension cannot load into an uninstrumented
# python. $ZTRAIN_SANITIZE_BUILD_DIR overrides the build directory. Extra arguments go to every ctest
# run (for example -R comm). Ends non-zero on any report or failure.
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
mode=address
if [[ ${1:-} == --thread ]]; then
  mode=thread
  shift
fi
status=0
if [[ $mode == thread ]]; then
  build=${ZTRAIN_SANITIZE_BUILD_DIR:-$root/build-tsan}
  tests=(comm_stream_test communicator_test host_shared_test block_test block_parity_test adam_test
         adam_offload_test optim_manager_test checkpoint_test optimizer_state_test booster_test plugin_parity_test)
  programs=(comm_tests zero_tests optim_tests ckpt_tests booster_tests)  # the test programs holding them
  mkdir -p "$build"
  ZTRAIN_BUILD_DIR=$build ZTRAIN_BUILD_TARGETS="${programs[*]}" "$root/scripts/build.sh" -DZTRAIN_SANITIZE=thread \
    -DZTRAIN_BUILD_BENCH=OFF -DZTRAIN_BUILD_APPS=OFF -DZTRAIN_BUILD_PYTHON=OFF >"$build/build.log" 2>&1 ||
    { tail -30 "$build/build.log"; echo "sanitize: the build failed"; exit 1; }
  export TSAN_OPTIONS=${TSAN_OPTIONS:-suppressions=$root/scripts/sanitizers/tsan.supp:halt_on_error=1:second_deadlock_stack=1:history_size=7}
  export OMP_NUM_THREADS=1
  regex="^($(IFS='|'; echo "${tests[*]}"))(\\.np[12])?\$"
  cd "$build" || exit 1
  ctest -R "$regex" -E '\.cuda$' -j "$(nproc)" --output-on-failure "$@" || status=1
  ((status == 0)) && echo "sanitize: the threaded tests ran clean under ThreadSanitizer" || echo "sanitize: failures above"
  exit $status
fi
build=${ZTRAIN_SANITIZE_BUILD_DIR:-$root/build-asan}
mkdir -p "$build"
ZTRAIN_BUILD_DIR=$build "$root/scripts/build.sh" -DZTRAIN_SANITIZE=address,undefined -DZTRAIN_BUILD_BENCH=OFF \
  -DZTRAIN_BUILD_APPS=OFF -DZTRAIN_BUILD_PYTHON=OFF >"$build/build.log" 2>&1 || { tail -30 "$build/build.log"; echo "sanitize: the build failed"; exit 1; }
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:fast_unwind_on_malloc=0}
export LSAN_OPTIONS=${LSAN_OPTIONS:-suppressions=$root/scripts/sanitizers/lsan.supp:print_suppressions=0}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1}
cd "$build" || exit 1
# LeakSanitizer's stop-the-world tracer now and then crashes itself at a process's exit, after
# the test passed and before any leak is reported ("Tracer caught signal 11", a known fault of
# the sanitizer runtime: google/sanitizers#1353). Here: communicator_test.np2 in 3 of 4 runs of
# this tier (d967fd0 to 79b14b9), at the same fault address each time, never in 7 runs outside
# it. A test that failed that way and no other runs once more, and its second run's leak check
# is the one that counts. Every other failure stands.
tracer_crash_only() {  # the test's section of ctest's log shows the tracer crash and nothing else
  local section
  section=$(awk -v n="$1" '/ Testing: / && $NF == n {on = 1} on {print} on && /end time/ {exit}' \
    Testing/Temporary/LastTest.log)
  grep -q "Tracer caught signal" <<<"$section" &&
    ! grep -qE "ERROR: (Address|Leak)Sanitizer|runtime error:|\[  FAILED  \]" <<<"$section"
}
run_tier() {
  ctest -j "$(nproc)" --output-on-failure "$@" && return 0
  local failed=() retry=() name rc=0
  mapfile -t failed < <(cut -d: -f2- Testing/Temporary/LastTestsFailed.log)
  for name in "${failed[@]}"; do
    if tracer_crash_only "$name"; then retry+=("$name"); else rc=1; fi
  done
  for name in "${retry[@]}"; do
    echo "sanitize: $name passed, then LeakSanitizer's tracer crashed at exit; running it once more"
    ctest -R "^${name//./\\.}\$" --output-on-failure || rc=1
  done
  return $rc
}
run_tier -L unit "$@" || status=1
run_tier -R '\.np2$' "$@" || status=1
((status == 0)) && echo "sanitize: the unit and 2-rank tiers ran clean" || echo "sanitize: failures above"
exit $status
