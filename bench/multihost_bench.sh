#!/usr/bin/env bash
# Usage: bench/multihost_bench.sh [BUILD_DIR]   (as root)
#
# Two hosts of two ranks each, as network namespaces (tests/multihost/hosts.sh), with both
# directions of every host's link limited to 1 and 10 Gbit/s (tc tbf). For each rate, the flat
# ring (ZTRAIN_HIERARCHICAL=0) beside the two-level collectives: the median time of a 64 MiB
# all_reduce, reduce_scatter and all_gather (comm_bench), and the median step of the small GPT at
# ZeRO-3 (gpt_bench, batch 4 x 128 tokens per rank). Prints a Markdown table; takes about 4
# minutes on the 2-core development machine.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
build=$(realpath -m "${1:-$root/build}")
source "$root/tests/multihost/hosts.sh"
hosts_available || { echo "multihost_bench: needs root and network namespaces" >&2; exit 1; }
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS=1
hosts_up 2

median() {  # comm_bench's median time of OP, in ms
  awk -v op="$1" '$1 == "#" && $2 ~ /,$/ { cur = substr($2, 1, length($2) - 1) }
                  cur == op && $1 ~ /^[0-9]+$/ { printf "%.0f", $5 / 1000 }' "$2"
}
echo "| link | collectives | all_reduce 64 MiB | reduce_scatter 64 MiB | all_gather 64 MiB | GPT small, ZeRO-3 step |"
echo "|---|---|---|---|---|---|"
for mbit in 1000 10000; do
  hosts_shape 0 "$mbit"
  hosts_shape 1 "$mbit"
  for mode in 0 1; do
    log=$(mktemp)
    ZTRAIN_HIERARCHICAL=$mode hosts_mpirun 2 -x ZTRAIN_HIERARCHICAL -- "$build/bench/comm_bench" \
      --ops all_reduce,reduce_scatter,all_gather --min-bytes 64MiB --max-bytes 64MiB --target-seconds-per-size 3 \
      --warmup 1 --min-iters 5 > "$log"
    step=$(ZTRAIN_HIERARCHICAL=$mode hosts_mpirun 2 -x ZTRAIN_HIERARCHICAL -- "$build/bench/gpt_bench" \
      --data "$root/data/tinyshakespeare.txt" --preset small --level 3 --batch 4 --seq 128 --steps 12 --warmup 2 |
      tail -1 | sed -E 's/.*"step_s":\{"median":([0-9.]+).*/\1/')
    printf "| %s Gbit/s | %s | %s ms | %s ms | %s ms | %.0f ms |\n" "$((mbit / 1000))" \
      "$( ((mode)) && echo two-level || echo flat ring)" "$(median all_reduce "$log")" \
      "$(median reduce_scatter "$log")" "$(median all_gather "$log")" "$(awk -v s="$step" 'BEGIN { print s * 1000 }')"
    rm -f "$log"
  done
done
