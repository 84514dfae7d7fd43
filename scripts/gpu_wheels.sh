#!/usr/bin/env bash
# Fetch the wheels the GPU machine lacks into .whl/ (ignored by git), for its offline install.
# That machine: Python 3.12, torch 2.11, transformers 5.17, triton 3.6, accelerate, safetensors, tqdm,
# numpy, pytest, hypothesis -- but no lmdb and no package index. The project itself is not installed
# there: bench/gpu_check.sh puts the checkout on PYTHONPATH (see cacheclip_rag/__init__.py).
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
rm -f .whl/*.whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl "lmdb==3.0.0"
ls -l .whl
du -sh .whl
