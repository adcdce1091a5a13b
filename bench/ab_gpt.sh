#!/usr/bin/env bash
# Usage: bench/ab_gpt.sh BUILD_A BUILD_B [ROUNDS] [STEPS] [PRESET]
#
# Two builds of ztrain (say, before and after a change) side by side in one run: gpt_bench of
# each, on 2 ranks x 1 thread, at ZeRO levels 0 and 3 in fp32 and bf16, the two builds taking
# turns configuration by configuration, ROUNDS times (default 3), so that drift in the machine's
# speed slows both alike. Prints each configuration's median step time over its runs for A and
# B, the spread (lowest and highest run), B/A in tokens/s, and each build's median peak RSS of
# rank 0. DTYPES and LEVELS (environment) narrow the configurations, e.g. DTYPES=bf16
# LEVELS="0 3"; ARGS adds gpt_bench options to every run, e.g. ARGS="--batch 2 --seq 256
# --dropout 0". PROFILE=fp32|bf16 also profiles one step of each build at 1 rank, level 0, in
# that dtype (libtorch's profiler) and prints the operators' self times side by side.
set -euo pipefail
a=$1 b=$2
rounds=${3:-3}
steps=${4:-20}
preset=${5:-small}
root=$(cd "$(dirname "$0")/.." && pwd)
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS=1
results=$(mktemp)
profiles=$(mktemp -d)
trap 'rm -rf "$results" "$profiles"' EXIT
for bin in "$a/bench/gpt_bench" "$b/bench/gpt_bench"; do
  [[ -x $bin ]] || { echo "ab_gpt: no $bin (build with ZTRAIN_BUILD_BENCH=ON)" >&2; exit 1; }
done
echo "gpt_bench --preset $preset --steps $steps --warmup ${WARMUP:-3} ${ARGS:-}, 2 ranks x 1 thread; A=$a B=$b; $rounds rounds"
for round in $(seq "$rounds"); do
  for dtype in ${DTYPES:-fp32 bf16}; do
    for level in ${LEVELS:-0 3}; do
      for side in A B; do
        build=$a
        [[ $side == B ]] && build=$b
        line=$(mpirun -np 2 --oversubscribe --bind-to none "$build/bench/gpt_bench" --preset "$preset" \
                 --level "$level" --dtype "$dtype" --steps "$steps" --warmup "${WARMUP:-3}" \
                 --data "$root/data/tinyshakespeare.txt" ${ARGS:-} | tail -n 1)
        echo "$side $dtype $level $line" >> "$results"
        echo "round $round: $side $dtype level $level done" >&2
      done
    done
  done
done
python3 - "$results" <<'EOF'
import json, statistics, sys
runs = {}
for row in open(sys.argv[1]):
    side, dtype, level, payload = row.split(" ", 3)
    r = json.loads(payload)
    runs.setdefault((dtype, int(level)), {}).setdefault(side, []).append(
        (r["step_s"]["median"], r["loss_last"], r["memory"]["peak_rss"] / 2**30))
print(f"{'dtype':6} {'level':>5} {'A step s (min-max)':>24} {'B step s (min-max)':>24} {'B/A tokens/s':>13} "
      f"{'RSS GiB A, B':>13}  losses A = B")
for (dtype, level), sides in sorted(runs.items()):
    a = [s for s, _, _ in sides["A"]]
    b = [s for s, _, _ in sides["B"]]
    rss = [statistics.median(m for _, _, m in sides[side]) for side in "AB"]
    same = {l for _, l, _ in sides["A"]} == {l for _, l, _ in sides["B"]}
    fmt = lambda v: f"{statistics.median(v):.4f} ({min(v):.4f}-{max(v):.4f})"
    print(f"{dtype:6} {level:>5} {fmt(a):>24} {fmt(b):>24} {statistics.median(a) / statistics.median(b):>13.3f} "
          f"{rss[0]:>6.2f}, {rss[1]:.2f}  {same}")
EOF
[[ -n ${PROFILE:-} ]] || exit 0
for side in A B; do
  build=$a
  [[ $side == B ]] && build=$b
  "$build/bench/gpt_bench" --preset "$preset" --dtype "$PROFILE" --steps 3 --warmup "${WARMUP:-3}" \
    --data "$root/data/tinyshakespeare.txt" ${ARGS:-} --profile "$profiles/$side.json" >/dev/null
done
echo
echo "profile of one step, 1 rank, level 0, $PROFILE: self time (ms) of the operators that take the most"
python3 - "$profiles" "$root/bench" <<'EOF'
import sys
sys.path.insert(0, sys.argv[2])
from report import self_times
(a, ta), (b, tb) = (self_times(f"{sys.argv[1]}/{side}.json") for side in "AB")
top = sorted(set(a) | set(b), key=lambda op: -max(a.get(op, 0), b.get(op, 0)))[:12]
print(f"{'operator':32} {'A ms':>8} {'B ms':>8}")
for op in top:
    print(f"{op:32} {a.get(op, 0):8.1f} {b.get(op, 0):8.1f}")
print(f"{'the step (profiled)':32} {ta:8.1f} {tb:8.1f}")
EOF
