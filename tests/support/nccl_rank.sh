#!/bin/sh
# Runs one rank of an NCCL test (cmake/ZtrainTesting.cmake) under its own NCCL host id. NCCL
# refuses a communicator with two ranks on one GPU of one host; ranks that claim different hosts
# are joined over NCCL's socket transport instead, here over the loopback interface. That lets a
# machine with one GPU run the multi-rank NCCL tests; it is a test device, not a way to train.
export NCCL_HOSTID="ztrain-test-rank-${OMPI_COMM_WORLD_RANK:-0}"
export NCCL_SOCKET_IFNAME="${NCCL_SOCKET_IFNAME:-lo}"
exec "$@"
