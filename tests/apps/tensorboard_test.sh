#!/usr/bin/env bash
# Usage: tensorboard_test.sh ZTRAIN_GPT PYTHON CORPUS WORKDIR
# ztrain-gpt train --tensorboard writes event files that TensorBoard's reader (PYTHON's tensorboard
# package) reads back, every scalar equal to metrics.jsonl's; a directory it cannot create is an
# error naming it.
set -euo pipefail
gpt=$1 python=$2 corpus=$3 work=$4
here=$(cd "$(dirname "$0")" && pwd)
fail() { echo "tensorboard_test: $*"; exit 1; }
rm -rf "$work" && mkdir -p "$work"
head -c 100000 "$corpus" > "$work/corpus.txt"
"$gpt" train --data "$work/corpus.txt" --preset tiny --seq 32 --batch 4 --steps 6 --eval-interval 3 \
  --eval-batches 2 --out "$work/run" --tensorboard "$work/tb" > "$work/train.log"
"$python" "$here/tensorboard_check.py" "$work/tb" "$work/run/metrics.jsonl"
touch "$work/file"
if "$gpt" train --data "$work/corpus.txt" --preset tiny --steps 1 --out "$work/run2" --tensorboard "$work/file/tb" \
  > "$work/err.log" 2>&1; then fail "an unwritable --tensorboard directory was accepted"; fi
grep -q -- "--tensorboard: cannot write '$work/file/tb/events.out.tfevents" "$work/err.log" \
  || fail "the error does not name the file: $(cat "$work/err.log")"
echo "tensorboard_test: all passed"
