#!/usr/bin/env bash
# Usage: bench/run_all.sh [--build DIR] [--results DIR] [--quick] [--docs | --no-docs]
#                         [--dtypes LIST] [--rounds N] [--all]
#
# Regenerates the section "Against peers and limits" of docs/benchmarks.md (between the markers
# <!-- run_all:begin --> and <!-- run_all:end -->) and its plots docs/img/bench_*.png: GPT
# throughput of ztrain (ZeRO levels 0-3, fp32 and, where the CPU has bf16 units, bf16) beside
# PyTorch's DDP, DDP with ZeroRedundancyOptimizer and FSDP2 (fully_shard), and plain libtorch,
# model-state memory against the ZeRO formulas, bytes sent against theory and model FLOP/s against
# the measured matmul peak (growth with model size up to the largest that fits: bench/growth.sh).
# All of it in one session on this machine, one intra-op thread per rank.
#
#   --build DIR     ztrain's build directory (default build/; configured and built if needed)
#   --results DIR   where the JSON lines, logs and profiles go (default build/bench-results)
#   --quick         2 timed steps per configuration: checks the tooling
#                   in a few minutes; the page is not written unless --docs is also given
#   --docs          write the page even with --quick
#   --no-docs       measure only (the page can be written later with bench/report.py)
#   --dtypes LIST   the dtypes measured (default "fp32 bf16" on a CPU with AVX-512 BF16 or AMX,
#                   "fp32" on one without: there PyTorch's bf16 matmuls fall back to a path many
#                   times slower than fp32's, 1.4 against 35 GFLOP/s on an AVX2 EPYC, and while
#                   ztrain's widen to fp32 there (src/cpu_matmul16.cpp), the PyTorch peers' would
#                   measure that fallback)
#   --rounds N      run the timed comparison N times over, configuration by configuration, and
#                   report each configuration's fastest round (default 1; on a host whose other
#                   load comes and goes, 2 or 3)
#   --all           then the other generated sections, each with its goals marked met or missed:
#                   the GPT-2 124M comparison with DDP and FSDP2 (bench/gpt2_peers.sh, fp32 and,
#                   where the CPU has bf16 units, bf16), growth with model size
#                   (bench/growth.sh) and models beyond memory (bench/beyond_memory.sh); the last
#                   two need root (memory cgroups). Over an hour and a half on the development
#                   machine.
#
# Takes under 6 minutes on the 2-core development machine when it is otherwise idle (with bf16
# units; fp32 alone on a slower CPU without them: about 7 minutes).
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
build=$root/build
results=
quick=0
docs=auto
all=0
rounds=1
dtypes=fp32
grep -qwE "avx512_bf16|amx_bf16" /proc/cpuinfo && dtypes="fp32 bf16"
while (($#)); do
  case $1 in
    --build) build=$(realpath -m "$2"); shift 2 ;;
    --results) results=$(realpath -m "$2"); shift 2 ;;
    --quick) quick=1; shift ;;
    --docs) docs=yes; shift ;;
    --no-docs) docs=no; shift ;;
    --dtypes) dtypes=$2; shift 2 ;;
    --rounds) rounds=$2; shift 2 ;;
    --all) all=1; shift ;;
    -h|--help) sed -n '2,34p' "$0"; exit 0 ;;
    *) echo "run_all: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
for dtype in $dtypes; do [[ $dtype == fp32 || $dtype == bf16 ]] || { echo "run_all: --dtypes takes fp32 and bf16, not '$dtype'" >&2; exit 2; }; done
[[ $rounds =~ ^[1-9][0-9]*$ ]] || { echo "run_all: --rounds takes a positive count, not '$rounds'" >&2; exit 2; }
[[ $docs == auto ]] && { ((quick)) && docs=no || docs=yes; }
((all)) && [[ $(id -u) != 0 ]] && { echo "run_all: --all needs root (growth and beyond-memory run in memory cgroups)" >&2; exit 2; }
results=${results:-$build/bench-results}
python=${ZTRAIN_PYTHON:-$root/.venv/bin/python}  # scripts/setup.sh makes it
data=$root/data/tinyshakespeare.txt

