#!/usr/bin/env bash
# Usage: ztrain_gpt_test.sh ZTRAIN_GPT MPIRUN CORPUS WORKDIR
# Trains a tiny GPT on 2 ranks with checkpoints, resumes on 1 rank, runs every subcommand, and
# trains on a BPE tokenizer through the token cache.
set -euo pipefail
gpt=$1 mpirun=$2 corpus=$3 work=$4
rm -rf "$work" && mkdir -p "$work"
head -c 200000 "$corpus" > "$work/corpus.txt"
mp=("$mpirun" --oversubscribe --bind-to none)
common=(--data "$work/corpus.txt" --preset tiny --seq 32 --eval-interval 10 --eval-batches 2 --ckpt-interval 10
        --out "$work/run" --zero-level 3 --recompute)
fail() { echo "ztrain_gpt_test: $*"; exit 1; }

"${mp[@]}" -np 2 "$gpt" train "${common[@]}" --batch 4 --steps 20 | tee "$work/train.log"
[[ -f $work/run/model.safetensors ]] || fail "no model file"
[[ $(cat "$work/run/checkpoints/latest") == step-00000020 ]] || fail "latest does not name step 20"
[[ $(wc -l < "$work/run/metrics.jsonl") -eq 20 ]] || fail "metrics.jsonl should hold 20 steps"

# Resume on 1 rank with the same global batch (8), to step 30.
"${mp[@]}" -np 1 "$gpt" train "${common[@]}" --batch 8 --steps 30 --resume | tee "$work/resume.log"
grep -q "resumed from .*step-00000020 (step 20, saved at 2 ranks)" "$work/resume.log" || fail "did not resume"
[[ $(wc -l < "$work/run/metrics.jsonl") -eq 30 ]] || fail "metrics.jsonl should hold 30 steps"
first=$(head -1 "$work/run/metrics.jsonl" | sed 's/.*"loss":\([0-9.]*\).*/\1/')
last=$(tail -1 "$work/run/metrics.jsonl" | sed 's/.*"loss":\([0-9.]*\).*/\1/')
awk -v a="$first" -v b="$last" 'BEGIN { exit !(b < a - 0.5) }' || fail "loss did not fall: $first -> $last"

"$gpt" eval --model "$work/run/model.safetensors" --data "$work/corpus.txt" --seq 32 --eval-batches 2 --device cpu \
  | grep -q '^val_loss=' || fail "eval printed no val_loss"
"$gpt" eval --model "$work/run/checkpoints/step-00000030" --data "$work/corpus.txt" --seq 32 --eval-batches 2 \
  | grep -q '^val_loss=' || fail "eval of a checkpoint printed no val_loss"
# Validation is shared out over the data-parallel ranks and summed: the 2-rank run's loss at step 20
# is the 1-rank eval of that step's checkpoint, and an odd batch count on 2 ranks (one repeats a
# batch and leaves it out) gives the 1-rank loss.
val_of() { sed -n 's/^val_loss=\([0-9.]*\) .*/\1/p'; }
close() { awk -v a="$1" -v b="$2" 'BEGIN { d = a - b; exit !(a > 0 && d < 1e-5 * a && -d < 1e-5 * a) }'; }
ckpt20=(--model "$work/run/checkpoints/step-00000020" --data "$work/corpus.txt" --seq 32 --batch 4)
trained=$(grep '"step":20,' "$work/run/metrics.jsonl" | sed 's/.*"val_loss":\([0-9.]*\).*/\1/')
alone=$("$gpt" eval "${ckpt20[@]}" --eval-batches 2 | val_of)
close "$trained" "$alone" || fail "validation on 2 ranks ($trained) differs from the 1-rank eval ($alone)"
alone=$("$gpt" eval "${ckpt20[@]}" --eval-batches 3 | val_of)
shared=$("${mp[@]}" -np 2 "$gpt" eval "${ckpt20[@]}" --eval-batches 3 | val_of)
close "$shared" "$alone" || fail "3 validation batches on 2 ranks ($shared) differ from 1 rank ($alone)"
head -c 3000 "$corpus" > "$work/score.txt"
score=$("$gpt" score --model "$work/run/model.safetensors" --input "$work/score.txt")
[[ $score =~ ^loss=([0-9.]+)\ loss_per_byte=([0-9.]+)\ tokens=3000$ ]] || fail "score printed '$score'"
[[ ${BASH_REMATCH[1]} == "${BASH_REMATCH[2]}" ]] || fail "bytes: the loss per byte is the loss per token: $score"
awk -v s="${BASH_REMATCH[1]}" 'BEGIN { exit !(s > 0 && s < 5.0) }' || fail "score out of range: $score"
"$gpt" sample --model "$work/run/model.safetensors" --prompt "ROMEO:" --tokens 40 > "$work/sample.txt"
[[ $(head -c 6 "$work/sample.txt") == ROMEO: ]] || fail "sample does not start with the prompt"

