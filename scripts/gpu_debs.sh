#!/usr/bin/env bash
# Downloads the Debian 12 packages that scripts/gpu_check.sh unpacks on a GPU machine without a
# package registry: Open MPI (launcher, library, headers) with the libraries it loads, GoogleTest,
# CLI11, nlohmann-json, OpenSSL's libcrypto, PCRE2 and libsentencepiece. Run on a Debian 12
# machine with network; carry DIR along.
#
#   scripts/gpu_debs.sh gpu-debs            # then, there: ZTRAIN_DEBS=gpu-debs scripts/gpu_check.sh
set -euo pipefail
dir=${1:?usage: gpu_debs.sh DIR}
packages=(
  openmpi-bin openmpi-common libopenmpi3 libopenmpi-dev                       # Open MPI 4.1
  libpmix2 libhwloc15 libevent-core-2.1-7 libevent-pthreads-2.1-7 libfabric1   # what it loads
  libucx0 libibverbs1 librdmacm1 libnl-3-200 libnl-route-3-200 libpsm2-2 libpsm-infinipath1
  libmunge2 libnuma1 libltdl7 libpciaccess0
  libgtest-dev libgmock-dev googletest libcli11-dev nlohmann-json3-dev         # build and tests
  libssl-dev libssl3                                                           # checkpoint checksums
  libpcre2-dev libpcre2-8-0 libpcre2-16-0 libpcre2-32-0 libpcre2-posix3        # tokenizers
  libsentencepiece-dev libsentencepiece0
)
mkdir -p "$dir"
cd "$dir"
apt-get download -q "${packages[@]}" 2>&1 | grep -v "Download is performed unsandboxed" || true
echo "gpu_debs: $(ls ./*.deb | wc -l) packages, $(du -sh . | cut -f1) in $dir"
