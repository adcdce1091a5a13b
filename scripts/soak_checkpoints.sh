#!/usr/bin/env bash
# Usage: scripts/soak_checkpoints.sh [--trials N] [--build DIR]
#
# Checkpoints under faults, with ztrain-gpt on 2 ranks saving a checkpoint every step, each part
# bounded in count and time:
#  1. kill -9: N trials (default 30) each kill a random rank at a random moment inside a save (the
#     first save to start 1-3 s into a run of the small preset, plus 0-15 ms; a save writes 50 MB);
#     then the newest complete checkpoint must verify and evaluate, no step directory without a
#     manifest may exist (a partial checkpoint is never published), and --resume must continue.
#  2. a full disk: the checkpoints go to a 3 MiB tmpfs that holds two; the save that does not fit
#     must fail with an error naming the file and "No space left", and the earlier checkpoints
#     must still verify.
#  3. damage: in each file kind of a checkpoint (model, optimizer and rng safetensors, the
#     manifest), 20 flips of a random bit and a truncation each; `ztrain-gpt eval` of the
#     checkpoint must fail naming the damaged file.
# Prints one line per part with its counts and exits non-zero on the first outcome that differs.
# Needs root for the tmpfs (part 2 is skipped, and says so, without it).
set -uo pipefail
shopt -s nullglob
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
trials=30 build=$root/build
while (($#)); do
  case $1 in
    --trials) trials=$2; shift 2 ;;
    --build) build=$(realpath -m "$2"); shift 2 ;;
    *) echo "unknown option $1" >&2; exit 2 ;;
  esac
done
gpt=$build/apps/ztrain-gpt/ztrain-gpt
work=$(mktemp -d /tmp/soak_checkpoints.XXXXXX)
disk=$work/disk
cleanup() { mountpoint -q "$disk" 2>/dev/null && umount "$disk"; rm -rf "$work"; }
trap cleanup EXIT
[[ $(id -u) -eq 0 ]] && export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export OMP_NUM_THREADS=1 ZTRAIN_TIMEOUT_S=20
fail() { echo "soak_checkpoints: $*"; exit 1; }
head -c 100000 "$root/data/tinyshakespeare.txt" > "$work/corpus.txt"
train=(--data "$work/corpus.txt" --eval-interval 0 --zero-level 3 --ckpt-interval 1)
tiny=(--preset tiny --seq 32 --batch 2)  # the disk and damage parts
run() { timeout 120 mpirun -np 2 --oversubscribe --bind-to none "$gpt" train "${train[@]}" "$@"; }
evaluates() { timeout 60 "$gpt" eval --model "$1" --data "$work/corpus.txt" --seq 16 --eval-batches 1 > "$work/eval.log" 2>&1; }
saving=(--preset small --seq 16 --batch 1 --keep-last 3)  # the kill trials: saves dominate

