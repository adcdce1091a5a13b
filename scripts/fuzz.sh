#!/usr/bin/env bash
# Usage: scripts/fuzz.sh [SECONDS] [TARGET...]
#
# Builds the fuzz targets of tests/fuzz with Clang, libFuzzer, AddressSanitizer and
# UndefinedBehaviorSanitizer into build-fuzz/ (or $ZTRAIN_FUZZ_BUILD_DIR), then runs each TARGET
# (default: all of safetensors manifest boundary gpt_config tokenizer) for SECONDS (default 600)
# from its committed corpus, two at a time. Inputs that reach new code go to
# build-fuzz/corpus/<target>; an input that crashes, trips a sanitizer, leaks, hangs or lets an
# exception other than ztrain::Error out is saved as tests/fuzz/corpus/<target>/crash-* (or
# timeout-*, leak-*, oom-*) — commit it with the fix, and fuzz_replay.<target> replays it in
# every build from then on — and the script fails. Prints one line per target.
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${ZTRAIN_FUZZ_BUILD_DIR:-$root/build-fuzz}
seconds=${1:-600}
shift $(( $# > 0 ? 1 : 0 ))
targets=("$@")
((${#targets[@]})) || targets=(safetensors manifest boundary gpt_config tokenizer)
command -v clang++ >/dev/null || { echo "fuzz: needs clang++ (Debian: clang)" >&2; exit 2; }

mkdir -p "$build"
generator=()
[[ -f $build/CMakeCache.txt ]] || { command -v ninja >/dev/null && generator=(-G Ninja); }
{ cmake -S "$root" -B "$build" "${generator[@]}" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_CXX_COMPILER=clang++ \
    -DZTRAIN_FUZZ=ON -DZTRAIN_SANITIZE=address,undefined -DZTRAIN_BUILD_BENCH=OFF &&
  cmake --build "$build" -j "${ZTRAIN_JOBS:-$(nproc)}" --target "${targets[@]/#/fuzz_}"; } >"$build/build.log" 2>&1 ||
  { tail -30 "$build/build.log"; echo "fuzz: the build failed (log: $build/build.log)"; exit 1; }

export OMP_NUM_THREADS=1 UBSAN_OPTIONS=print_stacktrace=1 ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:verify_asan_link_order=0}
status=0
run() {
  local t=$1 seeds=$root/tests/fuzz/corpus/$1 found=$build/corpus/$1 log=$build/fuzz_$1.log
  mkdir -p "$found"
  "$build/tests/fuzz/fuzz_$t" -max_total_time="$seconds" -timeout=20 -rss_limit_mb=4096 -print_final_stats=1 \
    -artifact_prefix="$seeds/" "$found" "$seeds" >"$log" 2>&1
  local rc=$?
  local runs=$(grep -o 'stat::number_of_executed_units: *[0-9]*' "$log" | grep -o '[0-9]*$')
  local cov=$(grep -o 'cov: [0-9]*' "$log" | tail -1)
  echo "fuzz $t: exit $rc, ${runs:-?} inputs in $seconds s, $cov, corpus $(ls "$found" | wc -l) (log: $log)"
  return $rc
}
for ((i = 0; i < ${#targets[@]}; i += 2)); do
  run "${targets[i]}" &
  a=$!
  b=
  if ((i + 1 < ${#targets[@]})); then run "${targets[i + 1]}" & b=$!; fi
  wait $a || status=1
  [[ -z $b ]] || wait $b || status=1
done
((status == 0)) && echo "fuzz: no findings" || echo "fuzz: findings saved under tests/fuzz/corpus/<target>/"
exit $status
