#!/usr/bin/env bash
# Hosts on one machine: sourced by the multi-host tests and scripts.
#
#   source tests/multihost/hosts.sh
#   hosts_up 2                      # hosts 0 and 1, each a network namespace with its own name
#   hosts_mpirun 2 -- prog args     # 2 ranks per host, Open MPI over TCP between the hosts
#   hosts_link_bytes 1              # bytes host 1 sent and received over its link
#   hosts_shape 1 1000              # host 1's link at 1000 Mbit/s each way
#   hosts_cut 1 / hosts_mend 1      # host 1's link down / up
#
# Each host is a network namespace with its own UTS namespace (its own host name, so ztrain and
# Open MPI see separate hosts), joined to a switch namespace by a veth pair: host h is
# 10.201.0.(h+1) on its eth0, and its link's far end is the switch's port p<h>. Nothing is
# addressed outside 10.201.0.0/24, and the namespaces (and every process still in them) are
# removed on exit, whatever the outcome. Names carry the shell's PID, so runs can overlap.
# Needs root and iproute2; hosts_available says whether this machine allows it.

HOSTS_PREFIX="zt$$"
HOSTS_SUBNET=10.201.0
HOSTS_COUNT=0
HOSTS_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

hosts_ns() { echo "$HOSTS_PREFIX-$1"; }          # a host's namespace: hosts_ns 0, or hosts_ns sw
hosts_ip() { echo "$HOSTS_SUBNET.$(($1 + 1))"; }  # a host's address

# Exit status 0 where namespaces, veth pairs and bridges can be made here.
hosts_available() {
  [[ $(id -u) == 0 ]] && command -v ip >/dev/null && command -v unshare >/dev/null || return 1
  local probe="zt$$-probe"
  ip netns add "$probe" 2>/dev/null || return 1
  local ok=0
  ip -n "$probe" link add pa type veth peer name pb 2>/dev/null && ip -n "$probe" link add br0 type bridge 2>/dev/null || ok=1
  ip netns del "$probe"
  return $ok
}

hosts_down() {
  local ns
  for ns in $(ip netns list 2>/dev/null | awk -v p="$HOSTS_PREFIX-" 'index($1, p) == 1 { print $1 }'); do
    ip netns pids "$ns" 2>/dev/null | xargs -r kill -9 2>/dev/null
    ip netns del "$ns" 2>/dev/null
  done
  HOSTS_COUNT=0
}

# hosts_up N: N hosts (2 or 3) on one switch. Tears down on the shell's exit.
hosts_up() {
  local n=$1 h sw
  (( n >= 2 && n <= 3 )) || { echo "hosts_up: 2 or 3 hosts, not $n" >&2; return 1; }
  trap hosts_down EXIT
  sw=$(hosts_ns sw)
  ip netns add "$sw"
  ip -n "$sw" link set lo up
  ip -n "$sw" link add br0 type bridge
  ip -n "$sw" link set br0 up
  for ((h = 0; h < n; ++h)); do
    ip netns add "$(hosts_ns "$h")"
    ip -n "$(hosts_ns "$h")" link set lo up
    ip -n "$sw" link add "p$h" type veth peer name eth0 netns "$(hosts_ns "$h")"
    ip -n "$sw" link set "p$h" master br0 up
    ip -n "$(hosts_ns "$h")" addr add "$(hosts_ip "$h")/24" dev eth0
    ip -n "$(hosts_ns "$h")" link set eth0 up
  done
  HOSTS_COUNT=$n
  # The links are up once both ends of every veth say so (bounded: 50 looks, 0.1 s apart).
  local tries
  for ((tries = 0; tries < 50; ++tries)); do
    local down=0
    for ((h = 0; h < n; ++h)); do
      [[ $(ip netns exec "$(hosts_ns "$h")" cat /sys/class/net/eth0/operstate) == up ]] || down=1
      [[ $(ip netns exec "$sw" cat "/sys/class/net/p$h/operstate") == up ]] || down=1
    done
    ((down == 0)) && return 0
    sleep 0.1
  done
  echo "hosts_up: the links did not come up within 5 s" >&2
  return 1
}

# hosts_run H CMD...: runs CMD as host H (its namespace and its host name).
hosts_run() {
  local h=$1
  shift
  ip netns exec "$(hosts_ns "$h")" unshare --uts sh -c 'hostname "$0" && exec "$@"' "$(hosts_ns "$h")" "$@"
}

# hosts_mpirun RANKS_PER_HOST [MPIRUN_OPTIONS...] -- PROGRAM ARGS...: mpirun from host 0 with
# RANKS_PER_HOST ranks on each host, in host order (ranks 0..R-1 on host 0, ...). Open MPI starts
# the other hosts' daemons through hosts_agent.sh instead of ssh, and keeps its own and the
# ranks' TCP traffic on the hosts' subnet.
hosts_mpirun() {
  local per=$1 h list=
  shift
  for ((h = 0; h < HOSTS_COUNT; ++h)); do list+="${list:+,}$(hosts_ip "$h"):$per"; done
  local opts=()
  while (($#)) && [[ $1 != -- ]]; do opts+=("$1"); shift; done
  shift
  HOSTS_PREFIX=$HOSTS_PREFIX HOSTS_SUBNET=$HOSTS_SUBNET \
    hosts_run 0 "${ZTRAIN_MPIRUN:-mpirun}" --host "$list" --bind-to none --oversubscribe \
    --mca plm_rsh_agent "$HOSTS_DIR/hosts_agent.sh" --mca plm_rsh_no_tree_spawn 1 \
    --mca oob_tcp_if_include "$HOSTS_SUBNET.0/24" --mca btl_tcp_if_include "$HOSTS_SUBNET.0/24" \
    --mca btl tcp,vader,self "${opts[@]}" "$@"
}

# Bytes through host H's link (sent plus received, counted at the switch's port).
hosts_link_bytes() {
  local p=/sys/class/net/p$1/statistics
  ip netns exec "$(hosts_ns sw)" sh -c "echo \$(( \$(cat $p/rx_bytes) + \$(cat $p/tx_bytes) ))"
}

# hosts_shape H MBIT: both directions of host H's link limited to MBIT Mbit/s (a token bucket:
# tc's tbf, whose bucket holds 2 ms at that rate, at least one 64 KiB segment).
hosts_shape() {
  local h=$1 mbit=$2 end
  local burst=$((mbit * 1000000 / 8 / 500))
  ((burst < 65536 * 2)) && burst=$((65536 * 2))
  for end in "$(hosts_ns "$h") eth0" "$(hosts_ns sw) p$h"; do
    set -- $end
    tc -n "$1" qdisc replace dev "$2" root tbf rate "${mbit}mbit" burst "$burst" latency 100ms
  done
}

hosts_cut() { ip -n "$(hosts_ns sw)" link set "p$1" down; }
hosts_mend() { ip -n "$(hosts_ns sw)" link set "p$1" up; }
