#!/usr/bin/env bash
# The GPU check. On a machine with a CUDA GPU and a PyTorch 2.x whose python is $ZTRAIN_PYTHON
# (default python3), with CMake, ninja and a C++ compiler: builds ztrain against that PyTorch
# into build-gpu/ (or $ZTRAIN_BUILD_DIR), runs the GPU test tier (ctest -L gpu: every test
# registered with GPU, on ZTRAIN_DEVICE=cuda) and gpt_bench on the GPU, and prints a summary.
#
# Open MPI, GoogleTest, CLI11, nlohmann-json and OpenSSL come from the system, or, where it has no
# package registry, from Debian 12 packages in $ZTRAIN_DEBS (made by scripts/gpu_debs.sh elsewhere),
# unpacked into the build directory with dpkg-deb (or ar and tar) and used from there.
#
#   ZTRAIN_DEBS=gpu-debs scripts/gpu_check.sh
#   scripts/gpu_check.sh -R block_parity        # extra arguments go to ctest
#   ZTRAIN_GPU_BENCH=0 scripts/gpu_check.sh -L nccl   # the NCCL tests, no benchmarks
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${ZTRAIN_BUILD_DIR:-$root/build-gpu}
python=${ZTRAIN_PYTHON:-python3}
log=$build/gpu_check
mkdir -p "$log"

for tool in cmake ninja c++ "$python"; do
  command -v "$tool" >/dev/null || { echo "gpu_check: $tool is not on PATH"; exit 1; }
done
gpu=$("$python" -c 'import torch; print(torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")')
[[ -n $gpu ]] || { echo "gpu_check: $python's torch sees no CUDA device"; exit 1; }
torch_version=$("$python" -c 'import torch; print(torch.__version__)')
echo "gpu_check: $gpu, PyTorch $torch_version"

cmake_args=()
if [[ -n ${ZTRAIN_DEBS:-} ]]; then
  deps=$build/deps
  if [[ ! -f $deps/.unpacked ]]; then
    mkdir -p "$deps"
    for deb in "$ZTRAIN_DEBS"/*.deb; do
      if command -v dpkg-deb >/dev/null; then
        dpkg-deb -x "$deb" "$deps"
      else  # a .deb is an ar archive whose data.tar.* holds the files
        tmp=$(mktemp -d)
        member=$(ar t "$deb" | grep '^data\.tar')
        (cd "$tmp" && ar x "$deb" "$member")
        tar -xf "$tmp/$member" -C "$deps"
        rm -rf "$tmp"
      fi
    done
    touch "$deps/.unpacked"
  fi
  # Debian's Open MPI, relocated: its tools under their .openmpi names, OPAL_PREFIX for its paths.
  mkdir -p "$deps/bin"
  for tool in mpirun mpiexec mpicxx mpicc; do ln -sf "$deps/usr/bin/$tool.openmpi" "$deps/bin/$tool"; done
  arch_lib=$deps/usr/lib/x86_64-linux-gnu
  export PATH=$deps/bin:$PATH OPAL_PREFIX=$deps/usr
  # Quiet where the machine has a PMIx of its own whose plugins do not match the unpacked one.
  export PMIX_MCA_mca_base_component_show_load_errors=0 PMIX_MCA_pcompress_base_silence_warning=1
  export LD_LIBRARY_PATH=$arch_lib:$arch_lib/openmpi/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  cmake_args+=(-DCMAKE_PREFIX_PATH="$deps/usr" -DMPI_CXX_COMPILER="$deps/bin/mpicxx" -DMPI_C_COMPILER="$deps/bin/mpicc")
fi
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1

echo "gpu_check: building into $build"
ZTRAIN_BUILD_DIR=$build ZTRAIN_PYTHON=$(command -v "$python") "$root/scripts/build.sh" "${cmake_args[@]}" \
  > "$log/build.log" 2>&1 || { tail -40 "$log/build.log"; echo "gpu_check: the build failed ($log/build.log)"; exit 1; }

echo "gpu_check: ctest -L gpu"
set +e
(cd "$build" && ctest -L gpu --output-on-failure -j "${ZTRAIN_TEST_JOBS:-4}" "$@") > "$log/ctest.log" 2>&1
tests_rc=$?
set -e
tail -25 "$log/ctest.log"

if [[ ${ZTRAIN_GPU_BENCH:-1} == 0 ]]; then  # the tests alone
  grep -E "tests passed|tests failed" "$log/ctest.log" || echo "  ctest printed no summary"
  exit $tests_rc
fi

# gpt_bench on the GPU: plain libtorch and ztrain at levels 0 and 3, a GPT-2-124M-sized model in
# bf16 and the small preset in fp32, on byte data made from the repository's own text; and the
# same two in PyTorch eager (bench/peer_torch.py --system eager).
corpus=$build/gpu_check/corpus.txt
cat "$root"/docs/*.md "$root"/src/*/*.cpp "$root"/include/ztrain/*/*.h > "$corpus"
bench=$build/bench/gpt_bench
results=$log/bench.jsonl
: > "$results"
bench_failures=0
run_bench() {
  "$bench" --device cuda --data "$corpus" --steps 10 --warmup 3 --json "$results" "$@" > /dev/null \
    2>> "$log/bench.log" || { echo "gpu_check: gpt_bench $* failed ($log/bench.log)"; bench_failures=$((bench_failures + 1)); }
}
run_peer() {  # PyTorch eager on the GPU, the same model and batches
  "$python" "$root/bench/peer_torch.py" --system eager --device cuda --data "$corpus" --steps 10 --warmup 3 \
    --json "$results" "$@" > /dev/null 2>> "$log/bench.log" ||
    { echo "gpu_check: peer_torch $* failed ($log/bench.log)"; bench_failures=$((bench_failures + 1)); }
}
for system in "--system plain" "--level 0" "--level 3"; do
  # shellcheck disable=SC2086
  run_bench $system --preset gpt2 --dtype bf16 --batch 8 --seq 256 --probe --tag gpt2-bf16
  # shellcheck disable=SC2086
  run_bench $system --preset small --dtype fp32 --batch 8 --tag small-fp32
done
run_peer --preset gpt2 --dtype bf16 --batch 8 --seq 256 --tag gpt2-bf16
run_peer --preset small --dtype fp32 --batch 8 --tag small-fp32

echo
echo "gpu_check: summary ($gpu, PyTorch $torch_version)"
grep -E "tests passed|tests failed" "$log/ctest.log" || echo "  ctest printed no summary"
# A GPU test that did not run is not a pass: the check fails then, as when a benchmark failed.
skipped=$(grep -c '\*\*\*Skipped' "$log/ctest.log" || true)
((skipped == 0)) || { echo "  $skipped GPU tests did not run (skipped: no CUDA device visible to them)"; tests_rc=1; }
((bench_failures == 0)) || { echo "  $bench_failures benchmark runs failed ($log/bench.log)"; tests_rc=1; }
"$python" - "$results" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    system = r["system"] + ("" if r["level"] is None else f" level {r['level']}")
    peak = (r.get("matmul") or {}).get(r["dtype"], {}).get("peak_gflops")
    mfu = f", {100 * r['model_gflops_per_rank'] / peak:.1f}% of the {r['dtype']} matmul peak" if peak else ""
    print(f"  {r['tag']:11} {system:16} {r['tokens_per_s']:10.0f} tokens/s, step {r['step_s']['median'] * 1e3:7.1f} ms{mfu}")
PY
exit $tests_rc
