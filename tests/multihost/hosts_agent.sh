#!/bin/sh
# Open MPI's remote shell for the hosts of hosts.sh: `hosts_agent.sh [ssh options] HOST COMMAND`
# runs COMMAND as HOST (an address on the hosts' subnet), in that host's namespaces.
#
# The daemon is started without --daemonize, so that it stays in mpirun's session. A daemonized
# one calls setsid, and the kernel's autogroup scheduling (sched_autogroup_enabled) then shares
# the CPUs between the sessions, not the processes: on a 2-core machine, host 0's ranks spinning
# in a blocking MPI call (MPI_Comm_split, MPI_Finalize) left host 1's runnable ranks 0-1 of 200
# ticks in 2 s, and such runs took 10-70 s instead of 2 (docs/errors.md).
while [ $# -gt 0 ]; do
  case $1 in
    -*) shift ;;
    *) break ;;
  esac
done
host=$1
shift
h=$(( ${host##*.} - 1 ))
ns="$HOSTS_PREFIX-$h"
cmd=$(printf ' %s ' "$*" | sed 's/ --daemonize / /')
exec ip netns exec "$ns" unshare --uts sh -c 'hostname "$0" && exec sh -c "$1"' "$ns" "$cmd"
