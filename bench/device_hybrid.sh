#!/usr/bin/env bash
# Issues 6 and 7 on the device: the qwen3.6-35b-a3b hybrid (40 layers, bf16 random weights generated
# into memory, no weight file) at --vram-budget 32GiB: decode by routing, prefill at 8K with two
# layer buffers and with one, then the agent session grown to about 20K tokens with the prefix
# cache, without checkpoints and without any cache. Four JSON files land in OUT_DIR.
#   bash bench/device_hybrid.sh OUT_DIR [NEW_TOKENS] [SESSION_TOKENS]
set -euo pipefail
out=${1:?output directory}
new=${2:-66}
session=${3:-20000}
spec=model_specs/qwen3.6-35b-a3b.yaml
mkdir -p "$out"
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -2
python3 bench/decode_matrix.py "$spec" --target h200 --vram-budget 32GiB --policies adaptive,gpu,cpu \
  --routings sampled,uniform --new-tokens "$new" -o "$out" 2>&1 | grep -v "━"
ftc bench "$spec" prefill --random-weights --target h200 --device cuda --vram-budget 32GiB --lengths 8192 \
  --compare -o "$out/prefill_hybrid.json" 2>&1 | grep -v "━" | tail -n 3
ftc bench "$spec" agent --random-weights --target h200 --device cuda --vram-budget 32GiB \
  --session-tokens "$session" --compare -o "$out/agent.json" 2>&1 | grep -v "━" | tail -n 3
