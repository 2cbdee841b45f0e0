#!/usr/bin/env bash
# fusekit's checks on a machine with a CUDA device, in one run of about 6 minutes at most:
#   1. builds the C++ core in place (the checkout's Python; nothing is installed),
#   2. runs every test marked `gpu` (pytest -m gpu over the test files that have one),
#   3. runs benchmarks/bench_gpu.py: cost matrices and ResNet-50 fusions, CPU against CUDA.
# Everything it writes goes under $OUT (default: ./device-check): machine.txt, build.log,
# pytest-gpu.log, bench.log, bench_gpu.json, bench_gpu.md and summary.txt (one line a stage).
# Each stage has its own time limit (BUILD_S, TESTS_S, BENCH_S seconds), so one that hangs
# leaves time to the others; the exit status is the first failing stage's.
#
#   OUT=/some/folder bash benchmarks/device_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/device-check}
PYTHON=${PYTHON:-python}
BUILD_S=${BUILD_S:-100} TESTS_S=${TESTS_S:-130} BENCH_S=${BENCH_S:-140}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
status=0

stage() {  # stage NAME RC: one line in summary.txt; the first failure sets the exit status
    echo "$(date -u +%H:%M:%S) $1: $([ "$2" = 0 ] && echo ok || echo "FAILED (rc $2)")" \
        | tee -a "$OUT/summary.txt"
    [ "$2" = 0 ] || [ "$status" != 0 ] || status=$2
}

{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1
    nproc
    "$PYTHON" -c 'import sys, numpy, scipy, torch; print(sys.version.split()[0], "numpy",
numpy.__version__, "scipy", scipy.__version__, "torch", torch.__version__, "cuda",
torch.version.cuda, torch.cuda.is_available() and torch.cuda.get_device_name(0))'
} > "$OUT/machine.txt" 2>&1
cat "$OUT/machine.txt"

# The command line's package is a link to cli/ that a checkout does not carry.
[ -e fusekit/_cli ] || ln -s ../cli fusekit/_cli

NPY_NUM_BUILD_JOBS=$(nproc) timeout "$BUILD_S" "$PYTHON" setup.py build_ext --inplace \
    > "$OUT/build.log" 2>&1
rc=$?
stage build $rc
if [ $rc != 0 ]; then tail -20 "$OUT/build.log"; exit $rc; fi

mapfile -t files < <(grep -l "pytest.mark.gpu" tests/test_*.py)
timeout "$TESTS_S" "$PYTHON" -m pytest -m gpu -q -p no:cacheprovider -rs \
    --continue-on-collection-errors "${files[@]}" \
    > "$OUT/pytest-gpu.log" 2>&1
rc=$?
stage "pytest -m gpu (${#files[@]} files): $(tail -1 "$OUT/pytest-gpu.log")" $rc
[ $rc = 0 ] || grep -E "^(FAILED|ERROR)" "$OUT/pytest-gpu.log" | head -20

timeout "$BENCH_S" "$PYTHON" benchmarks/bench_gpu.py --device cuda --timeout 40 --repeats 3 \
    --json-out "$OUT/bench_gpu.json" --md-out "$OUT/bench_gpu.md" > "$OUT/bench.log" 2>&1
rc=$?
stage bench_gpu $rc
[ $rc = 0 ] || tail -5 "$OUT/bench.log"
cat "$OUT/bench_gpu.md" 2>/dev/null
cat "$OUT/summary.txt"
exit $status
