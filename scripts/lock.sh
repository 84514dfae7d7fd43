#!/usr/bin/env bash
# Refresh the two known-good version sets from pyproject's ranges and extras (commit both files):
#   bash scripts/lock.sh
# requirements.lock         the newest versions the ranges admit today: what setup.sh installs and CI tests
# requirements-lowest.lock  the lowest they admit (transformers 5.17, the GPU machine's): CI runs the fast
#                           tests on it (setup.sh --lowest)
# Neither lists torch: setup.sh installs torch 2.13.0's CPU wheel (or keeps an installed torch, CUDA or
# not). The sets are resolved against that CPU build, so none of the CUDA build's dependencies enter them;
# the CPU wheel is found through pip's own find-links setting (PIP_FIND_LINKS), as pip finds it.
set -euo pipefail
cd "$(dirname "$0")/.."
tools=$(mktemp -d)
trap 'rm -rf "$tools"' EXIT
python3 -m venv "$tools/venv"
"$tools/venv/bin/python" -m pip install -q "uv>=0.9"
echo "torch==2.13.0+cpu" > "$tools/torch.txt"
echo "transformers==5.17.0" > "$tools/lowest.txt"
common=(pyproject.toml --all-extras --python-version 3.11 --python-platform x86_64-manylinux_2_28
        --override "$tools/torch.txt" --no-emit-package torch --custom-compile-command "bash scripts/lock.sh")
[ -n "${PIP_FIND_LINKS:-}" ] && common+=(--find-links "$PIP_FIND_LINKS")
"$tools/venv/bin/uv" pip compile "${common[@]}" --upgrade -o requirements.lock
"$tools/venv/bin/uv" pip compile "${common[@]}" --upgrade --resolution lowest-direct -c "$tools/lowest.txt" \
    -o requirements-lowest.lock
