#!/usr/bin/env bash
# The test command: installs dependencies, configures, builds and runs every CTest tier
# (unit tests, multi-rank MPI tests, the install/consumer test). Extra arguments go to ctest.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
"$root/scripts/setup.sh"
"$root/scripts/build.sh"
build=${ZTRAIN_BUILD_DIR:-$root/build}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
cd "$build"
ctest --output-on-failure -j "${ZTRAIN_TEST_JOBS:-2}" "$@"
