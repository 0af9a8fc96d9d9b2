#!/usr/bin/env bash
# A/B of FTC_PIN_GPU_THREAD on one machine, with that machine's own profile first (B_P, B_H and
# both at once), so that a slow CPU kernel can be told apart from a slow machine. qwen3-30b-a3b
# shapes cut to 8 layers (the pool draws in seconds), uniform routing, the cpu and adaptive
# policies. Usage on the device machine: bash bench/device_pin_ab.sh OUT_DIR [NEW_TOKENS]
set -euo pipefail
out=${1:?output directory}
new=${2:-32}
mkdir -p "$out"
spec=model_specs/qwen3-30b-a3b.yaml
ftc compile "$spec" --target h200 --random-weights --override num_layers=4 -o /tmp/ftc-q30-4l > /dev/null
ftc profile /tmp/ftc-q30-4l --seconds 1.5 -o "$out/profile.yaml" > /dev/null
cat "$out/profile.yaml"
for pin in 1 0; do
  FTC_PIN_GPU_THREAD=$pin python3 bench/decode_matrix.py "$spec" --target h200 --vram-budget 7GiB \
    --override num_layers=8 --policies cpu,adaptive --routings uniform --new-tokens "$new" -o "$out/pin$pin" 2>&1 \
    | grep -v "━" | sed "s/^/pin=$pin /"
done
