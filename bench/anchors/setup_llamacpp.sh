#!/usr/bin/env bash
# llama.cpp's OpenAI server through `llama-cpp-python[server]`, in a virtual environment of its own, for
# bench/anchors/run_anchors.py. Prints the environment's folder.
#
# llama-cpp-python ships source only: pip compiles llama.cpp (about 10-15 minutes on 2 cores). The wheel is
# built once into $anchors/wheels and reused by every later environment, so the build is paid once per
# machine. Built for this CPU (GGML_NATIVE=ON: AVX-512, VNNI, BF16 where present).
set -euo pipefail
anchors=${CACHECLIP_ANCHORS:-$HOME/.cache/cacheclip_rag/anchors}
version=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
venv=$anchors/llama-cpp-python-$version
wheels=$anchors/wheels
if [ ! -x "$venv/bin/python" ] || ! "$venv/bin/python" -c "import llama_cpp.server" 2>/dev/null; then
    mkdir -p "$anchors" "$wheels"
    python3 -m venv "$venv"
    "$venv/bin/python" -m pip install -q --upgrade pip
    if ! ls "$wheels"/llama_cpp_python-"$version"-*.whl >/dev/null 2>&1; then
        CMAKE_ARGS="-DGGML_NATIVE=ON" CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) \
            "$venv/bin/python" -m pip wheel -q --no-deps -w "$wheels" "llama-cpp-python==$version"
    fi
    "$venv/bin/python" -m pip install -q "$wheels"/llama_cpp_python-"$version"-*.whl
    "$venv/bin/python" -m pip install -q "llama-cpp-python[server]==$version" --find-links "$wheels"
fi
"$venv/bin/python" -c "import llama_cpp; print('llama-cpp-python', llama_cpp.__version__)" >&2
echo "$venv"
