#!/usr/bin/env bash
# Usage: tokenizer_test.sh ZTRAIN_GPT PYTHON CORPUS WORKDIR
# ztrain-gpt's tokenizers against Hugging Face tokenizers and sentencepiece (PYTHON's, test
# references only) on the corpus and on a text of mixed scripts and emoji (tokenizer_check.py),
# and clear errors for tokenizer files it cannot read.
set -euo pipefail
gpt=$1 python=$2 corpus=$3 work=$4
here=$(cd "$(dirname "$0")" && pwd)
fail() { echo "tokenizer_test: $*"; exit 1; }
rm -rf "$work" && mkdir -p "$work"
"$python" "$here/tokenizer_check.py" "$gpt" "$work" "$corpus" "$here/data/mixed_scripts.txt"

# Bad input: each error names the file and what is wrong.
expect_error() {  # expect_error PATTERN ARGS...
  local pattern=$1 out
  shift
  if out=$("$gpt" "$@" 2>&1); then fail "ztrain-gpt $* succeeded"; fi
  grep -q -- "$pattern" <<<"$out" || fail "ztrain-gpt $*: expected '$pattern' in: $out"
}
echo "text" > "$work/text.txt"
expect_error "cannot open tokenizer file '$work/missing.json'" tokenizer encode --tokenizer "$work/missing.json" --input "$work/text.txt"
"$python" - "$work/gpt2.json" "$work/nfc.json" "$work/wordpiece.json" <<'PY'
import json, sys
j = json.load(open(sys.argv[1]))
json.dump(dict(j, normalizer={"type": "NFC"}), open(sys.argv[2], "w"))
json.dump(dict(j, model=dict(j["model"], type="WordPiece")), open(sys.argv[3], "w"))
PY
expect_error "nfc.json': normalizers are not supported" tokenizer encode --tokenizer "$work/nfc.json" --input "$work/text.txt"
expect_error "only BPE models are supported" tokenizer encode --tokenizer "$work/wordpiece.json" --input "$work/text.txt"
head -c 100 "$work/gpt2.json" > "$work/truncated.json"
expect_error "truncated.json' is not a tokenizer.json" tokenizer encode --tokenizer "$work/truncated.json" --input "$work/text.txt"
expect_error "text.txt' is not a SentencePiece model" tokenizer encode --tokenizer "$work/text.txt" --input "$work/text.txt"
expect_error "vocab-size must be at least 257" tokenizer train --data "$work/text.txt" --vocab-size 100 --out "$work/x.json"
echo "tokenizer_test: OK"
