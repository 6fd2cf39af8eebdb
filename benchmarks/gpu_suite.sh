#!/usr/bin/env bash
# The GPU checks, one step after another, each logged to $RESULTS (default benchmarks/results):
#
#   bash benchmarks/gpu_suite.sh [STEP ...] [-- <bench arguments>]
#
#   peers      build fast-transformers' causal product (benchmarks/build_fast_transformers.py)
#              from a checkout in $FAST_TRANSFORMERS_SOURCE (default .peers/fast-transformers) and
#              put it on PYTHONPATH for the steps after it
#   tests      the test suite on the GPU, one line per test in tests.log and the slowest tests at
#              its end, without the next two steps' files and test_packaging.py (it builds fresh
#              environments: CI's); TESTS_SHARD=i/n runs every n-th file from the i-th (by name)
#              into tests-i-of-n.log, for runs whose calls are shorter than the suite (480 s on
#              an H200 machine's 13 workers did not finish it); tests, not files, go to the
#              workers, since whole files (test_recurrent.py, test_precision.py) set the pace
#   size       tests/test_limits_at_size.py with TTX_SIZE_TESTS=1 on 3 workers (4 GiB tensors;
#              about a minute on an H200), printing the errors they measure
#   fuzz       tests/test_fuzz.py with hypothesis' statistics (TTX_HYPOTHESIS_EXAMPLES examples,
#              default 10 here; 100 took 7 minutes on an H200)
#   compile    the CPU-side compile of every launch for sm_80/sm_90 with this machine's Triton
#   notebooks  every notebook under nbval in GPU mode
#   bench      python -m ttx_tutorial.bench (every method and peer side by side)
#   check      benchmarks/gpu_check.py (config tuning, precision)
#   packed     benchmarks/varlen_check.py (packed batches against unpacked and fla)
#   host       benchmarks/host_overhead.py (where a call's host time goes; bfloat16, then float32 under "high")
#   layer      benchmarks/layer_check.py (normalised attention, the layer, the step, compiled)
#   float32    benchmarks/float32_sweep.py --no-peers (every float32 setting and candidate)
#
# With no step named: tests size fuzz compile notebooks bench check. On a 16-core H200 machine
# with a cold Triton cache the tests took more than 320 s with 13 workers, the notebooks 193 s
# with 4; two invocations may run side by side (different steps write different logs), though
# the tests can then hold most of the GPU's memory while notebook 03's live timings allocate the
# quadratic reference's 8 GiB of scores, which can then run out of memory. fla's
# first calls autotune for minutes, so steps that time fla come last.
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
[ ${#steps[@]} -gt 0 ] || steps=(tests size fuzz compile notebooks bench check)
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
      shard=${TESTS_SHARD:-1/1} log="$RESULTS/tests.log"
      [ "$shard" = 1/1 ] || log="$RESULTS/tests-${shard%/*}-of-${shard#*/}.log"
      mapfile -t files < <(LC_ALL=C ls tests/test_*.py | grep -v -E "test_(compile_targets|packaging|limits_at_size|fuzz)\.py" \
        | awk -v i="${shard%/*}" -v n="${shard#*/}" '(NR - i) % n == 0')
      TTX_HYPOTHESIS_EXAMPLES=${TTX_HYPOTHESIS_EXAMPLES:-10} python3 -m pytest "${files[@]}" -v -n "$workers" \
        --dist load -p no:cacheprovider -o addopts="-ra --durations=15" > "$log" 2>&1
      status=$((status | $?))
      grep -E "^(FAILED|ERROR) " "$log" | head -30; tail -1 "$log" ;;
    size)
      TTX_SIZE_TESTS=1 python3 -m pytest tests/test_limits_at_size.py -v -n 3 --dist load -p no:cacheprovider \
        -o addopts="-raP --durations=10" > "$RESULTS/size.log" 2>&1
      status=$((status | $?))
      grep -E "largest relative error|^(FAILED|ERROR) " "$RESULTS/size.log"; tail -1 "$RESULTS/size.log" ;;
    fuzz)
      TTX_HYPOTHESIS_EXAMPLES=${TTX_HYPOTHESIS_EXAMPLES:-10} python3 -m pytest tests/test_fuzz.py -v -p no:xdist \
        -p no:cacheprovider -o addopts="-ra" --hypothesis-show-statistics > "$RESULTS/fuzz.log" 2>&1
      status=$((status | $?))
      grep -E "passing|Stopped|^(FAILED|ERROR) " "$RESULTS/fuzz.log"; tail -1 "$RESULTS/fuzz.log" ;;
    compile)
      python3 -m pytest tests/test_compile_targets.py -q -n "$workers" -p no:cacheprovider -o addopts="-ra" 2>&1 \
        | tee "$RESULTS/compile.log" | tail -25
      status=$((status | ${PIPESTATUS[0]})) ;;
    notebooks)
      python3 -m pytest notebooks -q -n 4 --dist loadfile -p no:cacheprovider 2>&1 | tee "$RESULTS/notebooks.log" | tail -25
      status=$((status | ${PIPESTATUS[0]})) ;;
    bench)
      python3 -m ttx_tutorial.bench --out "$RESULTS" "${bench_args[@]}" 2>&1 | tee "$RESULTS/bench.log"
      status=$((status | ${PIPESTATUS[0]})) ;;
    check)
      python3 benchmarks/gpu_check.py --out "$RESULTS" 2>&1 | tee "$RESULTS/check.log"
      status=$((status | ${PIPESTATUS[0]})) ;;
    packed)
      python3 benchmarks/varlen_check.py --json "$RESULTS/varlen.json" 2>&1 | tee "$RESULTS/varlen.log"
      status=$((status | ${PIPESTATUS[0]})) ;;
    host)
      python3 benchmarks/host_overhead.py --json "$RESULTS/host.json" 2>&1 | tee "$RESULTS/host.log"
      status=$((status | ${PIPESTATUS[0]}))
      python3 benchmarks/host_overhead.py --dtype float32 --json "$RESULTS/host_float32.json" 2>&1 \
        | tee "$RESULTS/host_float32.log"
      status=$((status | ${PIPESTATUS[0]})) ;;
    layer)
      python3 benchmarks/layer_check.py "$RESULTS/layer.json" --rounds 1 2>&1 | tee "$RESULTS/layer.log"
      status=$((status | ${PIPESTATUS[0]})) ;;
    float32)
      python3 benchmarks/float32_sweep.py --no-peers --out "$RESULTS/float32.json" 2>&1 | tee "$RESULTS/float32.log"
      status=$((status | ${PIPESTATUS[0]})) ;;
    *) echo "unknown step $step"; exit 2 ;;
  esac
done
exit $status
