#!/usr/bin/env bash
# Usage: ztrain_gpt_resume_test.sh ZTRAIN_GPT MPIRUN CORPUS WORKDIR
# ztrain-gpt across world sizes and crashes:
#  - 1 rank and 4 ranks (ZeRO-3, same global batch) give the same losses over 50 steps;
#  - a rank killed during training, and one killed inside a checkpoint save: --resume continues
#    from the last complete checkpoint and the losses equal an uninterrupted run bit for bit;
#  - a checkpoint from 4 ranks resumes on 2;
#  - tensor parallelism: tp=2 gives the 1-rank losses, and its checkpoint resumes at tp=1;
#  - pipeline parallelism: pp=2 gives the 1-rank losses, and its checkpoint resumes at pp=1 and
#    at pp=4 with the interleaved schedule;
#  - bad input fails clearly and leaves earlier checkpoints usable; a damaged checkpoint is skipped
#    for the one before, and none that verifies is refused.
set -uo pipefail
gpt=$1 mpirun=$2 corpus=$3 work=$4
rm -rf "$work" && mkdir -p "$work"
head -c 100000 "$corpus" > "$work/corpus.txt"
mp=("$mpirun" --oversubscribe --bind-to none)
common=(--data "$work/corpus.txt" --preset tiny --seq 32 --eval-interval 0 --zero-level 3 --warmup 5)
fail() { echo "ztrain_gpt_resume_test: $*"; exit 1; }
losses() {  # step -> loss of the last record of each step, as JSON text (exact)
  python3 -c '
import json, sys
last = {}
for line in open(sys.argv[1]):
    if line.strip():
        r = json.loads(line); last[r["step"]] = repr(r["loss"])
print(json.dumps(last))' "$1"
}
compare() {  # compare FILE_A FILE_B FIRST LAST RTOL
  python3 -c '
import json, sys
a, b = json.loads(sys.argv[1]), json.loads(sys.argv[2])
first, last, rtol = int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5])
for s in range(first, last + 1):
    x, y = float(a[str(s)]), float(b[str(s)])
    ok = (a[str(s)] == b[str(s)]) if rtol == 0 else abs(x - y) <= rtol * abs(y)
    if not ok: sys.exit(f"step {s}: {a[str(s)]} vs {b[str(s)]}")
print(f"steps {first}-{last} agree (rtol {rtol})")' "$(losses "$1")" "$(losses "$2")" "$3" "$4" "$5"
}
quiet() { "$@" > "$work/last.log" 2>&1; }

# 1 rank vs 4 ranks, global batch 8.
quiet "${mp[@]}" -np 1 "$gpt" train "${common[@]}" --batch 8 --steps 50 --out "$work/np1" || fail "np1 run failed"
quiet "${mp[@]}" -np 4 "$gpt" train "${common[@]}" --batch 2 --steps 50 --out "$work/np4" || fail "np4 run failed"
compare "$work/np4/metrics.jsonl" "$work/np1/metrics.jsonl" 1 50 1e-5 || fail "1 and 4 ranks disagree"

# The uninterrupted reference, 2 ranks.
ck=(--ckpt-interval 10 --keep-last 0)
quiet "${mp[@]}" -np 2 "$gpt" train "${common[@]}" "${ck[@]}" --batch 4 --steps 30 --out "$work/ref" || fail "reference failed"

# Killed during training at step 25: resume from step 20.
if ZTRAIN_GPT_KILL=step:25:1 quiet "${mp[@]}" -np 2 "$gpt" train "${common[@]}" "${ck[@]}" --batch 4 --steps 30 --out "$work/kill"; then
  fail "the killed run succeeded"
fi
[[ $(cat "$work/kill/checkpoints/latest") == step-00000020 ]] || fail "latest is not step 20 after the kill"
quiet "${mp[@]}" -np 2 "$gpt" train "${common[@]}" "${ck[@]}" --batch 4 --steps 30 --out "$work/kill" --resume || fail "resume failed"
grep -q "resumed from .*step-00000020" "$work/last.log" || fail "did not resume from step 20"
compare "$work/kill/metrics.jsonl" "$work/ref/metrics.jsonl" 21 30 0 || fail "resumed losses differ"

