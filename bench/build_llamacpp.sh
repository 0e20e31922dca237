#!/bin/bash
# Build llama.cpp's llama-bench, llama-server and llama-quantize from the sources vendored in
# PyPI's llama-cpp-python sdist, into the git-ignored .cache-llamacpp/ (bench/cpu_vs_llamacpp.py's
# default --llama-bin). About an hour of `nice`d compiling on 2 busy cores, ~10 min on 16.
#   bench/build_llamacpp.sh [path/to/llama_cpp_python-0.3.36.tar.gz]
# Without an argument the sdist is fetched with `pip download` (needs the package registry).
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
cmake -S "$src" -B "$root/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
  -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=ON -DLLAMA_BUILD_SERVER=ON -DBUILD_SHARED_LIBS=OFF
nice -n 10 cmake --build "$root/build" -j"$(nproc)" --target llama-bench llama-server llama-quantize
ls -l "$root/build/bin"
