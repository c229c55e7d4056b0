#!/usr/bin/env bash
# The GPU machine's script: the test suite, then the benchmark; logs and results go to $OUT.
#
#   bash benchmarks/run_gpu.sh                 # tests, then the full benchmark
#   bash benchmarks/run_gpu.sh tests           # only the tests
#   bash benchmarks/run_gpu.sh tests 1/2       # the first of two shards of the test files (to fit a time limit)
#   bash benchmarks/run_gpu.sh bench           # only the benchmark
#   bash benchmarks/run_gpu.sh quick           # only the benchmark's --quick subset
#   bash benchmarks/run_gpu.sh bench -- --suite llm --methods flash-dma,flex
#
# Anything after `--` goes to `flash-dma bench`. The benchmark runs even when a test fails, so
# one run answers both questions; the exit status is non-zero if either part failed.
# The machine has no network: nothing is installed, the checkout runs from PYTHONPATH=.
set -o pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-benchmarks/results}"
mkdir -p "$OUT"
export PYTHONPATH=. PYTHONUNBUFFERED=1

run_tests=0
run_bench=0
shard=""
bench_args=()
while [ $# -gt 0 ]; do
    case "$1" in
        tests) run_tests=1
               if [[ "${2:-}" =~ ^[0-9]+/[0-9]+$ ]]; then shard=$2; shift; fi ;;
        bench) run_bench=1 ;;
        quick) run_bench=1; bench_args+=(--quick) ;;
        --) shift; run_bench=1; bench_args+=("$@"); break ;;
        *) echo "usage: $0 [tests [I/N]] [bench | quick] [-- bench options]" >&2; exit 2 ;;
    esac
    shift
done
if [ "$run_tests" = 0 ] && [ "$run_bench" = 0 ]; then
    run_tests=1
    run_bench=1
fi

status=0
if [ "$run_tests" = 1 ]; then
    # The tests take each kernel's shipped tile configuration (flash_dma/backends/triton/configs.py),
    # as the benchmark does. The whole suite took over 570 s on an H100 with 16 workers: two shards
    # fit a 10-minute limit. Shard I of N takes every N-th test file, so each gets a mix.
    files=(tests)
    if [ -n "$shard" ]; then
        mapfile -t files < <(find tests -name 'test_*.py' | sort | awk -v i="${shard%/*}" -v n="${shard#*/}" 'NR % n == i % n')
    fi
    # One line per test (-v), so that a run cut short still says which tests finished.
    FLASH_DMA_AUTOTUNE=0 python3 -m pytest -n 16 -p no:benchmark -v -rfE --durations=25 "${files[@]}" 2>&1 \
        | tee "$OUT/tests.log" | grep -v " PASSED \| SKIPPED " || status=1
fi
if [ "$run_bench" = 1 ]; then
    python3 -m flash_dma.cli bench --out "$OUT" "${bench_args[@]}" 2>&1 | tee "$OUT/bench.log" || status=1
fi
exit "$status"
