#!/usr/bin/env bash
# Usage: bench/beyond_memory.sh [--build DIR] [--results DIR] [--dir DIR] [--limit-gib G]
#                               [--fsdp-layers "L ..."] [--ztrain-layers "L ..."] [--docs]
#
# Models larger than memory (ZeRO-Infinity's idea on a CPU machine): the largest GPT that trains
# 3 steps on this machine, PyTorch FSDP2 (fully_shard, 1 rank, its model state in memory) against
# ztrain-gpt at ZeRO level 3 with its whole model state on disk (--offload-param-dir: parameter
# and gradient shards; --offload-dir: the optimizer state). GPTs of width 2048 (16 heads, byte
# vocabulary, context 64, one sequence of 64 per step, fp32), growing by layers (50.3 M
# parameters each). Each run is one process tree in a memory cgroup limited to --limit-gib (default:
# this machine's memory less 1 GiB, page cache included, no swap), so a run that does not fit is
# killed by the kernel and counts as "does not fit"; a system's sweep stops at its first failure.
# Also measured: the disk's bandwidth through the same kind of file the offload uses (a shared
# mapping of an unlinked, preallocated file in --dir, written, synced and dropped, then read back
# cold), the bytes each run read and wrote (the cgroup's block I/O), and its step time.
#
#   --build DIR         ztrain's build directory (default build/; built if needed)
#   --results DIR       where the JSON lines and logs go (default BUILD/beyond-memory)
#   --dir DIR           the offload directory (default BUILD/offload; needs about 17 bytes per
#                       parameter of the largest ztrain model free)
#   --fsdp-layers       FSDP2's sizes, in layers (default "26 28 30 32")
#   --ztrain-layers     ztrain's sizes, in layers (default "60")
#   --docs              write the section of docs/benchmarks.md between <!-- beyond_memory:begin -->
#                       and <!-- beyond_memory:end -->
#
# Needs root (cgroups) and much disk traffic at the largest sizes: about 25 minutes with the
# defaults on the 2-core development machine.
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
build=$root/build
results= dir= docs=0
limit_gib=
fsdp_layers="26 28 30 32"
ztrain_layers="60"
while (($#)); do
  case $1 in
    --build) build=$(realpath -m "$2"); shift 2 ;;
    --results) results=$(realpath -m "$2"); shift 2 ;;
    --dir) dir=$(realpath -m "$2"); shift 2 ;;
    --limit-gib) limit_gib=$2; shift 2 ;;
    --fsdp-layers) fsdp_layers=$2; shift 2 ;;
    --ztrain-layers) ztrain_layers=$2; shift 2 ;;
    --docs) docs=1; shift ;;
    -h|--help) sed -n '2,27p' "$0"; exit 0 ;;
    *) echo "beyond_memory: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
results=${results:-$build/beyond-memory}
dir=${dir:-$build/offload}
python=${ZTRAIN_PYTHON:-$root/.venv/bin/python}
data=$root/data/tinyshakespeare.txt
fail() { echo "beyond_memory: $*" >&2; exit 1; }

[[ -x $python ]] || fail "$python not found; run scripts/setup.sh"
[[ -f $data ]] || fail "$data not found"
mem_kb=$(awk '/^MemTotal/ {print $2}' /proc/meminfo)
limit_bytes=$(( limit_gib ? limit_gib * (1 << 30) : mem_kb * 1024 - (1 << 30) ))
if [[ ! -f $build/CMakeCache.txt ]]; then
  cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=RelWithDebInfo
fi
cmake --build "$build" -j "$(nproc)" --target ztrain-gpt >/dev/null || fail "building ztrain-gpt failed"
gpt=$(find "$build/apps" -type f -name ztrain-gpt -perm -u+x | head -n 1)
[[ -n $gpt ]] || fail "ztrain-gpt not found under $build/apps"

rm -rf "$results"
mkdir -p "$results/logs" "$dir"
out=$results/results.jsonl
: >"$out"
# shellcheck source=bench/memcg.sh
source "$root/bench/memcg.sh"
memcg_create beyond_memory "$limit_bytes"

# The block device under --dir, and its bytes read and written so far (the kernel's writeback of
# the mapped files runs outside the cgroup, so the device's counters are the measure; nothing
# else runs meanwhile).
device=$(basename "$(df --output=source "$dir" | tail -n 1)")
[[ -r /sys/class/block/$device/stat ]] || fail "no block device statistics for $dir ($device)"
io_bytes() { awk -v field="$1" '{printf "%.0f\n", $field * 512}' "/sys/class/block/$device/stat"; }

