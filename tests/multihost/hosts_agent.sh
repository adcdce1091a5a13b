#!/bin/sh
# Open MPI's remote shell for the hosts of hosts.sh: `hosts_agent.sh [ssh options] HOST COMMAND`
# runs COMMAND as HOST (an address on the hosts' subnet), in that host's namespaces.
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
exec ip netns exec "$ns" unshare --uts sh -c 'hostname "$0" && exec sh -c "$1"' "$ns" "$*"
