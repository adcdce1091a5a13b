#!/usr/bin/env bash
# Usage: consumer_test.sh BUILD_DIR PROJECT_DIR WORK_DIR MPIRUN
# Installs the built tree into a fresh prefix, builds an outside project against it with
# find_package(ztrain), and runs it on two ranks; the installed ztrain-gpt runs with no environment.
set -euo pipefail
build=$1 project=$2 work=$3 mpirun=$4
rm -rf "$work"
cmake --install "$build" --prefix "$work/prefix" >/dev/null
if [[ -x $work/prefix/bin/ztrain-gpt ]]; then
  env -i "$work/prefix/bin/ztrain-gpt" --help | grep -q "ztrain-gpt: train" ||
    { echo "the installed ztrain-gpt does not run with no environment set" >&2; exit 1; }
fi
cmake -S "$project" -B "$work/build" -DCMAKE_PREFIX_PATH="$work/prefix" -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build "$work/build" -j "${ZTRAIN_JOBS:-2}"
"$mpirun" -np 2 --oversubscribe --bind-to none "$work/build/consumer"
