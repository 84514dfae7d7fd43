#!/usr/bin/env bash
# llama.cpp's OpenAI server through `llama-cpp-python[server]`, in a virtual environment of its own, for
# bench/anchors/run_anchors.py. Prints the environment's folder.
#
# llama-cpp-python ships source only: pip compiles llama.cpp (about 10-15 minutes on 2 cores). The wheel is
# built once into $anchors/wheels and reused by every later environment, so the build is paid once per
# machine; never from pip's wheel cache, which would hand back a wheel built with other CMAKE_ARGS (an
# AVX-512 + AMX build came back for an AVX2 one). Built for this CPU (GGML_NATIVE=ON: AVX-512, VNNI, BF16
# where present), or, with LLAMA_CPP_ISA=avx2, for an AVX2-only CPU (AVX2, FMA, F16C; no AVX-512, no AMX):
# llama.cpp as it runs on such a machine, which also runs on an AMX host, where the native build segfaults
# (ggml-org/llama.cpp#20824); LLAMA_CPP_ISA=avx512: AVX-512 (VNNI, BF16) without AMX, its best there.
set -euo pipefail
anchors=${CACHECLIP_ANCHORS:-$HOME/.cache/cacheclip_rag/anchors}
version=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
isa=${LLAMA_CPP_ISA:-native}
case "$isa" in
    native) suffix=""; cmake_args="-DGGML_NATIVE=ON" ;;
    avx2) suffix="-avx2"
          cmake_args="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON"
          cmake_args="$cmake_args -DGGML_AVX_VNNI=OFF -DGGML_AVX512=OFF -DGGML_AVX512_VBMI=OFF -DGGML_AVX512_VNNI=OFF"
          cmake_args="$cmake_args -DGGML_AVX512_BF16=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF" ;;
    avx512) suffix="-avx512"  # AVX-512 with VNNI and BF16, no AMX: llama.cpp at its best on an AMX host
          cmake_args="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON"
          cmake_args="$cmake_args -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON"
          cmake_args="$cmake_args -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF" ;;
    *) echo "LLAMA_CPP_ISA must be native, avx2 or avx512, got '$isa'" >&2; exit 2 ;;
esac
venv=$anchors/llama-cpp-python-$version$suffix
wheels=$anchors/wheels$suffix
if [ ! -x "$venv/bin/python" ] || ! "$venv/bin/python" -c "import llama_cpp.server" 2>/dev/null; then
    mkdir -p "$anchors" "$wheels"
    python3 -m venv "$venv"
    "$venv/bin/python" -m pip install -q --upgrade pip
    if ! ls "$wheels"/llama_cpp_python-"$version"-*.whl >/dev/null 2>&1; then
        CMAKE_ARGS="$cmake_args" CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) \
            "$venv/bin/python" -m pip wheel -q --no-deps --no-cache-dir -w "$wheels" "llama-cpp-python==$version"
    fi
    "$venv/bin/python" -m pip install -q "$wheels"/llama_cpp_python-"$version"-*.whl
    "$venv/bin/python" -m pip install -q "llama-cpp-python[server]==$version" --find-links "$wheels"
fi
"$venv/bin/python" -c "import llama_cpp; print('llama-cpp-python', llama_cpp.__version__)" >&2
echo "$venv"
