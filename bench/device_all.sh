#!/usr/bin/env bash
# One device call for issues 3 and 4 (about 8 minutes): the GPU tests, this machine's profile, the
# host cost of a graph launch, decode of the whole qwen3-30b-a3b by routing and miss policy, then
# its prefill by prompt length with two layer buffers and with one. Six files land in OUT_DIR.
#   bash bench/device_all.sh OUT_DIR [NEW_TOKENS] [PREFILL_LENGTHS]
set -euo pipefail
out=${1:?output directory}
new=${2:-34}
lengths=${3:-1024,2048,4096,8192,16384}
mkdir -p "$out"
bash bench/device_gpu_offload.sh "$out" "$new" \
  uniform,trace:bench/traces/qwen3-30b-a3b-k6.npz,sampled adaptive,gpu,cpu
python3 bench/graph_launch.py -o "$out" --replays 1000
bash bench/device_prefill.sh "$out" "$lengths"
