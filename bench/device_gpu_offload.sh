#!/usr/bin/env bash
# Issue 3 on the device: the GPU tests, this machine's profile (B_P, B_H and both at once, on a
# 4-layer engine), then decode of the whole qwen3-30b-a3b (48 layers, bf16
# random weights generated into memory, no weight file) at --vram-budget 32GiB for each miss
# policy and routing: uniform random experts (no locality), the
# replayed Qwen3-30B-A3B trace (real locality), and the model's own router with sampled tokens
# (random weights route to few experts). Usage on the device machine:
#   bash bench/device_gpu_offload.sh OUT_DIR [NEW_TOKENS] [ROUTINGS] [POLICIES]
set -euo pipefail
out=${1:?output directory}
new=${2:-64}
routings=${3:-uniform,trace:bench/traces/qwen3-30b-a3b-k6.npz,sampled}
policies=${4:-adaptive,gpu,cpu}
mkdir -p "$out"
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -2
python3 -m pytest -q -p no:cacheprovider -m gpu tests > "$out/pytest_gpu.txt" 2>&1 || true
tail -3 "$out/pytest_gpu.txt"
ftc compile model_specs/qwen3-30b-a3b.yaml --target h200 --random-weights --override num_layers=4 \
  -o /tmp/ftc-q30-4l > /dev/null
ftc profile /tmp/ftc-q30-4l --seconds 1.5 -o "$out/profile.yaml" > /dev/null
cat "$out/profile.yaml"
python3 bench/decode_matrix.py model_specs/qwen3-30b-a3b.yaml --target h200 --vram-budget 32GiB \
  --policies "$policies" --routings "$routings" --new-tokens "$new" --profile -o "$out" 2>&1 | grep -v "━"
