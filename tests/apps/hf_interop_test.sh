#!/usr/bin/env bash
# Usage: hf_interop_test.sh ZTRAIN_GPT PYTHON CORPUS WORKDIR
# Hugging Face transformers (PYTHON's) and ztrain-gpt, both ways: the directory train writes
# loads with GPT2LMHeadModel.from_pretrained and gives ztrain's logits; a model transformers
# made and saved with save_pretrained scores the same loss in ztrain-gpt score; a model trained on a
# BPE tokenizer loads with its tokenizer through AutoTokenizer and scores the same loss.
set -euo pipefail
gpt=$1 python=$2 corpus=$3 work=$4
here=$(cd "$(dirname "$0")" && pwd)
fail() { echo "hf_interop_test: $*"; exit 1; }
rm -rf "$work" && mkdir -p "$work"
head -c 100000 "$corpus" > "$work/corpus.txt"
head -c 3000 "$corpus" | tail -c 1500 > "$work/text.txt"

"$gpt" train --data "$work/corpus.txt" --preset tiny --seq 32 --batch 4 --steps 5 --eval-interval 0 \
  --out "$work/run" > "$work/train.log"
[[ -f $work/run/config.json ]] || fail "train wrote no config.json"
"$gpt" score --model "$work/run/model.safetensors" --input "$work/text.txt" --logits "$work/ours.safetensors" \
  > "$work/score.log"
diff=$("$python" "$here/hf_interop.py" logits "$work/run" "$work/text.txt" "$work/ours.safetensors")
echo "ztrain's model in transformers: logits differ by at most $diff of the largest"
awk -v d="$diff" 'BEGIN { exit !(d <= 1e-5) }' || fail "logits differ by $diff (relative), more than 1e-5"
# The trained directory scores through its config.json as through the file's own metadata.
[[ $("$gpt" score --model "$work/run" --input "$work/text.txt") == $(cat "$work/score.log") ]] \
  || fail "scoring the directory (config.json) differs from scoring the file"

want=$("$python" "$here/hf_interop.py" make "$work/hf" "$work/text.txt")
got=$("$gpt" score --model "$work/hf" --input "$work/text.txt" | sed -n 's/^loss=\([^ ]*\).*/\1/p')
echo "transformers' model: loss $want in transformers, $got in ztrain-gpt"
awk -v a="$want" -v b="$got" 'BEGIN { d = a - b; if (d < 0) d = -d; exit !(d <= 1e-5 * a) }' \
  || fail "ztrain-gpt scores transformers' model $got, transformers $want"

# With a BPE tokenizer: the directory is one that AutoTokenizer reads too, and the loss agrees.
"$gpt" tokenizer train --data "$work/corpus.txt" --vocab-size 512 --out "$work/tokenizer.json" > /dev/null
"$gpt" train --data "$work/corpus.txt" --tokenizer "$work/tokenizer.json" --token-cache "$work/cache" --preset tiny \
  --seq 32 --batch 4 --steps 5 --eval-interval 0 --out "$work/bpe" > "$work/bpe.log"
want=$("$python" "$here/hf_interop.py" tokenized "$work/bpe" "$work/text.txt")
got=$("$gpt" score --model "$work/bpe" --input "$work/text.txt" | sed -n 's/^loss=\([^ ]*\).*/\1/p')
echo "BPE model through AutoTokenizer: loss $want in transformers, $got in ztrain-gpt"
awk -v a="$want" -v b="$got" 'BEGIN { d = a - b; if (d < 0) d = -d; exit !(d <= 1e-5 * a) }' \
  || fail "ztrain-gpt scores the BPE model $got, transformers with AutoTokenizer $want"
echo "hf_interop_test: all passed"
