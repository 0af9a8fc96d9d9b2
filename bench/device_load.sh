#!/usr/bin/env bash
# Issue 8 on the device: cold start of a qwen3-30b-a3b bf16 engine (random weights, 58 GB of
# experts written to disk: the device machine's 64 GiB disk holds one such engine) against the
# disk's own sequential O_DIRECT read of the same file, then the GPU elastic-VRAM test (another
# process takes memory under --vram-budget). Two files land in OUT_DIR.
#   bash bench/device_load.sh OUT_DIR [ENGINE_DIR]
set -euo pipefail
out=${1:?output directory}
engine=${2:-/tmp/ftc-load/qwen3-30b-a3b}
mkdir -p "$out"
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -2
[[ -f $engine/engine.json ]] ||
  ftc compile model_specs/qwen3-30b-a3b.yaml --random-weights --target h200 -o "$engine" 2>&1 | grep -v "━" | tail -n 2
ftc bench load "$engine" --device cuda -o "$out/load.json" 2>&1 | grep -v "━" | tail -n 20
pytest -q -p no:cacheprovider -m gpu tests/test_gpu.py -k elastic 2>&1 | tail -n 5 | tee "$out/pytest_elastic.txt"
