# Shared by the ztrain-gpt benchmark scripts (sourced, not run).
#   gpt_bench_setup NAME BUILD_DIR   sets gpt (the binary), root (the repository) and work (a
#                                    temporary directory removed on exit); one thread per rank
#   median_tokens METRICS_JSONL      the median tokens/s after the first five steps

gpt_bench_setup() {
  root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
  gpt=$2/apps/ztrain-gpt/ztrain-gpt
  [[ -x $gpt ]] || { echo "$1: $gpt not found; build first (scripts/build.sh)" >&2; exit 1; }
  work=$(mktemp -d)
  trap 'rm -rf "$work"' EXIT
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1
}

median_tokens() {
  python3 -c '
import json, statistics, sys
v = [json.loads(l)["tokens_per_s"] for l in open(sys.argv[1]) if l.strip()][5:]
print(f"{statistics.median(v):.0f}")' "$1"
}
