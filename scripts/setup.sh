#!/usr/bin/env bash
# Installs everything ztrain's build, tests, benchmarks and trainer need (Debian 12). Idempotent:
# Debian packages already present are left alone, and the project's Python environment is made
# or completed only when something in it is missing.
#
# libtorch comes from PyTorch's PyPI build, pinned below, in the virtual environment .venv (or
# $ZTRAIN_VENV); CMake finds it through that Python's torch.utils.cmake_prefix_path. The same
# Python computes golden values and runs the PyTorch peers of the benchmarks. To build against a
# PyTorch you already have, skip this environment: ZTRAIN_PYTHON=/path/to/python scripts/setup.sh
# checks that Python instead, and scripts/build.sh uses it.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)

torch_version=2.11.0
# PyPI's torch is a CUDA build. Its CUDA libraries (cudart, cuBLAS, cuFFT, cuRAND, cuSOLVER,
# cuSPARSE, CUPTI, NVRTC, nvJitLink, cuDNN, NCCL) are what a CUDA 13 toolkit installs; when the
# dynamic loader finds those, only the three that a toolkit lacks are fetched (about 230 MB
# instead of several GB). These are torch 2.11.0's own pins.
torch_cuda_extras=(nvidia-cusparselt-cu13==0.8.0 nvidia-nvshmem-cu13==3.4.5 nvidia-cufile==1.15.1.6)
toolkit_libs=(libcudart.so.13 libcublas.so.13 libcublasLt.so.13 libcufft.so.12 libcurand.so.10
              libcusolver.so.12 libcusparse.so.12 libcupti.so.13 libnvrtc.so.13 libnvJitLink.so.13
              libcudnn.so.9 libnccl.so.2)
# torch's Python dependencies, and numpy and matplotlib for the tests and benchmark reports.
python_packages=(filelock==3.20.0 typing-extensions==4.15.0 sympy==1.14.0 mpmath==1.3.0
                 networkx==3.5 jinja2==3.1.6 markupsafe==3.0.3 fsspec==2025.10.0 "setuptools<82"
                 numpy==2.3.5 matplotlib==3.10.7
                 # the Python package's test runner
                 pytest==8.3.5 iniconfig==2.1.0 pluggy==1.6.0
                 # test references only: Hugging Face transformers (tests/apps/hf_interop_test.sh),
                 # tokenizers and sentencepiece (tests/apps/tokenizer_test.sh) and TensorBoard's event
                 # reader (tests/apps/tensorboard_test.sh)
                 transformers==4.57.1 tokenizers==0.22.2 safetensors==0.8.0 huggingface-hub==0.36.2 sentencepiece==0.2.1
                 tensorboard==2.20.0 protobuf==7.36.2 grpcio==1.85.3 absl-py==2.5.1)

packages=(
  build-essential cmake ninja-build git pkg-config ca-certificates
  python3-venv                 # the project's Python environment
  libopenmpi-dev openmpi-bin   # communication and launch
  libgtest-dev libgmock-dev libbenchmark-dev
  libcli11-dev nlohmann-json3-dev libfmt-dev
  libssl-dev                   # SHA-256 of checkpoint files (libcrypto)
  libpcre2-dev libsentencepiece-dev  # tokenizers: pre-tokenizer expressions, SentencePiece models
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

has_torch() {  # python: torch imports, and is a 2.x
  "$1" -c 'import sys, torch; sys.exit(int(torch.__version__.split(".")[0]) < 2)' 2>/dev/null
}

if [[ -n ${ZTRAIN_PYTHON:-} ]]; then
  has_torch "$ZTRAIN_PYTHON" || {
    echo "setup: ZTRAIN_PYTHON=$ZTRAIN_PYTHON cannot import a PyTorch 2.x" >&2; exit 1; }
  echo "setup: all dependencies present (PyTorch of $ZTRAIN_PYTHON)"
  exit 0
fi

venv=${ZTRAIN_VENV:-$root/.venv}
py=$venv/bin/python
# The installed version from the package's metadata: importing torch to ask takes seconds.
installed_version() { "$py" -c 'from importlib.metadata import version; print(version("torch"))' 2>/dev/null || true; }
# What the venv was made with: a venv made from another list is brought up to this one.
stamp=$venv/.ztrain-packages
wanted="torch==$torch_version ${python_packages[*]}"
if [[ $(installed_version) != "$torch_version"* || $(cat "$stamp" 2>/dev/null) != "$wanted" ]]; then
  base=$(command -v python3)
  "$base" -c 'import ensurepip, venv' 2>/dev/null || base=/usr/bin/python3
  [[ -x $py ]] || "$base" -m venv "$venv"
  # Byte-compiled at install (about a minute here): with PYTHONDONTWRITEBYTECODE set, as on the CI,
  # Python would otherwise compile torch's modules again in every process of the tests.
  pip=("$py" -m pip install -q --disable-pip-version-check --no-input)
  echo "setup: installing PyTorch $torch_version and the pinned Python packages into $venv"
  "${pip[@]}" "${python_packages[@]}"
  have_toolkit=1
  loader_cache=$("$(command -v ldconfig || echo /sbin/ldconfig)" -p)
  for lib in "${toolkit_libs[@]}"; do
    grep -qF "$lib" <<<"$loader_cache" || { have_toolkit=0; break; }
  done
  if ((have_toolkit)); then
    "${pip[@]}" --no-deps "torch==$torch_version" "${torch_cuda_extras[@]}"
  else
    echo "setup: no CUDA 13 toolkit found; PyTorch brings its own CUDA libraries"
    "${pip[@]}" "torch==$torch_version"
  fi
  [[ $(installed_version) == "$torch_version"* ]] && has_torch "$py" || {
    echo "setup: PyTorch $torch_version in $venv does not import:" >&2
    "$py" -c 'import torch' >&2; exit 1; }
  echo "$wanted" > "$stamp"
fi
echo "setup: all dependencies present (PyTorch $(installed_version) in $venv)"