# run NAME PARAMS_M METRICS COMMAND...: one run in the group; appends its JSON line (METRICS:
# ztrain-gpt's metrics.jsonl, else the peer's result line in the log gives the step time).
run() {
  local name=$1 params=$2 metrics=$3; shift 3
  local log=$results/logs/$name.log
  local read0 written0
  read0=$(io_bytes 3) written0=$(io_bytes 7)
  local before=$SECONDS
  printf '%s %s ... ' "$(date +%H:%M:%S)" "$name" >&2
  memcg_run "$log" "$@"
  local wall=$((SECONDS - before))
  echo "rc $memcg_rc, ${wall} s, cgroup peak $((memcg_peak >> 20)) MiB" >&2
  "$python" - "$out" "$log" "$metrics" <<EOF
import json, os, statistics, sys
out, log, metrics = sys.argv[1:]
step_s, losses = None, []
if os.path.exists(metrics):  # ztrain-gpt: cumulative times per step; the first step is not counted
    rows = [json.loads(l) for l in open(metrics)]
    times = [r["time_s"] for r in rows]
    losses = [r["loss"] for r in rows]
    if len(times) > 1:
        step_s = statistics.median(b - a for a, b in zip(times, times[1:]))
else:
    for line in open(log, errors="replace"):
        if line.startswith('{"bench"'):
            r = json.loads(line)
            step_s, losses = r["step_s"]["median"], [r["loss_first"], r["loss_last"]]
json.dump({"name": "$name", "params_m": $params, "rc": $memcg_rc, "wall_s": $wall, "step_s": step_s, "losses": losses,
           "cgroup_peak": $memcg_peak, "peak_rss": $memcg_rss, "read_bytes": $(($(io_bytes 3) - read0)),
           "write_bytes": $(($(io_bytes 7) - written0)), "oom_kills": $memcg_killed,
           "limit": $limit_bytes, "log": log}, open(out, "a"))
open(out, "a").write("\n")
EOF
  return "$memcg_rc"
}

# ---- the disk, through the same kind of mapping ---------------------------------------------
"$python" - "$dir" "$out" <<'EOF'
import json, mmap, os, sys, tempfile, time
import numpy as np
d, out = sys.argv[1], sys.argv[2]
size = 4 << 30
fd, path = tempfile.mkstemp(prefix="ztrain-offload-", dir=d)
os.unlink(path)
os.posix_fallocate(fd, 0, size)
m = mmap.mmap(fd, size, mmap.MAP_SHARED)
a = np.frombuffer(m, dtype=np.float32)
t = time.perf_counter()
chunk = 64 << 20
for i in range(0, a.size, chunk):
    a[i:i + chunk] = 1.0
m.flush()
write_s = time.perf_counter() - t
m.madvise(mmap.MADV_DONTNEED)
os.posix_fadvise(fd, 0, size, os.POSIX_FADV_DONTNEED)  # cold: out of the page cache too
t = time.perf_counter()
m.madvise(mmap.MADV_WILLNEED)
total = float(a[::1024].sum())  # a float per page
read_s = time.perf_counter() - t
assert total == a.size / 1024
del a
m.close()
os.close(fd)
json.dump({"name": "disk", "bytes": size, "write_s": write_s, "read_s": read_s}, open(out, "a"))
open(out, "a").write("\n")
print(f"disk through a mapped file in {d}: write {size / write_s / 1e6:.0f} MB/s, read {size / read_s / 1e6:.0f} MB/s",
      file=sys.stderr)
EOF

shape() { echo "--d-model 2048 --layers $1 --heads 16 --context 64 --batch 1 --seq 64"; }
params_m() { "$python" -c "print(round((12 * 2048 * 2048 + 13 * 2048) * $1 / 1e6 + (256 + 64) * 2048 / 1e6 + 2 * 2048 / 1e6, 2))"; }

export OMP_NUM_THREADS=$(nproc) OPENBLAS_NUM_THREADS=1
for layers in $fsdp_layers; do
  # shellcheck disable=SC2046
  run "fsdp2-L$layers" "$(params_m "$layers")" - "$python" "$root/bench/peer_torch.py" --system fsdp2 --ranks 1 \
    --threads "$(nproc)" --preset small $(shape "$layers") --steps 2 --warmup 1 --timeout 3600 --data "$data" || break
done
# The same training in memory and on disk, on a model that fits both ways: the losses must agree.
ztrain_args() { echo "train --data $data $(shape "$1") --steps 3 --eval-interval 0 --zero-level 3 --recompute --offload"; }
# shellcheck disable=SC2046
run "ztrain-memory-L4" "$(params_m 4)" "$results/ztrain-memory-L4/metrics.jsonl" "$gpt" $(ztrain_args 4) \
  --out "$results/ztrain-memory-L4"
for layers in 4 $ztrain_layers; do
  # shellcheck disable=SC2046
  run "ztrain-L$layers" "$(params_m "$layers")" "$results/ztrain-L$layers/metrics.jsonl" "$gpt" $(ztrain_args "$layers") \
    --offload-dir "$dir" --offload-param-dir "$dir" --out "$results/ztrain-L$layers" || break
done

doc=()
((docs)) && doc=(--doc "$root/docs/benchmarks.md")
"$python" "$root/bench/beyond_memory_report.py" --results "$out" "${doc[@]}"
