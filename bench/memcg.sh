# shellcheck shell=bash disable=SC2034  # the memcg_* results are read by the sourcing script
# Shared by the benchmark scripts that run each configuration in a memory cgroup, so that a model
# too large for the machine is killed by the kernel inside the group, not the machine's other
# processes (sourced, not run; needs root and the cgroup v1 memory controller).
#   memcg_create NAME LIMIT_BYTES  makes the group, limited to LIMIT_BYTES (page cache included,
#                                  no swap) and removed on exit; sets memcg (its directory)
#   memcg_run LOG COMMAND...       runs COMMAND in the group, its output to LOG; sets memcg_rc
#                                  (its exit status), memcg_peak (the group's peak bytes),
#                                  memcg_rss (the process tree's peak RSS, bytes) and memcg_killed
#                                  (processes the kernel killed in the group for want of memory)

memcg_create() {
  local fail="$1: needs root and the cgroup v1 memory controller (/sys/fs/cgroup/memory): each run goes into a memory cgroup"
  [[ $(id -u) == 0 && -w /sys/fs/cgroup/memory ]] || { echo "$fail" >&2; exit 1; }
  memcg=/sys/fs/cgroup/memory/ztrain-$1-$$
  mkdir -p "$memcg"
  trap 'rmdir "$memcg" 2>/dev/null || true' EXIT
  echo "$2" >"$memcg/memory.limit_in_bytes"
  echo 0 >"$memcg/memory.swappiness"
}

memcg_oom_kills() { awk '$1 == "oom_kill" {print $2}' "$memcg/memory.oom_control"; }

memcg_run() {
  local log=$1; shift
  echo 0 >"$memcg/memory.max_usage_in_bytes"
  local kills0; kills0=$(memcg_oom_kills)
  set +e
  # shellcheck disable=SC2016
  /usr/bin/time -f '%M' -o "$log.rss" sh -c 'echo $$ >"$1/cgroup.procs"; shift; exec "$@"' \
    sh "$memcg" "$@" >"$log" 2>&1
  memcg_rc=$?
  set -e
  memcg_peak=$(cat "$memcg/memory.max_usage_in_bytes")
  memcg_rss=$(( $(grep -E '^[0-9]+$' "$log.rss" | tail -n 1 || echo 0) * 1024 ))
  memcg_killed=$(( $(memcg_oom_kills) - kills0 ))
}
