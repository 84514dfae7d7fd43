#!/usr/bin/env bash
# The GPU machine's one prepared run (about 15 minutes of device time per session, machine start
# included): offline install, the kernel tests compiled on CUDA (bf16 included), the kernel benchmark
# at 16K/20%, end-to-end TTFT at 16K/0.2, then the rest of the grid while the budget lasts. Each step
# has its own time limit inside the budget, so one failing or slow step leaves the others' results.
#
#   here:  bash scripts/gpu_wheels.sh                      # lmdb for Python 3.12 into .whl/ (ignored)
#   there: bash bench/gpu_check.sh OUTDIR [BUDGET_S]       # device tool: carry [".whl"], OUTDIR=$OUT
#
# OUTDIR receives env.txt, one log per step, kernel_h200.json, gpu_e2e_h200.json (commit these two as
# bench/results/) and summary.json (each step's exit code and seconds).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: bench/gpu_check.sh OUTDIR [BUDGET_S]}
budget=${2:-400}
mkdir -p "$out"
start=$(date +%s)
export PYTHONUNBUFFERED=1

# offline install: only the wheels the image lacks; the checkout itself goes on PYTHONPATH
if ! python3 -c "import lmdb" 2>/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || { echo "offline install failed"; exit 1; }
fi
export PYTHONPATH="$PWD:/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    python3 -c "import sys, torch, transformers, triton, lmdb; print('python', sys.version.split()[0], 'torch', torch.__version__, 'transformers', transformers.__version__, 'triton', triton.__version__, 'lmdb', lmdb.__version__)"
} 2>&1 | tee "$out/env.txt"

summary=()
step() {  # step NAME WANT_S CMD...: run CMD with min(WANT_S, budget left) seconds, log to OUTDIR/NAME.log
    local name=$1 want=$2
    shift 2
    local left=$((budget - ($(date +%s) - start)))
    if [ "$left" -lt 20 ]; then
        echo "== $name: skipped, $left s of the budget left"
        summary+=("\"$name\": {\"rc\": null, \"s\": 0}")
        return
    fi
    local limit=$((want < left ? want : left)) t0=$(date +%s)
    echo "== $name (limit $limit s)"
    timeout "$limit" "$@" 2>&1 | tee "$out/$name.log"
    local rc=${PIPESTATUS[0]}
    echo "== $name: exit $rc in $(( $(date +%s) - t0 )) s"
    summary+=("\"$name\": {\"rc\": $rc, \"s\": $(( $(date +%s) - t0 ))}")
}

step kernel_tests 100 python3 -m pytest -q -p no:cacheprovider -o addopts= tests/test_kernel.py
step fp8_decode 40 python3 -m pytest -q -p no:cacheprovider -o addopts= tests/test_lean_store.py -k cuda
step kernel_bench 90 python3 bench/bench_kernel.py --contexts 16384 --ratios 0.2 --json "$out/kernel_h200.json"
step e2e_16k 170 python3 bench/bench_gpu_e2e.py --lengths 16384 --ratios 0.2 --repeats 3 --tier host \
    --json "$out/gpu_e2e_h200.json"
step kernel_grid 60 python3 bench/bench_kernel.py --contexts 4096 8192 16384 --ratios 0.1 0.3 --no-flex \
    --json "$out/kernel_grid_h200.json"
step e2e_grid 120 python3 bench/bench_gpu_e2e.py --lengths 4096,8192 --ratios 0.1,0.2,0.3 --repeats 3 --tier host \
    --aux gpu --json "$out/gpu_e2e_grid_h200.json"

printf '{%s}\n' "$(IFS=,; echo "${summary[*]}")" > "$out/summary.json"
cat "$out/summary.json"
echo "total $(( $(date +%s) - start )) s"