fail() { echo "run_all: $*" >&2; exit 1; }

# ---- what the run needs ----------------------------------------------------------------------
command -v mpirun >/dev/null || fail "mpirun not found; run scripts/setup.sh"
[[ -x $python ]] || fail "$python not found; run scripts/setup.sh"
$python -c 'import torch, torch.distributed' 2>/dev/null || fail "PyTorch missing for $python; run scripts/setup.sh"
$python -c 'import matplotlib' 2>/dev/null || fail "matplotlib missing for $python; run scripts/setup.sh"
[[ -f $data ]] || fail "$data not found"
if [[ ! -f $build/CMakeCache.txt ]]; then
  generator=()
  command -v ninja >/dev/null && generator=(-G Ninja)
  cmake -S "$root" -B "$build" "${generator[@]}" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DZTRAIN_BUILD_BENCH=ON
fi
grep -q '^ZTRAIN_BUILD_BENCH:BOOL=ON' "$build/CMakeCache.txt" || fail "$build was configured with ZTRAIN_BUILD_BENCH=OFF"
build_log=$(mktemp)
trap 'rm -f "$build_log"' EXIT
cmake --build "$build" -j "$(nproc)" --target gpt_bench >"$build_log" 2>&1 ||
  { tail -n 40 "$build_log" >&2; fail "building gpt_bench failed (cmake --build $build --target gpt_bench)"; }
"$python" "$root/bench/peer_torch.py" --check || fail "the PyTorch peer does not compute tests/models/gpt_reference.py's loss"

