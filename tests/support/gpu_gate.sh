#!/bin/sh
# Runs a GPU test's command (cmake/ZtrainTesting.cmake) on a machine with an NVIDIA GPU. On one
# without, it says so at once, in the words the test itself would use after starting every rank
# and libtorch (a second or more per launch), and ctest reports the test as skipped.
for dev in /dev/nvidia[0-9]* /dev/dxg; do
  [ -e "$dev" ] && exec "$@"
done
echo "gpu_gate: this machine sees no CUDA device (no /dev/nvidia<N> or /dev/dxg)"
