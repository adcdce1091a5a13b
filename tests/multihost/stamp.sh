#!/usr/bin/env bash
# Usage: stamp.sh DIR PROGRAM ARGS...: runs PROGRAM with every line of its output prefixed by the
# time it appeared (seconds since the epoch), into DIR/rank-<MPI rank>.log. It runs beside the
# rank, so the times hold even when the rank's output cannot reach mpirun (a cut link).
dir=$1
shift
"$@" 2>&1 | while IFS= read -r line; do printf '%s %s\n' "$(date +%s.%N)" "$line"; done \
  > "$dir/rank-${OMPI_COMM_WORLD_RANK:-0}.log"
exit "${PIPESTATUS[0]}"