# Run a copy of the binary and its libraries, so that a rebuild of the build directory during the
# run cannot change (or break) what is measured.
rm -rf "$results"
mkdir -p "$results/logs" "$results/bin"
cp "$build/bench/gpt_bench" "$results/bin/"
ldd "$build/bench/gpt_bench" | awk '/libztrain/ {print $3}' | xargs -r cp -L -t "$results/bin/"
ls "$results/bin/"libztrain_*.so.* >/dev/null || fail "ztrain's libraries not found next to gpt_bench (ldd)"
export LD_LIBRARY_PATH=$results/bin${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
gpt=$results/bin/gpt_bench
ldd "$gpt" | grep -q "$results/bin/libztrain" || fail "the copy of gpt_bench does not load the copied libztrain"
out=$results/results.jsonl
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1
start=$(date +%s)
# How busy the cores are with other work, over 3 s (from /proc/stat; the load average is no
# guide on these virtual machines, where it stays near 2 with the cores idle).
cpu_busy_percent() {
  local a b
  read -ra a < <(grep '^cpu ' /proc/stat)
  sleep 3
  read -ra b < <(grep '^cpu ' /proc/stat)
  local total=0 idle=$((b[4] + b[5] - a[4] - a[5]))
  for i in 1 2 3 4 5 6 7 8; do total=$((total + b[i] - a[i])); done
  echo $((total > 0 ? 100 * (total - idle) / total : 0))
}
busy_start=$(cpu_busy_percent)

if ((quick)); then steps=2 warmup=1; else steps=10 warmup=3; fi
runs=0
log_of() { echo "$results/logs/$(printf '%03d' "$runs")-$1.log"; }

# ztrain NP TAG ARGS...: gpt_bench on NP ranks
ztrain() {
  local np=$1 tag=$2; shift 2
  runs=$((runs + 1))
  local log; log=$(log_of "$tag")
  printf '[%4ds] %-8s np=%d gpt_bench %s\n' $(($(date +%s) - start)) "$tag" "$np" "$*" >&2
  mpirun -np "$np" --oversubscribe --bind-to none -x LD_LIBRARY_PATH "$gpt" --data "$data" --json "$out" --tag "$tag" "$@" >"$log" 2>&1 ||
    { cat "$log" >&2; fail "gpt_bench failed (log: $log)"; }
}

# peer NP TAG ARGS...: the PyTorch peer on NP ranks
peer() {
  local np=$1 tag=$2; shift 2
  runs=$((runs + 1))
  local log; log=$(log_of "$tag")
  printf '[%4ds] %-8s np=%d peer_torch %s\n' $(($(date +%s) - start)) "$tag" "$np" "$*" >&2
  "$python" "$root/bench/peer_torch.py" --ranks "$np" --data "$data" --json "$out" --tag "$tag" "$@" >"$log" 2>&1 ||
    { cat "$log" >&2; fail "peer_torch.py failed (log: $log)"; }
}

# ---- 1-4: the two peer sizes at 1 and 2 ranks, every system side by side ---------------------
# tiny: 2 x 64, 120 k parameters; small: 4 x 256, 3.3 M parameters. 512 / 1024 tokens per rank.
for ((round = 1; round <= rounds; ++round)); do
  for size in "tiny --batch 8 --seq 64" "small --batch 8 --seq 128"; do
    read -r preset shape <<<"$size"
    for np in 1 2; do
      for dtype in $dtypes; do
        common=(--preset "$preset" $shape --dtype "$dtype" --steps "$steps" --warmup "$warmup")
        profile=()
        # Each round its own file: the report takes the profile of the round whose row it keeps.
        suffix=""
        ((rounds > 1)) && suffix="-round$round"
        [[ $preset == small && $np == 1 ]] && profile=(--profile "$results/profile-$preset-$dtype-level0$suffix.json")
        ztrain "$np" peer "${common[@]}" --system plain --probe
        ztrain "$np" peer "${common[@]}" --level 0 --probe "${profile[@]}"
        for level in 1 2 3; do ztrain "$np" peer "${common[@]}" --level "$level"; done
        peer "$np" peer "${common[@]}" --system ddp
        peer "$np" peer "${common[@]}" --system ddp_zero
        peer "$np" peer "${common[@]}" --system fsdp2
      done
    done
  done
done

# ---- 2-3: memory and bytes sent at 4 ranks (4 ranks on 2 cores: not timed) -------------------
for dtype in $dtypes; do
  for level in 0 1 2 3; do
    ztrain 4 memory --preset small --batch 8 --seq 128 --dtype "$dtype" --level "$level" --steps 2 --warmup 1
  done
done

# ---- the page --------------------------------------------------------------------------------
elapsed=$(($(date +%s) - start))
busy_end=$(cpu_busy_percent)
commit=$(git -C "$root" rev-parse --short HEAD 2>/dev/null || echo unknown)
dirty=false
# changes to the documentation only (this page among them) leave the measured code as committed
[[ -n $(git -C "$root" status --porcelain -- . ':!docs' ':!*.md' 2>/dev/null) ]] && dirty=true
"$python" - "$results/meta.json" <<EOF
import json, subprocess, sys, torch
sys.path.insert(0, "$root/bench")
from report import machine
mpi = subprocess.run(["mpirun", "--version"], capture_output=True, text=True).stdout.splitlines()[0]
json.dump({"date": "$(date -u +%Y-%m-%d\ %H:%M\ UTC)", "commit": "$commit", "dirty": $([[ $dirty == true ]] && echo True || echo False),
           "machine": machine(), "dtypes": "$dtypes".split(), "rounds": $rounds, "busy_start": $busy_start, "busy_end": $busy_end,
           "elapsed_s": $elapsed, "runs": $runs, "quick": bool($quick), "mpi": mpi, "torch_python": torch.__version__},
          open(sys.argv[1], "w"), indent=1)
EOF
echo "run_all: $runs runs in ${elapsed} s; results in $results" >&2
if [[ $docs == yes ]]; then
  "$python" "$root/bench/report.py" --results "$results" --doc "$root/docs/benchmarks.md" --img "$root/docs/img"
fi
if ((all)); then
  section_docs=()
  [[ $docs == yes ]] && section_docs=(--docs)
  "$root/bench/gpt2_peers.sh" "${section_docs[@]}" "$build" 4 2 "$dtypes"
  "$root/bench/growth.sh" --build "$build" "${section_docs[@]}"
  "$root/bench/beyond_memory.sh" --build "$build" "${section_docs[@]}"
fi
