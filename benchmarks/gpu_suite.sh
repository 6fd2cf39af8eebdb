#!/usr/bin/env bash
# The whole GPU check in one call: the test suite compiled for the GPU, the notebooks under nbval
# in GPU mode, then benchmarks/gpu_check.py (correctness and timings, fla side by side).
#
#   bash benchmarks/gpu_suite.sh [tests] [notebooks] [bench -- <gpu_check.py arguments>]
#
# With no step named, runs all three. Logs and results go to $RESULTS (default benchmarks/results).
set -uo pipefail
cd "$(dirname "$0")/.."
RESULTS=${RESULTS:-benchmarks/results}
mkdir -p "$RESULTS"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

steps=() bench_args=()
while [ $# -gt 0 ]; do
  case "$1" in
    --) shift; bench_args=("$@"); break ;;
    *) steps+=("$1"); shift ;;
  esac
done
[ ${#steps[@]} -gt 0 ] || steps=(tests notebooks bench)

status=0
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv | tee "$RESULTS/gpu.txt"
for step in "${steps[@]}"; do
  case "$step" in
    tests)
      python3 -m pytest tests -q -n 8 -p no:cacheprovider -o addopts="-ra" 2>&1 | tee "$RESULTS/tests.log" | tail -25
      status=$((status | ${PIPESTATUS[0]})) ;;
    notebooks)
      python3 -m pytest notebooks -q -p no:cacheprovider 2>&1 | tee "$RESULTS/notebooks.log" | tail -25
      status=$((status | ${PIPESTATUS[0]})) ;;
    bench)
      python3 benchmarks/gpu_check.py --out "$RESULTS" "${bench_args[@]}" 2>&1 | tee "$RESULTS/bench.log"
      status=$((status | ${PIPESTATUS[0]})) ;;
    *) echo "unknown step $step"; exit 2 ;;
  esac
done
exit $status
