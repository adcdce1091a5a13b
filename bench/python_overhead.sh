#!/usr/bin/env bash
# What training from Python costs: gpt_bench's GPT stepped by the C++ binary and by the ztrain
# Python package (bench/python_bench.py, the same model, batches and timing), side by side, at
# 1 and 2 ranks and ZeRO levels 0 and 3, one thread per rank. Prints each pair's median step and
# the ratio Python / C++; alternates the two, twice, and keeps each side's best median.
#
#   bench/python_overhead.sh [BUILD_DIR] [options of both, in place of the default
#                            --preset small --batch 4 --seq 128 --steps 10 --warmup 3]
set -euo pipefail
source "$(dirname "$0")/gpt_bench_common.sh"
build=${1:-build}
shift || true
gpt_bench_setup python_overhead "$build"
bench=$build/bench/gpt_bench
python=${ZTRAIN_PYTHON:-$root/.venv/bin/python}
[[ -d $build/python/ztrain ]] || { echo "python_overhead: $build/python/ztrain not found (the package is built with the rest)" >&2; exit 1; }
options=("$@")
((${#options[@]})) || options=(--preset small --batch 4 --seq 128 --steps 10 --warmup 3)
common=(--data "$root/data/tinyshakespeare.txt" "${options[@]}")
mpi=(mpirun --oversubscribe --bind-to none -x OMP_NUM_THREADS -x OPENBLAS_NUM_THREADS -x PYTHONPATH)
export PYTHONPATH=$build/python
lscpu | grep -m1 "Model name" || true
printf '%-6s %-6s %12s %12s %8s\n' ranks level "C++ ms" "Python ms" ratio
for ranks in 1 2; do
  for level in 0 3; do
    for round in 1 2; do
      "${mpi[@]}" -np "$ranks" "$bench" --system ztrain --level "$level" "${common[@]}" --json "$work/cpp-$ranks-$level" > /dev/null
      "${mpi[@]}" -np "$ranks" "$python" "$root/bench/python_bench.py" --level "$level" "${common[@]}" \
        --json "$work/py-$ranks-$level" > /dev/null
    done
    "$python" - "$work/cpp-$ranks-$level" "$work/py-$ranks-$level" "$ranks" "$level" <<'PY'
import json, sys
best = lambda path: min(json.loads(l)["step_s"]["median"] for l in open(path) if l.strip()) * 1000
cpp, py = best(sys.argv[1]), best(sys.argv[2])
print(f"{sys.argv[3]:<6} {sys.argv[4]:<6} {cpp:12.1f} {py:12.1f} {py / cpp:8.3f}")
PY
  done
done
