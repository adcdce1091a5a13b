#!/usr/bin/env bash
# The main job: installs dependencies, builds, and launches ztrain-gpt on 2 ranks (or
# $ZTRAIN_RANKS). Extra arguments go to ztrain-gpt.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
"$root/scripts/setup.sh"
"$root/scripts/build.sh" >/dev/null
build=${ZTRAIN_BUILD_DIR:-$root/build}
ranks=${ZTRAIN_RANKS:-2}
flags=(--bind-to none)
(( ranks > $(nproc) )) && flags+=(--oversubscribe)
[[ $(id -u) -eq 0 ]] && export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
exec mpirun -np "$ranks" "${flags[@]}" "$build/apps/ztrain-gpt/ztrain-gpt" "$@"
