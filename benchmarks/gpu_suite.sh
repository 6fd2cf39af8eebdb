#!/usr/bin/env bash
# The whole GPU check in one call: the test suite compiled for the GPU, the notebooks under nbval
# in GPU mode, python -m ttx_tutorial.bench (every method and peer side by side, timings and
# errors), then benchmarks/gpu_check.py's config tuning and precision.
#
#   bash benchmarks/gpu_suite.sh [peers] [tests] [compile] [notebooks] [bench] [check] [-- <bench arguments>]
#
# With no step named, runs the last five. "peers" builds fast-transformers' causal product
# (benchmarks/build_fast_transformers.py) from a checkout in $FAST_TRANSFORMERS_SOURCE (default
# .peers/fast-transformers) and puts it on PYTHONPATH for the steps after it. Logs and results go to $RESULTS (default benchmarks/results).
# On a 16-core H200 machine with a cold Triton cache the tests take about 5 minutes with
# TTX_HYPOTHESIS_EXAMPLES=10 (the default here; raise it for a longer run), the notebooks about 4
# (notebook 05 times every method on the GPU). "compile" is the CPU-side check of every launch
# for sm_80/sm_90 (585 compiles): it needs no GPU, but checks the GPU machine's Triton version.
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
[ ${#steps[@]} -gt 0 ] || steps=(tests compile notebooks bench check)
workers=$(( $(nproc) > 3 ? $(nproc) - 3 : 1 ))  # leave cores to the GPU process and the launcher

status=0
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv | tee "$RESULTS/gpu.txt"
for step in "${steps[@]}"; do
  case "$step" in
    peers)
      site="$(cd "$RESULTS" && pwd)/peer-site"
      python3 benchmarks/build_fast_transformers.py --source "${FAST_TRANSFORMERS_SOURCE:-.peers/fast-transformers}" \
        --target "$site" 2>&1 | tail -3
      status=$((status | ${PIPESTATUS[0]}))
      export PYTHONPATH="$site:$PYTHONPATH" ;;
    tests)
      TTX_HYPOTHESIS_EXAMPLES=${TTX_HYPOTHESIS_EXAMPLES:-10} python3 -m pytest tests -q -n "$workers" \
        -p no:cacheprovider -o addopts="-ra" --ignore=tests/test_compile_targets.py 2>&1 \
        | tee "$RESULTS/tests.log" | tail -25
      status=$((status | ${PIPESTATUS[0]})) ;;
    compile)
      python3 -m pytest tests/test_compile_targets.py -q -n "$workers" -p no:cacheprovider -o addopts="-ra" 2>&1 \
        | tee "$RESULTS/compile.log" | tail -25
      status=$((status | ${PIPESTATUS[0]})) ;;
    notebooks)
      python3 -m pytest notebooks -q -p no:cacheprovider 2>&1 | tee "$RESULTS/notebooks.log" | tail -25
      status=$((status | ${PIPESTATUS[0]})) ;;
    bench)
      python3 -m ttx_tutorial.bench --out "$RESULTS" "${bench_args[@]}" 2>&1 | tee "$RESULTS/bench.log"
      status=$((status | ${PIPESTATUS[0]})) ;;
    check)
      python3 benchmarks/gpu_check.py --out "$RESULTS" 2>&1 | tee "$RESULTS/check.log"
      status=$((status | ${PIPESTATUS[0]})) ;;
    *) echo "unknown step $step"; exit 2 ;;
  esac
done
exit $status
