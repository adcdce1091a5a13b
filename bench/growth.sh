#!/usr/bin/env bash
# Usage: bench/growth.sh [--build DIR] [--results DIR] [--widths "D ..."] [--steps N] [--limit-gib G]
#                        [--docs]
#
# Growth with model size and rank count: step time, bytes moved per rank and memory per rank of a
# GPT of 4 layers and width D (D/64 heads, byte vocabulary, context 128, batch 4 x sequence 128
# per rank, fp32, AdamW), from 12.8 M parameters (D 512) to the largest that fits this machine, at
# ZeRO level 3 on 1, 2 and 4 ranks and level 0 on 2 ranks, one intra-op thread per rank. Each run
# measures the fp32 matmul peak first (gpt_bench --probe), which gives the compute-bound line of
# the step time. Each run is one process tree in a memory cgroup limited to --limit-gib (default:
# this machine's memory less 1 GiB, page cache included, no swap): a size that does not fit is
# killed by the kernel inside the group and recorded as such, and its series stops there.
#
#   --build DIR     ztrain's build directory (default build/; configured and built if needed)
#   --results DIR   where the JSON lines and logs go (default BUILD/growth)
#   --widths        the model widths (default "512 1024 2048 4096 4608 5120 5632")
#   --steps N       timed steps per run, after 1 warm-up (default 3)
#   --docs          write the section of docs/benchmarks.md between <!-- growth:begin --> and
#                   <!-- growth:end --> and docs/img/bench_growth.png
#
# Needs root (cgroups). 25-40 minutes with the defaults on the 2-core development machines.
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
build=$root/build
results='' docs=0 limit_gib='' steps=3
widths="512 1024 2048 4096 4608 5120 5632"
while (($#)); do
  case $1 in
    --build) build=$(realpath -m "$2"); shift 2 ;;
    --results) results=$(realpath -m "$2"); shift 2 ;;
    --widths) widths=$2; shift 2 ;;
    --steps) steps=$2; shift 2 ;;
    --limit-gib) limit_gib=$2; shift 2 ;;
    --docs) docs=1; shift ;;
    -h|--help) sed -n '2,22p' "$0"; exit 0 ;;
    *) echo "growth: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
results=${results:-$build/growth}
python=${ZTRAIN_PYTHON:-$root/.venv/bin/python}
data=$root/data/tinyshakespeare.txt
fail() { echo "growth: $*" >&2; exit 1; }

[[ -x $python ]] || fail "$python not found; run scripts/setup.sh"
[[ -f $data ]] || fail "$data not found"
for d in $widths; do
  [[ $d =~ ^[0-9]+$ && $((d % 64)) == 0 ]] || fail "--widths: $d is not a multiple of 64 (the head size)"
done
if [[ ! -f $build/CMakeCache.txt ]]; then
  cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DZTRAIN_BUILD_BENCH=ON
fi
grep -q '^ZTRAIN_BUILD_BENCH:BOOL=ON' "$build/CMakeCache.txt" || fail "$build was configured with ZTRAIN_BUILD_BENCH=OFF"
cmake --build "$build" -j "$(nproc)" --target gpt_bench >/dev/null || fail "building gpt_bench failed"
gpt=$build/bench/gpt_bench
mem_kb=$(awk '/^MemTotal/ {print $2}' /proc/meminfo)
limit_bytes=$(( limit_gib ? limit_gib * (1 << 30) : mem_kb * 1024 - (1 << 30) ))

rm -rf "$results"
mkdir -p "$results/logs"
out=$results/results.jsonl
: >"$out"
# shellcheck source=bench/memcg.sh
source "$root/bench/memcg.sh"
memcg_create growth "$limit_bytes"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1
start=$SECONDS

# Each series (level, ranks) grows until a size does not fit.
declare -A stopped=()
for d in $widths; do
  for series in "3 1" "3 2" "0 2" "3 4"; do
    read -r level np <<<"$series"
    [[ -n ${stopped[$series]:-} ]] && continue
    log=$results/logs/d$d-level$level-np$np.log
    printf '[%5ds] d %-5s level %s, %s rank(s) ... ' $((SECONDS - start)) "$d" "$level" "$np" >&2
    memcg_run "$log" mpirun -np "$np" --oversubscribe --bind-to none "$gpt" --data "$data" --json "$out" \
      --tag growth --preset small --d-model "$d" --heads $((d / 64)) --layers 4 --context 128 --batch 4 --seq 128 \
      --dtype fp32 --level "$level" --steps "$steps" --warmup 1 --probe
    echo "rc $memcg_rc, cgroup peak $((memcg_peak >> 20)) MiB" >&2
    if ((memcg_rc != 0)); then
      ((memcg_killed > 0)) || { tail -n 30 "$log" >&2; fail "gpt_bench failed (log: $log)"; }
      stopped[$series]=$d
      # The size that did not fit, in the shape of gpt_bench's lines.
      echo "{\"tag\": \"growth\", \"fits\": false, \"level\": $level, \"ranks\": $np, \"model\": {\"d_model\": $d," \
        "\"layers\": 4, \"context\": 128, \"vocab\": 256}, \"cgroup_peak\": $memcg_peak, \"limit\": $limit_bytes}" >>"$out"
    fi
  done
done
runs=$(grep -c . "$out")
commit=$(git -C "$root" rev-parse --short HEAD 2>/dev/null || echo unknown)
dirty=False
[[ -n $(git -C "$root" status --porcelain 2>/dev/null) ]] && dirty=True
"$python" - "$results/meta.json" <<EOF
import json, platform, sys
cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), platform.processor())
json.dump({"date": "$(date -u '+%Y-%m-%d %H:%M UTC')", "commit": "$commit", "dirty": $dirty, "cpu": cpu,
           "cores": $(getconf _NPROCESSORS_ONLN), "memory_gib": $mem_kb / 2**20, "runs": $runs, "elapsed_s": $((SECONDS - start))},
          open(sys.argv[1], "w"), indent=1)
EOF
echo "growth: $runs runs in $((SECONDS - start)) s; results in $results" >&2

doc=()
((docs)) && doc=(--doc "$root/docs/benchmarks.md" --img "$root/docs/img")
"$python" "$root/bench/report.py" --section growth --results "$results" "${doc[@]}"