# ---- 1. kill -9 at random moments ------------------------------------------------------------------
in_save=0 resumed=0 before_first=0
for ((t = 1; t <= trials; ++t)); do
  out=$work/kill$t
  run --steps 100000 "${saving[@]}" --out "$out" > "$out.log" 2>&1 &
  launcher=$!
  sleep "$(python3 -c "import random; print(round(random.uniform(1.0, 3.0), 2))")"
  pids=($(pgrep -f "^$gpt train .*--out $out\$" || true))  # the ranks, not mpirun or timeout
  ((${#pids[@]})) || { wait "$launcher"; fail "trial $t: no rank running ($(tail -2 "$out.log"))"; }
  victim=${pids[RANDOM % ${#pids[@]}]}
  delay=$(python3 -c "import random; print(round(random.uniform(0, 0.015), 4))")
  # Then the next save: wait (5 s at most) for its temporary directory, and the random delay more.
  for ((poll = 0; poll < 1000; ++poll)); do
    tmp=("$out"/checkpoints/.step-*.tmp-*)
    ((${#tmp[@]})) && break
    sleep 0.005
  done
  sleep "$delay"
  kill -9 "$victim"
  wait "$launcher" && fail "trial $t: the run survived kill -9"
  # A temporary checkpoint directory left behind: the kill fell inside a save.
  ls -a "$out/checkpoints" 2>/dev/null | grep -q '^\.step-.*\.tmp' && ((++in_save))
  pgrep -f "^$gpt train .*--out $out\$" > /dev/null && fail "trial $t: a rank outlived the job"
  for d in "$out"/checkpoints/step-*; do
    [[ -f $d/manifest.json ]] || fail "trial $t: $d was published without a manifest"
  done
  published=("$out"/checkpoints/step-*)
  ((${#published[@]})) || { ((++before_first)); continue; }  # killed before the first save
  newest=${published[-1]}  # the glob sorts; step numbers have a fixed width
  evaluates "$newest" || fail "trial $t: the newest checkpoint $newest does not evaluate: $(cat "$work/eval.log")"
  step=$((10#${newest##*step-}))
  run --steps $((step + 2)) "${saving[@]}" --out "$out" --resume > "$out.resume.log" 2>&1 ||
    fail "trial $t: resume failed: $(tail -3 "$out.resume.log")"
  grep -q "resumed from $newest" "$out.resume.log" || fail "trial $t: did not resume from $newest"
  ((++resumed))
  rm -rf "$out"
done
echo "kill -9: $trials trials ($in_save killed inside a save, $before_first before the first save), newest checkpoint verified and resumed in $resumed, none published partially"

# ---- 2. a full disk ------------------------------------------------------------------------------------
mkdir -p "$disk"
if mount -t tmpfs -o size=3m tmpfs "$disk" 2>/dev/null; then
  run "${tiny[@]}" --steps 10 --keep-last 0 --ckpt-dir "$disk/ckpt" --out "$work/full" > "$work/full.log" 2>&1 &&
    fail "the run with a full disk succeeded"
  grep -q "cannot write $disk/ckpt/.*: No space left on device" "$work/full.log" ||
    fail "the full-disk error does not name the file and the cause: $(grep -m3 ztrain-gpt "$work/full.log")"
  kept=$(printf '%s\n' "$disk"/ckpt/step-* | grep -c step-)
  ((kept >= 1)) || fail "no checkpoint fitted on the disk"
  for d in "$disk"/ckpt/step-*; do evaluates "$d" || fail "$d does not verify after the disk filled: $(cat "$work/eval.log")"; done
  echo "full disk: the save that did not fit failed with \"$(grep -m1 "No space left on device" "$work/full.log" | sed 's/^ztrain-gpt: //')\"; the $kept earlier checkpoints verify"
  umount "$disk"
else
  echo "full disk: skipped (mounting a tmpfs needs root)"
fi

# ---- 3. bit flips and truncations ----------------------------------------------------------------------
run "${tiny[@]}" --steps 2 --keep-last 0 --out "$work/damage" > "$work/damage.log" 2>&1 || fail "the run to damage failed"
good=$work/damage/checkpoints/step-00000002
evaluates "$good" || fail "the intact checkpoint does not evaluate"
named=0 total=0
for file in model.safetensors optimizer.safetensors rng.safetensors manifest.json; do
  for ((k = 0; k <= 20; ++k)); do
    bad=$work/bad && rm -rf "$bad" && cp -r "$good" "$bad"
    size=$(stat -c %s "$bad/$file")
    if ((k == 20)); then
      truncate -s $((size / 2)) "$bad/$file"
      what="truncation"
    else
      python3 - "$bad/$file" <<'PY'
import random, sys
data = bytearray(open(sys.argv[1], "rb").read())
i = random.randrange(len(data))
data[i] ^= 1 << random.randrange(8)
open(sys.argv[1], "wb").write(data)
PY
      what="bit flip"
    fi
    ((++total))
    if evaluates "$bad"; then fail "$what in $file: the damaged checkpoint evaluated"; fi
    grep -q "$bad/$file" "$work/eval.log" || fail "$what in $file: the error does not name it: $(cat "$work/eval.log")"
    ((++named))
  done
done
echo "damage: $total damaged checkpoints (20 bit flips and a truncation in each of 4 file kinds), each refused naming the file: $named"
echo "soak_checkpoints: all passed"
