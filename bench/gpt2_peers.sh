#!/usr/bin/env bash
# Usage: bench/gpt2_peers.sh [BUILD] [STEPS] [RANKS] [DTYPES]
#
# GPT-2 124M (12 x 768, 12 heads, vocabulary 50257) at sequence 256, batch 2 per rank, on RANKS
# ranks (default 2) x 1 intra-op thread, side by side in one run: ztrain at ZeRO levels 0 and 3,
# PyTorch DDP and FSDP2 (fully_shard) over gloo, in fp32 and bf16, taking turns configuration by
# configuration. ztrain's ranks measure the matmul peak of the run's dtype in the same process
# (--probe) and reports model FLOP/s against it; ztrain on one rank with the same per-rank batch
# is the single-process step, measured alone and with RANKS such runs at once (each core doing the
# same work, as at RANKS ranks, without communication). DTYPES: "fp32 bf16" by default (bf16 only
# where the CPU has bf16 units). Prints one line per run (tokens/s, median step with p10-p90, peak
# RSS per rank, model GFLOP/s per rank and its share of the peak), then the ratios the
# performance goals name, and leaves the JSON lines in BUILD/bench-results/gpt2_peers.jsonl.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${1:-$root/build}
steps=${2:-4}
ranks=${3:-2}
dtypes=${4:-fp32 bf16}
python=${ZTRAIN_PYTHON:-$root/.venv/bin/python}
data=$root/data/tinyshakespeare.txt
out=$build/bench-results/gpt2_peers.jsonl
mkdir -p "$(dirname "$out")"
: > "$out"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS=1
common=(--preset gpt2 --batch 2 --seq 256 --steps "$steps" --warmup 2 --data "$data" --json "$out")
for dtype in $dtypes; do
  mpirun -np 1 --bind-to none "$build/bench/gpt_bench" "${common[@]}" --dtype "$dtype" --level 0 --probe \
    --tag "ztrain 1 rank" > /dev/null
  pids=()
  for ((i = 0; i < ranks; ++i)); do
    mpirun -np 1 --bind-to none "$build/bench/gpt_bench" "${common[@]}" --dtype "$dtype" --level 0 --probe \
      --tag "ztrain 1 rank, $ranks at once" > /dev/null &
    pids+=($!)
  done
  for pid in "${pids[@]}"; do wait "$pid"; done
  for level in 0 3; do
    mpirun -np "$ranks" --oversubscribe --bind-to none "$build/bench/gpt_bench" "${common[@]}" \
      --dtype "$dtype" --level "$level" --probe --tag "ztrain L$level" > /dev/null
  done
  for system in ddp fsdp2; do
    "$python" "$root/bench/peer_torch.py" --system "$system" --ranks "$ranks" "${common[@]}" \
      --dtype "$dtype" --tag "PyTorch $system" > /dev/null
  done
done
"$python" - "$out" "$ranks" <<'PY'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
ranks = int(sys.argv[2])
ours = [r for r in rows if r.get("matmul")]
flops_per_token = ours[0]["flops_per_token"]  # the same model for every system
peak = {d: min(r["matmul"][d]["peak_gflops"] for r in ours if d in r["matmul"]) for d in {r["dtype"] for r in ours}}
print("matmul peak per rank, measured by ztrain's ranks: " + ", ".join(f"{d} {v:.0f} GFLOP/s" for d, v in peak.items()))
print(f"{'system':<26}{'dtype':<6}{'tokens/s':>9}{'step s (p10-p90)':>22}{'peak RSS/rank GiB':>19}"
      f"{'GFLOP/s/rank':>14}{'of peak':>9}{'loss':>8}  forward/backward/optimizer s")
by = {}
for r in rows:
    k = (r["tag"], r["dtype"])
    if k not in by or r["step_s"]["median"] > by[k]["step_s"]["median"]:  # the slowest of the runs at once
        by[k] = r
    gflops = flops_per_token * r["tokens_per_s"] / r["ranks"] / 1e9
    s = r["step_s"]
    print(f"{r['tag']:<26}{r['dtype']:<6}{r['tokens_per_s']:>9.1f}"
          f"{s['median']:>8.2f} ({s['p10']:.2f}-{s['p90']:.2f}){'':>1}{r['memory']['peak_rss'] / 2**30:>18.2f}"
          f"{gflops:>14.1f}{gflops / peak[r['dtype']]:>9.1%}{r.get('loss_last', float('nan')):>8.3f}  "
          + ("/".join(f"{v:.2f}" for v in r["phase_s"].values()) if "phase_s" in r else "-"))
for d in sorted({r["dtype"] for r in rows}, reverse=True):
    l0, l3 = by[("ztrain L0", d)], by[("ztrain L3", d)]
    ddp, fsdp = by[("PyTorch ddp", d)], by[("PyTorch fsdp2", d)]
    one, busy = by[("ztrain 1 rank", d)], by[(f"ztrain 1 rank, {ranks} at once", d)]
    print(f"{d}: L0/DDP {l0['tokens_per_s'] / ddp['tokens_per_s']:.2f}x, L3/FSDP2 "
          f"{l3['tokens_per_s'] / fsdp['tokens_per_s']:.2f}x, L3 peak RSS / FSDP2's "
          f"{l3['memory']['peak_rss'] / fsdp['memory']['peak_rss']:.2f}, L3 step / 1-rank step "
          f"{l3['step_s']['median'] / one['step_s']['median']:.2f} (alone), "
          f"{l3['step_s']['median'] / busy['step_s']['median']:.2f} ({ranks} at once); "
          f"L0 step / 1-rank step {l0['step_s']['median'] / one['step_s']['median']:.2f} (alone), "
          f"{l0['step_s']['median'] / busy['step_s']['median']:.2f} ({ranks} at once)")
PY
