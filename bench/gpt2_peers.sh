#!/usr/bin/env bash
# Usage: bench/gpt2_peers.sh [--docs] [BUILD] [STEPS] [RANKS] [DTYPES] [ROUNDS]
#
# GPT-2 124M (12 x 768, 12 heads, vocabulary 50257, no dropout) at sequence 256, batch 2 per rank, on RANKS
# ranks (default 2) x 1 intra-op thread, side by side in one run: ztrain at ZeRO levels 0 and 3,
# PyTorch DDP and FSDP2 (fully_shard) over gloo, in each of DTYPES (default "fp32 bf16" where the
# CPU has bf16 units, AVX-512 BF16 or AMX, else "fp32"), taking turns configuration by
# configuration, ROUNDS times over (default 2; each configuration is then judged by its fastest round, as a host's other load only
# ever adds time, and every round's median step is shown beside it). ztrain's ranks
# measure the matmul peak of the run's dtype in the same process (--probe) and report model FLOP/s
# against it; ztrain on one rank with the same per-rank batch is the single-process step, measured
# alone and with RANKS such runs at once (each core doing the same work, as at RANKS ranks,
# without communication). Prints the table of runs (tokens/s, median step with p10-p90, phase
# times, peak RSS per rank, model GFLOP/s per rank and its share of the peak) and the performance
# goals, each met or missed (bench/gpt2_peers_report.py); --docs writes them to the section of
# docs/benchmarks.md between <!-- gpt2_peers:begin --> and <!-- gpt2_peers:end -->. The JSON
# lines stay in BUILD/bench-results/gpt2_peers.roundR.jsonl. About 7 minutes per round for fp32
# alone on the 2-core development machine.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
docs=0
[[ ${1:-} == --docs ]] && { docs=1; shift; }
build=${1:-$root/build}
steps=${2:-4}
ranks=${3:-2}
dtypes=${4:-fp32}
[[ -z ${4:-} ]] && grep -qwE "avx512_bf16|amx_bf16" /proc/cpuinfo && dtypes="fp32 bf16"  # bf16 units
rounds=${5:-2}
python=${ZTRAIN_PYTHON:-$root/.venv/bin/python}
data=$root/data/tinyshakespeare.txt
commit=$(git -C "$root" rev-parse --short HEAD 2>/dev/null || echo unknown)
# changes to the documentation only (this page among them) leave the measured code as committed
[[ -n $(git -C "$root" status --porcelain -- . ':!docs' ':!*.md' 2>/dev/null) ]] && commit+=" with uncommitted changes"
mkdir -p "$build/bench-results"
rm -f "$build"/bench-results/gpt2_peers*.jsonl
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS=1
ztrain_only=(--dropout 0)  # as the PyTorch peers, whose model has no dropout
results=()
for ((round = 1; round <= rounds; ++round)); do
  out=$build/bench-results/gpt2_peers.round$round.jsonl
  results+=("$out")
  common=(--preset gpt2 --batch 2 --seq 256 --steps "$steps" --warmup 2 --data "$data" --json "$out")
  for dtype in $dtypes; do
    mpirun -np 1 --bind-to none "$build/bench/gpt_bench" "${common[@]}" "${ztrain_only[@]}" --dtype "$dtype" --level 0 --probe \
      --tag "ztrain 1 rank" > /dev/null
    pids=()
    for ((i = 0; i < ranks; ++i)); do
      mpirun -np 1 --bind-to none "$build/bench/gpt_bench" "${common[@]}" "${ztrain_only[@]}" --dtype "$dtype" --level 0 --probe \
        --tag "ztrain 1 rank, $ranks at once" > /dev/null &
      pids+=($!)
    done
    for pid in "${pids[@]}"; do wait "$pid"; done
    for level in 0 3; do
      mpirun -np "$ranks" --oversubscribe --bind-to none "$build/bench/gpt_bench" "${common[@]}" "${ztrain_only[@]}" \
        --dtype "$dtype" --level "$level" --probe --tag "ztrain L$level" > /dev/null
    done
    for system in ddp fsdp2; do
      "$python" "$root/bench/peer_torch.py" --system "$system" --ranks "$ranks" "${common[@]}" \
        --dtype "$dtype" --tag "PyTorch $system" > /dev/null
    done
  done
done
doc=()
((docs)) && doc=(--doc "$root/docs/benchmarks.md")
"$python" "$root/bench/gpt2_peers_report.py" --results "${results[@]}" --ranks "$ranks" --commit "$commit" "${doc[@]}"
