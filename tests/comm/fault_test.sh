#!/usr/bin/env bash
# Usage: fault_test.sh MPIRUN FAULT_TEST_BINARY MODE WHERE...
# Runs fault_test MODE on three ranks (rank 2 dies) and passes when both surviving ranks report,
# for each of WHERE (the calls the mode makes), a CommError that names the timeout, within
# twice the 5 s timeout the binary uses.
set -uo pipefail
mpirun=$1 binary=$2 mode=$3
shift 3
log=$(mktemp)
trap 'rm -f "$log"' EXIT
# ZTRAIN_RANK_WRAPPER: a command each rank runs under (the NCCL variants' tests/support/nccl_rank.sh).
# shellcheck disable=SC2086
timeout 120 "$mpirun" -np 3 --oversubscribe --bind-to none --enable-recovery ${ZTRAIN_RANK_WRAPPER:-} "$binary" "$mode" \
  >"$log" 2>&1
cat "$log"
status=0
for where in "$@"; do
  for r in 0 1; do
    line=$(grep "^FAULT-DETECTED rank=$r .* in=$where " "$log" | head -n1)
    if [[ -z $line ]]; then
      echo "fault_test: rank $r did not report the dead peer in $where"
      status=1
      continue
    fi
    seconds=$(sed -E 's/.* seconds=([0-9.e+-]+) .*/\1/' <<<"$line")
    if ! awk -v s="$seconds" 'BEGIN { exit !(s <= 10.0) }'; then
      echo "fault_test: rank $r took $seconds s in $where, more than twice the 5 s timeout"
      status=1
    fi
    # The deadline, or NCCL's own report of the lost connection (which may come first).
    if ! grep -qE "timed out after 5 s|NCCL [a-z_]+ failed" <<<"$line"; then
      echo "fault_test: rank $r's error in $where names neither the timeout nor NCCL's failure: $line"
      status=1
    fi
  done
done
((status == 0)) && echo "fault_test: both survivors failed cleanly in: $*"
exit $status
