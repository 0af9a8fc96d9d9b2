#!/usr/bin/env bash
# Issue 17 on the device: every GPU test, then the decode matrix (uniform and replayed-trace routing,
# each miss policy) and the 8K prefill of qwen3-30b-a3b (bf16 random weights generated into memory,
# --vram-budget 32GiB), in one run, to hold them against docs/performance.md. Carry .whl (fla_core).
#   bash bench/device_layout.sh OUT_DIR [STAGES]     STAGES: any of tests,decode,prefill (default all)
set -uo pipefail
out=${1:?output directory}
stages=${2:-tests,decode,prefill}
mkdir -p "$out"
if [[ $stages == *tests* ]]; then
  bash bench/device_gpu_tests.sh "$out" | tail -8
else
  python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -2
fi
if [[ $stages == *decode* ]]; then
  python3 bench/decode_matrix.py model_specs/qwen3-30b-a3b.yaml --target h200 --vram-budget 32GiB \
    --policies adaptive,gpu,cpu --routings uniform,trace:bench/traces/qwen3-30b-a3b-k6.npz --new-tokens 66 \
    -o "$out" 2>&1 | grep -v "━" | tail -12
fi
if [[ $stages == *prefill* ]]; then
  ftc bench prefill model_specs/qwen3-30b-a3b.yaml --random-weights --target h200 --vram-budget 32GiB \
    --lengths 8192 -o "$out/prefill.json" 2>&1 | grep -v "━" | tail -12
fi
