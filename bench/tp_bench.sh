#!/usr/bin/env bash
# Usage: bench/tp_bench.sh [BUILD_DIR] [PRESET] [STEPS]
#
# Tokens/s of one GPT trained on 2 ranks two ways, side by side in one run: data parallel
# (dp=2, ZeRO levels 0 and 3, 4 sequences per rank) and tensor parallel (tp=2, 8 sequences on
# the one replica). Same global batch, sequence length, model and data; one thread per rank.
# Prints the median tokens/s over the steps after the first five, and the ratios.
set -euo pipefail
build=${1:-build}
preset=${2:-small}
steps=${3:-40}
source "$(dirname "$0")/gpt_bench_common.sh"
gpt_bench_setup tp_bench "$build"
common=(train --data "$root/data/tinyshakespeare.txt" --preset "$preset" --steps "$steps" --eval-interval 0 --warmup 5)

run() {  # run NAME ARGS...
  local name=$1; shift
  mpirun -np 2 --oversubscribe --bind-to none "$gpt" "${common[@]}" --out "$work/$name" "$@" > "$work/$name.log" 2>&1 ||
    { cat "$work/$name.log" >&2; exit 1; }
  median_tokens "$work/$name/metrics.jsonl"
}

echo "GPT preset $preset, 2 ranks x 1 thread, global batch 8 sequences, $steps steps (median after step 5)"
dp0=$(run dp2_z0 --zero-level 0 --batch 4)
dp3=$(run dp2_z3 --zero-level 3 --batch 4)
tp=$(run tp2 --tp 2 --zero-level 0 --batch 8)
printf '%-28s %12s %10s\n' configuration tokens/s "vs dp=2 L0"
printf '%-28s %12s %10s\n' "dp=2, ZeRO level 0" "$dp0" 1.00
printf '%-28s %12s %10.2f\n' "dp=2, ZeRO level 3" "$dp3" "$(python3 -c "print($dp3/$dp0)")"
printf '%-28s %12s %10.2f\n' "tp=2" "$tp" "$(python3 -c "print($tp/$dp0)")"