# Killed inside the save of step 20: the temporary is left, step 10 stays the latest.
if ZTRAIN_GPT_KILL=save:20:0 quiet "${mp[@]}" -np 2 "$gpt" train "${common[@]}" "${ck[@]}" --batch 4 --steps 30 --out "$work/save"; then
  fail "the run killed in a save succeeded"
fi
[[ $(cat "$work/save/checkpoints/latest") == step-00000010 ]] || fail "latest moved during a killed save"
[[ ! -d $work/save/checkpoints/step-00000020 ]] || fail "a half-written checkpoint was published"
quiet "${mp[@]}" -np 2 "$gpt" train "${common[@]}" "${ck[@]}" --batch 4 --steps 30 --out "$work/save" --resume || fail "resume after a killed save failed"
grep -q "resumed from .*step-00000010" "$work/last.log" || fail "did not resume from step 10"
compare "$work/save/metrics.jsonl" "$work/ref/metrics.jsonl" 11 30 0 || fail "losses after a killed save differ"

# A checkpoint of 4 ranks resumes on 2 (global batch 8 both times) and continues like the 4-rank run.
quiet "${mp[@]}" -np 4 "$gpt" train "${common[@]}" "${ck[@]}" --batch 2 --steps 20 --out "$work/x4" || fail "4-rank run failed"
mkdir -p "$work/x2/checkpoints" && cp -r "$work/x4/checkpoints/step-00000010" "$work/x2/checkpoints/"
quiet "${mp[@]}" -np 2 "$gpt" train "${common[@]}" "${ck[@]}" --batch 4 --steps 20 --out "$work/x2" --resume || fail "2-rank resume failed"
grep -q "resumed from .*step-00000010 (step 10, saved at 4 ranks)" "$work/last.log" || fail "did not resume the 4-rank checkpoint"
compare "$work/x2/metrics.jsonl" "$work/x4/metrics.jsonl" 11 20 1e-5 || fail "2-rank continuation differs from the 4-rank run"

# Tensor parallelism: tp=2 on 2 ranks (dp 1, global batch 8) follows the 1-rank run; its
# checkpoint resumes on 1 rank without tp and continues like the tp=2 run.
quiet "${mp[@]}" -np 2 "$gpt" train "${common[@]}" "${ck[@]}" --tp 2 --batch 8 --steps 50 --out "$work/tp2" || fail "tp=2 run failed"
compare "$work/tp2/metrics.jsonl" "$work/np1/metrics.jsonl" 1 50 1e-5 || fail "tp=2 differs from 1 rank"
mkdir -p "$work/tp1/checkpoints" && cp -r "$work/tp2/checkpoints/step-00000030" "$work/tp1/checkpoints/"
quiet "$gpt" train "${common[@]}" "${ck[@]}" --batch 8 --steps 50 --out "$work/tp1" --resume || fail "tp=1 resume failed"
grep -q "resumed from .*step-00000030" "$work/last.log" || fail "did not resume the tp=2 checkpoint"
compare "$work/tp1/metrics.jsonl" "$work/tp2/metrics.jsonl" 31 50 1e-5 || fail "tp=1 continuation differs from the tp=2 run"

# Pipeline parallelism: 2 stages, 4 micro-batches of 2 (global batch 8) follow the 1-rank run;
# the step-30 checkpoint resumes on 1 rank, and on 4 stages with the interleaved schedule.
quiet "${mp[@]}" -np 2 "$gpt" train "${common[@]}" "${ck[@]}" --pp 2 --micro-batches 4 --batch 2 --steps 50 --out "$work/pp2" || fail "pp=2 run failed"
compare "$work/pp2/metrics.jsonl" "$work/np1/metrics.jsonl" 1 50 1e-5 || fail "pp=2 differs from 1 rank"
mkdir -p "$work/pp1/checkpoints" && cp -r "$work/pp2/checkpoints/step-00000030" "$work/pp1/checkpoints/"
quiet "$gpt" train "${common[@]}" "${ck[@]}" --batch 2 --grad-accum 4 --steps 50 --out "$work/pp1" --resume || fail "pp=1 resume failed"
grep -q "resumed from .*step-00000030" "$work/last.log" || fail "did not resume the pp=2 checkpoint"
compare "$work/pp1/metrics.jsonl" "$work/pp2/metrics.jsonl" 31 50 1e-5 || fail "pp=1 continuation differs from the pp=2 run"
mkdir -p "$work/pp4/checkpoints" && cp -r "$work/pp2/checkpoints/step-00000030" "$work/pp4/checkpoints/"
quiet "${mp[@]}" -np 4 "$gpt" train "${common[@]}" "${ck[@]}" --pp 4 --micro-batches 4 --batch 2 --schedule interleaved --steps 50 --out "$work/pp4" --resume || fail "pp=4 resume failed"
compare "$work/pp4/metrics.jsonl" "$work/pp2/metrics.jsonl" 31 50 1e-5 || fail "pp=4 continuation differs from the pp=2 run"

