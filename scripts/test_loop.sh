#!/usr/bin/env bash
# Run the fast test suite N times in a row (default 10), as CI would on this machine, and stop at the
# first run that fails or does not finish. Prints one line per run and a summary.
#   bash scripts/test_loop.sh [N] [pytest args...]   (default args: -q -x -m "not slow and not gpu" tests)
set -uo pipefail
cd "$(dirname "$0")/.."
runs=${1:-10}
shift || true
args=("$@")
[ ${#args[@]} -eq 0 ] && args=(-q -x -m "not slow and not gpu" tests)
passed=0
for i in $(seq 1 "$runs"); do
    start=$(date +%s)
    out=$(timeout 3600 python3 -m pytest -p no:cacheprovider "${args[@]}" 2>&1)
    rc=$?
    summary=$(printf '%s\n' "$out" | tail -n 1)
    echo "run $i/$runs: exit $rc in $(( $(date +%s) - start )) s: $summary"
    if [ $rc -ne 0 ]; then
        printf '%s\n' "$out" | tail -n 40
        echo "loop: $passed of $runs runs passed before a failure"
        exit 1
    fi
    passed=$((passed + 1))
done
echo "loop: $passed of $runs runs passed"