# A BPE tokenizer: trained here, used on 2 ranks through the token cache (written once, then mapped),
# and found beside the model by score and sample.
"$gpt" tokenizer train --data "$work/corpus.txt" --vocab-size 512 --out "$work/tokenizer.json" | grep -q "vocabulary 512" \
  || fail "tokenizer train did not make 512 tokens"
bpe=(--data "$work/corpus.txt" --tokenizer "$work/tokenizer.json" --token-cache "$work/cache" --preset tiny --seq 32
     --batch 4 --steps 10 --eval-interval 10 --eval-batches 2)
"${mp[@]}" -np 2 "$gpt" train "${bpe[@]}" --out "$work/bpe" | tee "$work/bpe.log"
grep -q "validation tokens of $work/tokenizer.json, vocabulary 512" "$work/bpe.log" || fail "the BPE run did not say its tokenizer"
cached=("$work"/cache/*.tokens)
[[ ${#cached[@]} -eq 1 && -f ${cached[0]} ]] || fail "expected one token file in $work/cache"
stamp=$(stat -c %Y.%s "${cached[0]}")
"${mp[@]}" -np 2 "$gpt" train "${bpe[@]}" --out "$work/bpe2" > "$work/bpe2.log"
[[ $(stat -c %Y.%s "${cached[0]}") == "$stamp" ]] || fail "the token file was written again"
cmp -s <(grep -o '"loss":[0-9.]*' "$work/bpe/metrics.jsonl") <(grep -o '"loss":[0-9.]*' "$work/bpe2/metrics.jsonl") \
  || fail "a run on the cached tokens differs from the run that made them"
grep -q '"val_loss_per_byte"' "$work/bpe/metrics.jsonl" || fail "no val_loss_per_byte in metrics.jsonl"
[[ -f $work/bpe/tokenizer.json ]] || fail "train did not copy the tokenizer beside the model"
score=$("$gpt" score --model "$work/bpe/model.safetensors" --input "$work/score.txt")
[[ $score =~ tokens=([0-9]+)$ ]] && (( BASH_REMATCH[1] < 2000 )) || fail "score did not use the BPE tokenizer: $score"
"$gpt" sample --model "$work/bpe/model.safetensors" --prompt "ROMEO:" --tokens 20 > "$work/bpe_sample.txt"
[[ $(head -c 6 "$work/bpe_sample.txt") == ROMEO: ]] || fail "BPE sample does not start with the prompt"

# The same GPT in plain modules through the Booster's plugins: each run's losses equal the ZeRO
# engine's (level 3 with recomputation: the 20 steps of the first run above, same seed, data and
# schedule);
# a FullyShard checkpoint resumes under LowLevelZero; the plugin's model file evaluates.
losses() { grep -o '"loss":[0-9.e-]*' "$1" | head -20 | cut -d: -f2; }
# The first 20 losses of metrics files $1 and $2 agree within 1e-4 relative.
same_losses() {
  paste <(losses "$1") <(losses "$2") | awk '
    { n++; d = $1 - $2; if (d < 0) d = -d; if (d > 1e-4 * $2) { print "step " n ": " $1 " vs " $2; bad = 1 } }
    END { exit bad || n != 20 }'
}
plain=(--data "$work/corpus.txt" --preset tiny --seq 32 --eval-interval 10 --eval-batches 2 --ckpt-interval 10 --recompute)
for plugin in ddp zero2 fsdp; do
  "${mp[@]}" -np 2 "$gpt" train "${plain[@]}" --plugin "$plugin" --batch 4 --steps 20 --out "$work/plugin_$plugin" \
    > "$work/plugin_$plugin.log" 2>&1 || fail "--plugin $plugin: $(tail -3 "$work/plugin_$plugin.log")"
  grep -q "plugin .*($plugin)" "$work/plugin_$plugin.log" || fail "--plugin $plugin: the run does not say its plugin"
  same_losses "$work/plugin_$plugin/metrics.jsonl" "$work/run/metrics.jsonl" \
    || fail "--plugin $plugin: the losses differ from the engine's"
done
# HybridParallel at tp 2 with ZeRO-2 gives the engine's losses at tp 2 with ZeRO-2.
for way in engine hybrid; do
  extra=(--zero-level 2); [[ $way == hybrid ]] && extra+=(--plugin hybrid)
  "${mp[@]}" -np 2 "$gpt" train "${plain[@]}" --tp 2 "${extra[@]}" --batch 4 --steps 20 --out "$work/tp_$way" \
    > "$work/tp_$way.log" 2>&1 || fail "--tp 2 ($way): $(tail -3 "$work/tp_$way.log")"
done
grep -q "plugin HybridParallel (hybrid, ZeRO level 2)" "$work/tp_hybrid.log" || fail "--plugin hybrid does not say so"
same_losses "$work/tp_hybrid/metrics.jsonl" "$work/tp_engine/metrics.jsonl" \
  || fail "--plugin hybrid --tp 2: the losses differ from the engine's at --tp 2"
"${mp[@]}" -np 2 "$gpt" train "${plain[@]}" --plugin zero2 --batch 4 --steps 22 --resume --out "$work/plugin_fsdp" \
  > "$work/plugin_resume.log" 2>&1 \
  || fail "resuming a FullyShard checkpoint under LowLevelZero: $(tail -3 "$work/plugin_resume.log")"
grep -q "resumed from .*step-00000020 (step 20" "$work/plugin_resume.log" || fail "--plugin zero2 did not resume at step 20"
"$gpt" eval --model "$work/plugin_fsdp/model.safetensors" --data "$work/corpus.txt" --seq 32 --eval-batches 2 \
  | grep -q '^val_loss=' || fail "eval of a --plugin model printed no val_loss"
if "${mp[@]}" -np 2 "$gpt" train --data "$work/corpus.txt" --preset tiny --plugin fsdp --tp 2 --steps 1 \
  > "$work/err_plugin.log" 2>&1; then
  fail "--plugin with --tp accepted"
fi
grep -q -- "--plugin fsdp is data parallel only" "$work/err_plugin.log" || fail "the --plugin --tp error: $(cat "$work/err_plugin.log")"

# A corpus that takes longer to tokenize than the communication deadline: the other rank waits
# for it (its deadline grows with the corpus) instead of taking the first rank for dead.
mkdir -p "$work/big"
for i in 1 2 3 4 5 6; do cp "$corpus" "$work/big/part$i.txt"; done
"$gpt" tokenizer train --kind sentencepiece-bpe --data "$work/corpus.txt" --vocab-size 600 --out "$work/sp.model" > /dev/null
t0=$(date +%s.%N)
ZTRAIN_TIMEOUT_S=1 "${mp[@]}" -np 2 "$gpt" train --data "$work/big" --tokenizer "$work/sp.model" --token-cache "$work/cache" \
  --preset tiny --seq 32 --batch 2 --steps 1 --eval-interval 0 --out "$work/big_run" > "$work/big.log" 2>&1 \
  || fail "tokenizing a large corpus failed: $(tail -5 "$work/big.log")"
echo "tokenized $(du -sh "$work/big" | cut -f1) while a rank waited with a 1 s deadline: $(python3 -c "import time; print(f'{time.time() - $t0:.1f}')") s"

# An error one rank meets alone (rank 0 cannot make --out, a file) ends the whole job at once,
# not when the other rank's 120 s deadline runs out.
touch "$work/a_file"
t0=$(date +%s)
if ZTRAIN_TIMEOUT_S=120 "${mp[@]}" -np 2 "$gpt" train --data "$work/corpus.txt" --preset tiny --seq 32 --batch 2 \
  --steps 1 --out "$work/a_file" > "$work/alone.log" 2>&1; then
  fail "--out naming a file accepted"
fi
(( $(date +%s) - t0 < 60 )) || fail "an error on rank 0 alone left the job running for $(( $(date +%s) - t0 )) s"
grep -q "a_file" "$work/alone.log" || fail "the --out error does not name it: $(cat "$work/alone.log")"

if "$gpt" train --data "$work/missing.txt" --preset tiny --steps 1 > "$work/err1.log" 2>&1; then fail "missing data accepted"; fi
grep -q "missing.txt" "$work/err1.log" || fail "the missing-data error does not name the file: $(cat "$work/err1.log")"
if "$gpt" train --data "$work/corpus.txt" --preset tiny --zero-level 5 > "$work/err2.log" 2>&1; then fail "zero level 5 accepted"; fi
grep -qi "zero-level" "$work/err2.log" || fail "the zero-level error does not name the option: $(cat "$work/err2.log")"
if "$gpt" score --model "$work/corpus.txt" --input "$work/score.txt" > "$work/err3.log" 2>&1; then fail "a text file loaded as a model"; fi
grep -q "corpus.txt" "$work/err3.log" || fail "the bad-model error does not name the file: $(cat "$work/err3.log")"
if "$gpt" score --model "$work/run/model.safetensors" --input "$work/score.txt" --device tpu > "$work/err4.log" 2>&1; then
  fail "device tpu accepted"
fi
grep -q -- "--device: 'tpu' is not a device; use cpu, cuda or cuda:N" "$work/err4.log" \
  || fail "the bad-device error does not name the forms: $(cat "$work/err4.log")"
if "$gpt" score --model "$work/run/model.safetensors" --input "$work/score.txt" --device cuda:99 > "$work/err5.log" 2>&1; then
  fail "device cuda:99 accepted"
fi
grep -q "cuda:99" "$work/err5.log" || fail "the missing-device error does not name it: $(cat "$work/err5.log")"
if "$gpt" train --data "$work/corpus.txt" --tokenizer "$work/none.json" --preset tiny --steps 1 > "$work/err6.log" 2>&1; then
  fail "a missing tokenizer accepted"
fi
grep -q "cannot open tokenizer file '$work/none.json'" "$work/err6.log" || fail "the tokenizer error does not name it: $(cat "$work/err6.log")"
mkdir -p "$work/moved/a/b" && cp "$work/bpe/model.safetensors" "$work/moved/a/b/"
if "$gpt" score --model "$work/moved/a/b/model.safetensors" --input "$work/score.txt" > "$work/err7.log" 2>&1; then
  fail "a BPE model scored without its tokenizer"
fi
grep -q "trained with the tokenizer tokenizer.json, which is not beside it; pass --tokenizer" "$work/err7.log" \
  || fail "the lost-tokenizer error does not say what to do: $(cat "$work/err7.log")"
if "$gpt" train "${common[@]}" --batch 8 --steps 31 --resume --tokenizer "$work/tokenizer.json" > "$work/err8.log" 2>&1; then
  fail "a byte-level checkpoint resumed with a BPE tokenizer"
fi
grep -q "was trained on bytes (vocabulary 256), this run uses tokenizer.json (vocabulary 512)" "$work/err8.log" \
  || fail "the tokenizer-mismatch error does not say both: $(cat "$work/err8.log")"

# A damaged checkpoint: every reader names the file, and --resume falls back to the newest one that
# verifies, saying which it skipped.
ckpt=$work/run/checkpoints/step-00000030
printf '\x55' | dd of="$ckpt/model.safetensors" bs=1 seek=20000 count=1 conv=notrunc status=none
if "$gpt" eval --model "$ckpt" --data "$work/corpus.txt" --seq 32 --eval-batches 2 > "$work/err9.log" 2>&1; then
  fail "a damaged checkpoint evaluated"
fi
grep -q "'$ckpt/model.safetensors' is corrupt" "$work/err9.log" || fail "eval of a damaged checkpoint: $(cat "$work/err9.log")"
"${mp[@]}" -np 2 "$gpt" train "${common[@]}" --batch 4 --steps 31 --resume > "$work/fallback.log" 2>&1 \
  || fail "resume past a damaged checkpoint failed: $(tail -3 "$work/fallback.log")"
grep -q "skipped checkpoint $ckpt: checkpoint: '$ckpt/model.safetensors' is corrupt" "$work/fallback.log" \
  || fail "resume did not say which checkpoint it skipped: $(head -3 "$work/fallback.log")"
grep -q "resumed from .*step-00000020 (step 20" "$work/fallback.log" || fail "resume did not fall back to step 20"
echo "ztrain_gpt_test: all passed"