# Bad input: clear errors, checkpoints untouched.
expect_error() {  # expect_error PATTERN command...
  local pattern=$1; shift
  if "$@" > "$work/err.log" 2>&1; then fail "accepted: $*"; fi
  grep -q -- "$pattern" "$work/err.log" || fail "error for '$*' lacks '$pattern': $(head -3 "$work/err.log")"
}
: > "$work/empty.txt"
expect_error "empty" "$gpt" train --data "$work/empty.txt" --preset tiny --steps 1 --out "$work/bad"
expect_error "exceeds the model's context 64" "$gpt" train --data "$work/corpus.txt" --preset tiny --seq 65 --steps 1 --out "$work/bad"
expect_error "n_head (2) is not divisible by the tensor-parallel size (4)" "${mp[@]}" -np 4 "$gpt" train --data "$work/corpus.txt" --preset tiny --tp 4 --steps 1 --out "$work/bad"
expect_error "does not divide the world size 3" "${mp[@]}" -np 3 "$gpt" train --data "$work/corpus.txt" --preset tiny --tp 2 --steps 1 --out "$work/bad"
expect_error "needs --pp > 1" "$gpt" train --data "$work/corpus.txt" --preset tiny --micro-batches 4 --steps 1 --out "$work/bad"
expect_error "does not divide the world size 3" "${mp[@]}" -np 3 "$gpt" train --data "$work/corpus.txt" --preset tiny --pp 2 --steps 1 --out "$work/bad"
expect_error "unknown GPT preset 'huge'" "$gpt" train --data "$work/corpus.txt" --preset huge --steps 1 --out "$work/bad"
expect_error "shape" "$gpt" train "${common[@]}" "${ck[@]}" --d-model 32 --heads 2 --batch 8 --steps 40 --out "$work/ref" --resume
# A checkpoint without some stage's layers fails on every stage (not only the one missing them).
expect_error "has no tensor 'transformer.h.2" "${mp[@]}" -np 2 "$gpt" train "${common[@]}" "${ck[@]}" --pp 2 --micro-batches 2 --batch 4 --layers 4 --steps 40 --out "$work/ref" --resume
# A damaged newest checkpoint: --resume names it and continues from the one before.
printf 'x' | dd of="$work/ref/checkpoints/step-00000030/model.safetensors" bs=1 seek=100 conv=notrunc status=none
quiet "$gpt" train "${common[@]}" "${ck[@]}" --batch 8 --steps 31 --out "$work/ref" --resume || fail "resume past a damaged checkpoint failed"
grep -q "skipped checkpoint .*step-00000030: checkpoint: '.*step-00000030/model.safetensors' is corrupt" "$work/last.log" \
  || fail "resume did not name the damaged checkpoint: $(head -3 "$work/last.log")"
grep -q "resumed from .*step-00000020" "$work/last.log" || fail "resume did not fall back to step 20"
# None that verifies: refused, nothing started over.
for d in "$work"/ref/checkpoints/step-*; do printf 'x' | dd of="$d/rng.safetensors" bs=1 seek=10 conv=notrunc status=none; done
before=$(ls "$work/ref/checkpoints")
expect_error "checkpoints under $work/ref/checkpoints verifies" "$gpt" train "${common[@]}" "${ck[@]}" --batch 8 --steps 40 --out "$work/ref" --resume
[[ $(ls "$work/ref/checkpoints") == "$before" ]] || fail "a refused resume changed the checkpoints"
echo "ztrain_gpt_resume_test: all passed"
