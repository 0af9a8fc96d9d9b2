#!/usr/bin/env bash
# Issue 4 on the device: prefill of the whole qwen3-30b-a3b (48 layers, bf16 random weights generated
# into memory) at --vram-budget 32GiB, MoE layers streamed through two layer buffers and through one
# (--no-overlap), against the PCIe ceiling. Usage on the device machine:
#   bash bench/device_prefill.sh OUT_DIR [LENGTHS]
set -euo pipefail
out=${1:?output directory}
lengths=${2:-1024,2048,4096,8192,16384}
mkdir -p "$out"
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -2
ftc bench prefill model_specs/qwen3-30b-a3b.yaml --random-weights --target h200 --vram-budget 32GiB \
  --lengths "$lengths" --compare -o "$out/prefill.json" 2>&1 | grep -v "━" | tail -n 40
