#!/usr/bin/env bash
# Structured outputs on the H200 machine, in one call (repo root, OUT=<folder>): the grammar
# tests on CUDA (xgrammar's Triton kernel against the torch reference; the engine's fast path
# with asynchronous scheduling and grammar rows), then bench.structured_output at batch 4 and 64.
#
# That machine has no package index, so xgrammar travels as wheels in the git-ignored folder
# .device-wheels/ (send it with the run: carry .device-ray and .device-wheels), made here with
#   mkdir -p .device-wheels/tok && pip download --no-deps --only-binary=:all: --python-version 3.12 \
#     -d .device-wheels xgrammar==0.2.9 apache-tvm-ffi==0.1.15.post2 llguidance==1.9.1 && \
#   cp ~/.cache/tandem/models/smollm2-135m/{tokenizer.json,tokenizer_config.json,chat_template.jinja} .device-wheels/tok/
# (llguidance only for the library comparison; the tokenizer so the mask part uses a real
# 49,152-token vocabulary, where the random-weight model has a 259-token byte tokenizer).
# A wheel is a zip: unpacked onto PYTHONPATH, no pip needed.
set -uo pipefail
OUT="${OUT:-out/structured_output_h200}"
mkdir -p "$OUT" .device-wheels/site
for wheel in .device-wheels/*.whl; do python3 -m zipfile -e "$wheel" .device-wheels/site; done
export PYTHONPATH="$PWD/.device-wheels/site:${PYTHONPATH:-.}"
python3 -c "import xgrammar" || { echo "xgrammar does not import"; exit 1; }

timeout 240 python3 -m pytest -q -p no:cacheprovider tests/engine/test_structured_output.py > "$OUT/pytest.txt" 2>&1
echo "pytest rc=$?: $(tail -1 "$OUT/pytest.txt")"

timeout 420 python3 -m bench.structured_output --device cuda --model qwen2.5-0.5b-random --dtype bfloat16 \
  --tokenizer .device-wheels/tok --batch 4 64 --max-tokens 64 --repeats 3 \
  --out "$OUT/structured-output-h200.json" 2>&1 | grep -v "UserWarning\|_warn_once\|USDT"
echo "bench rc=${PIPESTATUS[0]}"
