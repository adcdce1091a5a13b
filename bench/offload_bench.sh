#!/usr/bin/env bash
# Usage: bench/offload_bench.sh [BUILD_DIR] [REPEATS]
#
# What AdamOffload's overlap buys: tokens/s of one GPT trained on 1 rank with one compute
# thread (so a second core is free for the update thread), AdamW against AdamOffload, runs
# alternating, REPEATS each. Small batches make the optimizer step a large part of the step.
# Also checks that both give the same losses.
set -euo pipefail
build=${1:-build}
repeats=${2:-3}
source "$(dirname "$0")/gpt_bench_common.sh"
gpt_bench_setup offload_bench "$build"
args=(train --data "$root/data/tinyshakespeare.txt" --preset small --d-model 512 --context 64 --seq 32 --batch 2
      --steps 60 --eval-interval 0 --zero-level 0)

declare -a adamw offload
for ((i = 0; i < repeats; i++)); do
  "$gpt" "${args[@]}" --out "$work/adamw$i" > "$work/log" 2>&1 || { cat "$work/log" >&2; exit 1; }
  adamw+=("$(median_tokens "$work/adamw$i/metrics.jsonl")")
  "$gpt" "${args[@]}" --offload --out "$work/offload$i" > "$work/log" 2>&1 || { cat "$work/log" >&2; exit 1; }
  offload+=("$(median_tokens "$work/offload$i/metrics.jsonl")")
  cmp -s <(python3 -c 'import json,sys; [print(json.loads(l)["loss"]) for l in open(sys.argv[1])]' "$work/adamw$i/metrics.jsonl") \
         <(python3 -c 'import json,sys; [print(json.loads(l)["loss"]) for l in open(sys.argv[1])]' "$work/offload$i/metrics.jsonl") ||
    { echo "offload_bench: AdamOffload's losses differ from AdamW's" >&2; exit 1; }
done
med() { printf '%s\n' "$@" | sort -n | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'; }
a=$(med "${adamw[@]}") o=$(med "${offload[@]}")
echo "GPT 4 x 512 (12.9M parameters), 64 tokens per step, 1 rank x 1 compute thread, 60 steps, $repeats runs each"
echo "losses identical in every run"
printf '%-12s %10s   runs: %s\n' AdamW "$a" "${adamw[*]}"
printf '%-12s %10s   runs: %s\n' AdamOffload "$o" "${offload[*]}"
python3 -c "print(f'AdamOffload / AdamW: {$o/$a:.2f}')"
