#!/bin/bash
# bench.cpu_vs_llamacpp on the H200 host's Xeon (no SmolLM2 package there): Tandem's
# qwen2.5-0.5b-random preset against llama.cpp on a random GGUF of the same shape. Builds llama.cpp
# (-march=native) and ggml's kernels for Tandem from llama.cpp's sources, in parallel (~80 s on
# 16 cores), then runs the benchmark (one round; MODES picks Tandem's modes). The sources come as
# .cache-llamacpp/src-trim.tar.gz: the sdist's vendor/llama.cpp without models/, docs/, tests/,
# benches/, media/ and the GPU backends (8 MB, under the device's 64 MiB carry limit), e.g.
#   tar czf .cache-llamacpp/src-trim.tar.gz -C <sdist>/vendor --exclude=llama.cpp/models ... llama.cpp
# Run with carry [".cache-llamacpp/src-trim.tar.gz"]:  MODES="bfloat16 int4 int4-ggml" bash bench/cpu_vs_llamacpp_device.sh
set -x
R=$PWD
export PYTHONPATH=$R:/tmp/llama.cpp/gguf-py RAY_USAGE_STATS_ENABLED=0 PYTHONUNBUFFERED=1 TANDEM_CACHE_DIR=/tmp/tc TANDEM_GGML_SOURCE=/tmp/llama.cpp
tar xzf .cache-llamacpp/src-trim.tar.gz -C /tmp
lscpu | grep -E "Model name|^CPU\(s\)|Flags" | cut -c1-300 > $OUT/cpu.txt
mkdir -p /tmp/g
t0=$(date +%s)
(cmake -S /tmp/llama.cpp -B /tmp/lb -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON -DBUILD_SHARED_LIBS=OFF > $OUT/cmake.log 2>&1 && cmake --build /tmp/lb -j16 --target llama-bench llama-server llama-quantize > $OUT/build.log 2>&1) &
python3 -m tandem.engine.model.ggml_kernels build > $OUT/ggml-build.log 2>&1 &
python3 -m bench.random_gguf qwen2.5-0.5b-random /tmp/g/qwen2.5-0.5b-random.F32.gguf > $OUT/gguf.log 2>&1 &
wait
echo "builds and gguf: $(( $(date +%s) - t0 )) s"; tail -2 $OUT/ggml-build.log $OUT/gguf.log; ls /tmp/lb/bin
timeout ${BENCH_TIMEOUT:-420} python3 -m bench.cpu_vs_llamacpp --device-model qwen2.5-0.5b-random --threads 14 --rounds 1 \
  --tandem-modes ${MODES:-bfloat16 int4 int4-ggml int8-ggml} --llama-bin /tmp/lb/bin \
  --llama-gguf /tmp/g/qwen2.5-0.5b-random.F32.gguf --llama-cache /tmp/g --out $OUT/cpu-vs-llamacpp-xeon16-ggml.json 2>&1 | grep -v Warn | tail -25
