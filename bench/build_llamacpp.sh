#!/bin/bash
# Build llama.cpp's llama-bench, llama-server and llama-quantize from the sources vendored in
# PyPI's llama-cpp-python sdist, into the git-ignored .cache-llamacpp/ (bench/cpu_vs_llamacpp.py's
# default --llama-bin). About an hour of `nice`d compiling on 2 busy cores, ~10 min on 16.
#   bench/build_llamacpp.sh [path/to/llama_cpp_python-0.3.36.tar.gz]
# Without an argument the sdist is fetched with `pip download` (needs the package registry).
# LLAMACPP_PORTABLE=avx2 builds static AVX2/FMA/F16C binaries (no -march=native, libgomp linked in)
# that run on any x86-64 with AVX2: how the 2-core AMD EPYC box got its binaries, built in ~50 s on
# the 16-core H200 host and copied over (docs/benchmarks/cpu-vs-llamacpp-2core.md).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)/.cache-llamacpp"
version=0.3.36
mkdir -p "$root" && echo '*' > "$root/.gitignore"
sdist="${1:-$root/llama_cpp_python-$version.tar.gz}"
if [ ! -f "$sdist" ]; then
  pip download --no-deps --no-binary :all: "llama-cpp-python==$version" -d "$root"
fi
[ -d "$root/llama_cpp_python-$version" ] || tar xzf "$sdist" -C "$root"
src="$root/llama_cpp_python-$version/vendor/llama.cpp"
isa=(-DGGML_NATIVE=ON)
if [ "${LLAMACPP_PORTABLE:-}" = avx2 ]; then
  [ -f "$src/ggml/ggml.pc.in" ] || touch "$src/ggml/ggml.pc.in"
  isa=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_AVX512=OFF
       -DCMAKE_EXE_LINKER_FLAGS=-static "-DOpenMP_gomp_LIBRARY=$(dirname "$(g++ -print-file-name=libgomp.a)")/libgomp.a")
fi
cmake -S "$src" -B "$root/build" -DCMAKE_BUILD_TYPE=Release "${isa[@]}" -DLLAMA_CURL=OFF \
  -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=ON -DLLAMA_BUILD_SERVER=ON -DBUILD_SHARED_LIBS=OFF
nice -n 10 cmake --build "$root/build" -j"$(nproc)" --target llama-bench llama-server llama-quantize
ls -l "$root/build/bin"
