#!/usr/bin/env bash
# The main job: installs dependencies, builds, learns a BPE tokenizer from the bundled Shakespeare
# corpus and trains a small GPT on it with ztrain-gpt on 2 ranks (or $ZTRAIN_RANKS), with
# checkpoints; run it again to continue from the latest checkpoint. Extra arguments replace the
# default ones, e.g.
#   scripts/train.sh train --data my_texts/ --preset medium --steps 5000 --zero-level 3
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
"$root/scripts/setup.sh"
ZTRAIN_BUILD_TARGETS=ztrain-gpt "$root/scripts/build.sh" >/dev/null  # the app and its libraries only
build=${ZTRAIN_BUILD_DIR:-$root/build}
ranks=${ZTRAIN_RANKS:-2}
flags=(--bind-to none)
(( ranks > $(nproc) )) && flags+=(--oversubscribe)
[[ $(id -u) -eq 0 ]] && export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( $(nproc) / ranks > 0 ? $(nproc) / ranks : 1 ))}
args=("$@")
gpt=$build/apps/ztrain-gpt/ztrain-gpt
if (( ${#args[@]} == 0 )); then
  # The tokenizer is learnt once: a resumed run must keep the ids it started with.
  [[ -f $root/runs/gpt/tokenizer.json ]] ||
    "$gpt" tokenizer train --data "$root/data/tinyshakespeare.txt" --vocab-size 4096 --out "$root/runs/gpt/tokenizer.json"
  args=(train --data "$root/data/tinyshakespeare.txt" --tokenizer "$root/runs/gpt/tokenizer.json"
        --preset small --d-model 192 --heads 3 --layers 3 --seq 128 --batch 8 --steps 380 --lr 3e-3 --warmup 80
        --zero-level 3 --eval-interval 100 --eval-batches 20 --ckpt-interval 190 --out "$root/runs/gpt" --resume
        --tensorboard "$root/runs/gpt/tensorboard")
fi
mpirun -np "$ranks" "${flags[@]}" "$gpt" "${args[@]}"
if [[ ${args[0]} == train && ${#@} -eq 0 ]]; then
  "$gpt" sample --model "$root/runs/gpt/model.safetensors" --prompt "ROMEO:" --tokens 80
  echo "curves: ${ZTRAIN_VENV:-$root/.venv}/bin/tensorboard --logdir $root/runs/gpt/tensorboard"
fi
