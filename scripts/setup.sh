#!/usr/bin/env bash
# Installs everything ztrain's build, tests, benchmarks and trainer need (Debian 12). Idempotent:
# packages already present are left alone, and apt-get runs only when something is missing.
set -euo pipefail

packages=(
  build-essential cmake ninja-build git pkg-config ca-certificates
  libtorch-dev                 # libtorch 1.13 (CPU)
  libopenblas0-pthread         # fast BLAS for libtorch at run time
  libopenmpi-dev openmpi-bin   # communication and launch
  libgtest-dev libgmock-dev libbenchmark-dev
  libcli11-dev nlohmann-json3-dev libfmt-dev
  python3-torch                # PyTorch golden values and peer benchmarks (never at run time)
  python3-matplotlib           # the plots of bench/run_all.sh
)

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done

if ((${#missing[@]})); then
  echo "setup: installing ${missing[*]}"
  sudo=""
  [[ $(id -u) -eq 0 ]] || sudo="sudo"
  export DEBIAN_FRONTEND=noninteractive
  $sudo apt-get update -qq
  $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
echo "setup: all dependencies present"
