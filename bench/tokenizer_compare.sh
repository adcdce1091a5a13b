#!/usr/bin/env bash
# Usage: bench/tokenizer_compare.sh [--build DIR] [--steps N] [--vocab-size V] [--ranks R]
#
# Bytes against a BPE tokenizer for the same model in the same wall time: trains the small preset
# on the bundled corpus with bytes for N steps (default 300), then with a BPE tokenizer learnt
# from the corpus (vocabulary V, default 4096) for as many steps as fit in the bytes run's wall
# time (measured by a first BPE run of N steps), and prints the validation loss per token and per
# byte of text of each, as a Markdown table. Everything else is the main job's setting (sequence
# 128, batch 8 per rank, ZeRO level 3, R = 2 ranks of one thread each).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
build=$root/build steps=300 vocab=4096 ranks=2
while (($#)); do
  case $1 in
    --build) build=$(realpath -m "$2"); shift 2 ;;
    --steps) steps=$2; shift 2 ;;
    --vocab-size) vocab=$2; shift 2 ;;
    --ranks) ranks=$2; shift 2 ;;
    *) echo "unknown option $1" >&2; exit 2 ;;
  esac
done
gpt=$build/apps/ztrain-gpt/ztrain-gpt
work=$(mktemp -d /tmp/tokenizer_compare.XXXXXX)
trap 'rm -rf "$work"' EXIT
[[ $(id -u) -eq 0 ]] && export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export OMP_NUM_THREADS=1
flags=(--bind-to none)
(( ranks > $(nproc) )) && flags+=(--oversubscribe)
corpus=$root/data/tinyshakespeare.txt

"$gpt" tokenizer train --data "$corpus" --vocab-size "$vocab" --out "$work/tokenizer.json" >/dev/null
# The token file is made before the clock starts, as a later run finds it cached.
"$gpt" tokenizer encode --tokenizer "$work/tokenizer.json" --input "$corpus" >/dev/null

run() {  # run NAME STEPS [ARGS...]: trains, prints "<wall seconds> <val_loss> <val_loss_per_byte>"
  local name=$1 n=$2
  shift 2
  local t0=$(date +%s.%N)
  mpirun -np "$ranks" "${flags[@]}" "$gpt" train --data "$corpus" --preset small --seq 128 --batch 8 --steps "$n" \
    --zero-level 3 --eval-interval "$n" --eval-batches 1000 --token-cache "$work/cache" --out "$work/$name" "$@" \
    > "$work/$name.log"
  local t1=$(date +%s.%N)
  tail -1 "$work/$name/metrics.jsonl" | python3 -c "import json, sys; r = json.load(sys.stdin); \
print(f'{$t1 - $t0:.1f} {r[\"val_loss\"]:.4f} {r[\"val_loss_per_byte\"]:.4f}')"
}

read -r wall_bytes loss_bytes per_byte_bytes < <(run bytes "$steps")
read -r wall_probe _ _ < <(run bpe_probe "$steps" --tokenizer "$work/tokenizer.json")
bpe_steps=$(python3 -c "print(max(1, round($steps * $wall_bytes / $wall_probe)))")
read -r wall_bpe loss_bpe per_byte_bpe < <(run bpe "$bpe_steps" --tokenizer "$work/tokenizer.json")

echo "small preset, sequence 128, batch 8 x $ranks ranks, ZeRO level 3; $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs)"
echo
echo "| tokens | steps | wall (s) | validation loss per token (nats) | per byte of text (nats) |"
echo "|---|---:|---:|---:|---:|"
echo "| bytes (256) | $steps | $wall_bytes | $loss_bytes | $per_byte_bytes |"
echo "| BPE ($vocab, learnt by ztrain-gpt tokenizer train) | $bpe_steps | $wall_bpe | $loss_bpe | $per_byte_bpe |"
