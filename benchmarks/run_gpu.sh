#!/usr/bin/env bash
# The GPU machine's script: the test suite, then the benchmark; logs and results go to $OUT.
#
#   bash benchmarks/run_gpu.sh                 # tests, then the full benchmark
#   bash benchmarks/run_gpu.sh tests           # only the tests
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
bench_args=()
while [ $# -gt 0 ]; do
    case "$1" in
        tests) run_tests=1 ;;
        bench) run_bench=1 ;;
        quick) run_bench=1; bench_args+=(--quick) ;;
        --) shift; run_bench=1; bench_args+=("$@"); break ;;
        *) echo "usage: $0 [tests] [bench | quick] [-- bench options]" >&2; exit 2 ;;
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
    # as the benchmark does; four minutes on an H100 with 8 workers.
    FLASH_DMA_AUTOTUNE=0 python3 -m pytest -n 8 -q tests 2>&1 | tee "$OUT/tests.log" || status=1
fi
if [ "$run_bench" = 1 ]; then
    python3 -m flash_dma.cli bench --out "$OUT" "${bench_args[@]}" 2>&1 | tee "$OUT/bench.log" || status=1
fi
exit "$status"
