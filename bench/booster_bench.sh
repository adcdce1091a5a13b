#!/usr/bin/env bash
# Usage: bench/booster_bench.sh [BUILD_DIR] [PRESET] [STEPS] [BATCH]
#
# The booster's plugins side by side in one run, on the same plain GPT (models::PlainGpt,
# gpt_bench --system booster): DataParallel, LowLevelZero stage 1 and 2, FullyShard, each at 2 and
# 4 ranks with BATCH sequences per rank, fp32, one thread per rank, ztrain's AdamW. Prints a
# markdown table: tokens/s (median step after 3 warm-up steps), the optimizer state and the
# model state (parameters, gradients and optimizer state, zt::memory_stats after the last
# backward) each rank holds, and each rank's peak RSS. LowLevelZero stage 1 also keeps a full
# gradient buffer (4 bytes per parameter in fp32) that its model-state figure leaves out.
set -euo pipefail
build=${1:-build}
preset=${2:-small}
steps=${3:-10}
batch=${4:-4}
root=$(cd "$(dirname "$0")/.." && pwd)
bench=$build/bench/gpt_bench
[[ -x $bench ]] || { echo "booster_bench: $bench not found; build first (scripts/build.sh)" >&2; exit 1; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1
for ranks in 2 4; do
  for plugin in ddp zero1 zero2 fsdp; do
    mpirun -np "$ranks" --oversubscribe --bind-to none "$bench" --system booster --plugin "$plugin" --preset "$preset" \
      --batch "$batch" --steps "$steps" --warmup 3 --data "$root/data/tinyshakespeare.txt" --json "$work/runs.jsonl" \
      > "$work/last.log" 2>&1 || { cat "$work/last.log" >&2; exit 1; }
  done
done
echo "GPT preset $preset (plain modules), fp32, $batch sequences per rank, $steps timed steps, $(nproc --all) cores:" \
  "$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ *//')"
python3 - "$work/runs.jsonl" <<'PY'
import json, sys
runs = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
names = {"ddp": "DataParallel", "zero1": "LowLevelZero stage 1", "zero2": "LowLevelZero stage 2",
         "fsdp": "FullyShard"}
print(f"parameters: {runs[0]['params'] / 1e6:.1f} M\n")
print("| plugin | ranks | tokens/s | optimizer state per rank (MiB) | model state per rank (MiB) "
      "| peak RSS per rank (MiB) |")
print("|---|---|---|---|---|---|")
for r in runs:
    m = r["memory"]
    print(f"| {names[r['plugin']]} | {r['ranks']} | {r['tokens_per_s']:.0f} | {m['optimizer'] / 2**20:.1f} "
          f"| {m['model_state'] / 2**20:.0f} | {m['peak_rss'] / 2**20:.0f} |")
PY
