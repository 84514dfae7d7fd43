#!/usr/bin/env bash
# The GPU machine's one prepared run (15 minutes of device time per session, machine start included).
# Headline numbers first, each step under its own time limit inside the budget, every JSON rewritten as
# it grows, so a slow or failing step leaves the others' results:
#   1. kernel_16k   bench_kernel at 16K / 20% rows: dense flash SDPA, masked SDPA, the kernel's tiles
#   2. e2e_16k      bench_gpu_e2e at 16K / ratio 0.2 from the device tier, the pinned host tier, LMDB
#   3. gpu_tests    the CUDA tests (kernel compiled, bf16, compile counts, staging, layer-wise loading)
#   4. kernel_grid  bench_kernel at 4K/8K/16K x 10/30% with FlexAttention
#   5. e2e_grid     bench_gpu_e2e at 8K and 4K
#
#   here:  bash scripts/gpu_wheels.sh                  # lmdb (and xxhash) for Python 3.12 into .whl/ (ignored)
#   there: bash bench/gpu_check.sh OUTDIR [BUDGET_S]   # device tool: carry [".whl"], OUTDIR=$OUT
#
# OUTDIR receives at most six files (the device tool returns eight): log.txt (every step's output,
# the environment first), summary.json (each step's exit code and seconds), kernel_h200.json and
# gpu_e2e_h200.json (commit these two as bench/results/), kernel_grid_h200.json, gpu_e2e_grid_h200.json.
# Without CUDA (a dry run here) every GPU step is skipped and the script still finishes.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: bench/gpu_check.sh OUTDIR [BUDGET_S]}
budget=${2:-400}
mkdir -p "$out"
log="$out/log.txt"
: > "$log"
start=$(date +%s)
export PYTHONUNBUFFERED=1

say() { echo "$*" | tee -a "$log"; }

# offline install: only the wheels the image lacks; the checkout itself goes on PYTHONPATH. A failed
# install is reported and the kernel-only steps still run (they need no lmdb).
if ! python3 -c "import lmdb, xxhash" 2>/dev/null; then
    if ls .whl/*.whl >/dev/null 2>&1 && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
            --upgrade --target /tmp/site .whl/*.whl >>"$log" 2>&1; then
        say "offline install: ok"
    else
        say "offline install failed or no wheels: the steps that read the store will fail"
    fi
fi
export PYTHONPATH="$PWD:/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 || echo "no nvidia-smi"
    python3 -c "import sys, torch, transformers; print('python', sys.version.split()[0], 'torch', torch.__version__, 'transformers', transformers.__version__, 'cuda', torch.cuda.is_available())"
    python3 -c "import triton; print('triton', triton.__version__)" 2>&1 || true
    python3 -c "import lmdb, xxhash; print('lmdb', lmdb.__version__, 'xxhash', xxhash.VERSION)" 2>&1 || true
} 2>&1 | tee -a "$log"
cuda=0
python3 -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null && cuda=1

summary=()
step() {  # step NAME WANT_S CMD...: run CMD with min(WANT_S, budget left) seconds; output into the log
    local name=$1 want=$2
    shift 2
    if [ "$cuda" -eq 0 ]; then
        say "== $name: skipped, no CUDA device"
        summary+=("\"$name\": {\"rc\": null, \"s\": 0, \"skipped\": \"no CUDA\"}")
        return
    fi
    local left=$((budget - ($(date +%s) - start)))
    if [ "$left" -lt 20 ]; then
        say "== $name: skipped, $left s of the budget left"
        summary+=("\"$name\": {\"rc\": null, \"s\": 0, \"skipped\": \"budget\"}")
        return
    fi
    local limit=$((want < left ? want : left)) t0=$(date +%s)
    say "== $name (limit $limit s)"
    timeout "$limit" "$@" 2>&1 | tee -a "$log"
    local rc=${PIPESTATUS[0]}
    say "== $name: exit $rc in $(( $(date +%s) - t0 )) s"
    summary+=("\"$name\": {\"rc\": $rc, \"s\": $(( $(date +%s) - t0 ))}")
}

step kernel_16k 60 python3 bench/bench_kernel.py --contexts 16384 --ratios 0.2 --no-flex --json "$out/kernel_h200.json"
step e2e_16k 170 python3 bench/bench_gpu_e2e.py --lengths 16384 --ratios 0.2 --repeats 3 --tiers device,host,lmdb \
    --aux gpu --json "$out/gpu_e2e_h200.json"
step gpu_tests 90 python3 -m pytest -q -p no:cacheprovider -o addopts= -n 8 -m "gpu or not slow" \
    tests/test_kernel.py tests/test_gpu.py tests/test_store_defaults.py -k "cuda or gpu or bf16 or kernel or compile"
step kernel_grid 60 python3 bench/bench_kernel.py --contexts 4096 8192 16384 --ratios 0.1 0.3 \
    --json "$out/kernel_grid_h200.json"
step e2e_grid 100 python3 bench/bench_gpu_e2e.py --lengths 8192,4096 --ratios 0.1,0.2,0.3 --repeats 3 \
    --tiers device,host --aux gpu --json "$out/gpu_e2e_grid_h200.json"

printf '{%s}\n' "$(IFS=,; echo "${summary[*]}")" > "$out/summary.json"
cat "$out/summary.json" | tee -a "$log"
say "total $(( $(date +%s) - start )) s; files: $(ls "$out" | tr '\n' ' ')"
