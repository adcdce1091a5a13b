#!/usr/bin/env bash
# Usage: examples_test.sh README EXAMPLE MPIRUN BINARY
# The README's example must be examples/quickstart.cpp verbatim, and it must run on 2 ranks.
set -euo pipefail
readme=$1 example=$2 mpirun=$3 binary=$4
if ! diff <(awk '/^```cpp/{f=1;next} /^```/{if(f){exit}} f' "$readme") "$example"; then
  echo "examples_test: the first C++ block of README.md differs from $example (diff above)"
  exit 1
fi
"$mpirun" -np 2 --oversubscribe --bind-to none "$binary"
