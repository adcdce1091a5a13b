#!/usr/bin/env bash
# Usage: gpt_file_test.sh ZTRAIN_GPT PYTHON MPIEXEC CORPUS WORKDIR
# A model trained from Python (transformers' GPT2LMHeadModel under the Booster, 2 ranks) and saved
# with ztrain.save scores in ztrain-gpt with the logits Python computed; a model ztrain-gpt train
# wrote loads into the boosted Python model (2 ranks) and computes ztrain-gpt's logits.
set -euo pipefail
gpt=$1 python=$2 mpirun=$3 corpus=$4 work=$5
here=$(cd "$(dirname "$0")" && pwd)
fail() { echo "gpt_file_test: $*"; exit 1; }
mp=("$mpirun" -np 2 --oversubscribe --bind-to none)
rm -rf "$work" && mkdir -p "$work"
head -c 100000 "$corpus" > "$work/corpus.txt"
head -c 3000 "$corpus" | tail -c 1500 > "$work/text.txt"

"${mp[@]}" "$python" "$here/gpt_file.py" save "$work/py.safetensors" "$work/text.txt" "$work/py_logits.safetensors"
"$gpt" score --model "$work/py.safetensors" --input "$work/text.txt" --logits "$work/gpt_logits.safetensors" \
  > "$work/score.log"
diff=$("$python" "$here/gpt_file.py" compare "$work/gpt_logits.safetensors" "$work/py_logits.safetensors")
echo "a file saved from Python in ztrain-gpt: logits differ by at most $diff of the largest ($(cat "$work/score.log"))"
awk -v d="$diff" 'BEGIN { exit !(d <= 1e-5) }' || fail "logits differ by $diff (relative), more than 1e-5"

"$gpt" train --data "$work/corpus.txt" --preset tiny --seq 32 --batch 4 --steps 5 --eval-interval 0 \
  --out "$work/run" > "$work/train.log"
"$gpt" score --model "$work/run/model.safetensors" --input "$work/text.txt" --logits "$work/run_logits.safetensors" \
  > /dev/null
diff=$("${mp[@]}" "$python" "$here/gpt_file.py" load "$work/run/model.safetensors" "$work/text.txt" \
  "$work/run_logits.safetensors")
echo "ztrain-gpt's file in Python: logits differ by at most $diff of the largest"
awk -v d="$diff" 'BEGIN { exit !(d <= 1e-5) }' || fail "logits differ by $diff (relative), more than 1e-5"
