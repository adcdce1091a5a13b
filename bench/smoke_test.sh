#!/usr/bin/env bash
# Usage: bench/smoke_test.sh GPT_BENCH MPIEXEC DATA WORKDIR PYTHON
#
# The run_all tooling in seconds (a CTest, not a benchmark): gpt_bench on 2 ranks for one step
# of the small GPT at ZeRO levels 0 and 3, the PyTorch peer's model against gpt_reference.py, one
# DDP step on 1 rank and one FSDP2 step on 2, one python_bench step and one python_pipe_bench
# step per schedule on 2 ranks (where the Python package is built), one step under three booster
# plugins, then report.py on the results, and report.py --section growth on level 3 at 1 and 2
# ranks. Fails unless the
# bytes sent per step equal the theory (ring collectives: 2(N-1)/N or 3(N-1)/N of the parameter
# bytes) and the model state equals ztrain's formula, FSDP2 holds a shard of the parameters, and
# the section and plots are written.
set -euo pipefail
gpt=$1 mpiexec=$2 data=$3 work=$4 python=$5
here=$(cd "$(dirname "$0")" && pwd)
rm -rf "$work"
mkdir -p "$work"
for level in 0 3; do
  "$mpiexec" -np 2 --oversubscribe --bind-to none "$gpt" --preset small --batch 1 --seq 16 --steps 1 --warmup 1 \
    --level "$level" --data "$data" --json "$work/results.jsonl" --tag peer >/dev/null
done
"$python" "$here/peer_torch.py" --check
"$python" "$here/peer_torch.py" --ranks 1 --preset tiny --batch 1 --seq 16 --steps 1 --warmup 0 --data "$data" \
  --json "$work/results.jsonl" --tag peer >/dev/null
"$python" "$here/peer_torch.py" --system fsdp2 --ranks 2 --preset tiny --batch 1 --seq 16 --steps 1 --warmup 0 \
  --data "$data" --json "$work/results.jsonl" --tag peer >/dev/null
# The same GPT from Python (bench/python_bench.py), where the package was built beside gpt_bench.
package=$(cd "$(dirname "$gpt")/.." && pwd)/python
if [[ -d $package/ztrain ]]; then
  PYTHONPATH=$package "$mpiexec" -np 2 --oversubscribe --bind-to none -x PYTHONPATH "$python" "$here/python_bench.py" \
    --level 3 --preset tiny --batch 1 --seq 16 --steps 1 --warmup 1 --data "$data" --json "$work/python.jsonl" >/dev/null
  for style in 1f1b gpipe; do  # bench/python_pipe_bench.py: both schedules, the same first loss
    PYTHONPATH=$package "$mpiexec" -np 2 --oversubscribe --bind-to none -x PYTHONPATH "$python" \
      "$here/python_pipe_bench.py" --style "$style" --micro-batches 2 --preset tiny --batch 4 --seq 16 --steps 1 \
      --warmup 0 --data "$data" --json "$work/pipe.jsonl" >/dev/null
  done
  PYTHONPATH=$package "$python" "$here/fused_bench.py" --calls 1 --repeats 1 --tokens 64 >/dev/null  # the fused kernels against torch's
  "$python" -c 'import json, sys; a, b = (json.loads(l) for l in open(sys.argv[1]))
assert a["loss_first"] == b["loss_first"] and a["peak_rss_bytes"][0] > 0, (a, b)
print("python_pipe_bench: 1f1b and gpipe first loss %.4f" % a["loss_first"])' "$work/pipe.jsonl"
fi
"$python" - "$work/results.jsonl" "$work/python.jsonl" "$here" <<'EOF'
import json, os, sys
sys.path.insert(0, sys.argv[3])
from report import sent_theory
rows = [json.loads(l) for l in open(sys.argv[1])]
python = [json.loads(l) for l in open(sys.argv[2])] if os.path.exists(sys.argv[2]) else []
ours = [r for r in rows if r["system"] == "ztrain"]
assert len(ours) == 2 and len(rows) == 4, f"expected 2 gpt_bench and 2 peer results, got {len(rows)}"
fsdp2 = next(r for r in rows if r["system"] == "fsdp2")
full = fsdp2["params"] * 4
assert fsdp2["memory"]["parameter"] <= 0.6 * full, f"FSDP2 holds {fsdp2['memory']['parameter']} of {full} bytes"
for r in ours:
    theory = sent_theory(r)
    sent = r["comm_bytes_per_step"]["gather"] + r["comm_bytes_per_step"]["reduce"]
    assert abs(sent / theory - 1) < 1e-3, f"level {r['level']}: sent {sent} bytes per step, theory {theory}"
    state, formula = r["memory"]["model_state"], r["formula"]["design"]["model_state"]
    assert abs(state / formula - 1) < 1e-3, f"level {r['level']}: model state {state}, formula {formula}"
    print(f"level {r['level']}: {sent:.0f} bytes sent per step (theory {theory:.0f}), model state {state:.0f} bytes")
peer_tiny = next(r for r in rows if r["system"] == "ddp")
for r in python:
    assert r["params"] == peer_tiny["params"] and r["tokens_per_s"] > 0, f"python_bench: {r}"
    print(f"python_bench: {r['params']} parameters, {r['tokens_per_s']:.0f} tokens/s")
EOF
# The booster's plugins on the plain GPT (bench/booster_bench.sh): each shards the optimizer
# state as the ZeRO formula says (ztrain's AdamW in fp32: 8 bytes per parameter, over 2 ranks
# for all but DataParallel; flat buffers pad each parameter to 64 bytes).
for plugin in ddp zero2 fsdp; do
  "$mpiexec" -np 2 --oversubscribe --bind-to none "$gpt" --system booster --plugin "$plugin" --preset small --batch 1 \
    --seq 16 --steps 1 --warmup 1 --data "$data" --json "$work/booster.jsonl" >/dev/null
done
"$python" - "$work/booster.jsonl" <<'EOF'
import json, sys
for r in (json.loads(l) for l in open(sys.argv[1])):
    shards = 1 if r["plugin"] == "ddp" else r["ranks"]
    held, formula = r["memory"]["optimizer"], 8 * r["params"] / shards
    assert formula <= held <= 1.01 * formula, f"{r['plugin']}: optimizer state {held} bytes, formula {formula:.0f}"
    print(f"booster {r['plugin']}: optimizer state {held} bytes per rank (formula {formula:.0f}), {r['tokens_per_s']:.0f} tokens/s")
EOF
"$python" "$here/report.py" --results "$work" --print --img "$work/img" >"$work/section.md"
grep -q "Throughput against PyTorch" "$work/section.md"
[[ -s $work/img/bench_peers.png ]]
# bench/growth.sh's section and plot, from level 3 at 1 and 2 ranks.
mkdir -p "$work/growth"
for np in 1 2; do
  "$mpiexec" -np "$np" --oversubscribe --bind-to none "$gpt" --preset tiny --batch 1 --seq 16 --steps 1 --warmup 1 \
    --level 3 --probe --data "$data" --json "$work/growth/results.jsonl" --tag growth >/dev/null
done
"$python" "$here/report.py" --section growth --results "$work/growth" --print --img "$work/img" >"$work/growth.md"
grep -q "Largest that trained: level 3, 1 rank: 0.1 M; level 3, 2 ranks: 0.1 M" "$work/growth.md"
[[ -s $work/img/bench_growth.png ]]
echo "smoke_test: ok"
