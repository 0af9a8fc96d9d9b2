#!/usr/bin/env bash
# Issue 18's device bars, decode on the one-graph device step (FTC_DEVICE_PLAN=1): ftc bench
# experts for both 4-bit formats (batch 1), the qwen3-30b-a3b mxfp4 decode matrix at 8 GiB
# (uniform and replayed trace, every miss policy) and its 8K prefill, then qwen3.6-35b-a3b nvfp4
# decode and 8K prefill at 8 GiB. Each stage has a time limit, so that a call returns what it
# measured. All stages take about 12 minutes: two calls on one warm machine (carry .whl: fla-core, einops):
#   bash bench/device_fp4_final.sh OUT_DIR experts,q30     then     bash bench/device_fp4_final.sh OUT_DIR q36
source bench/device_setup.sh "$1" "${2:-experts,q30,q36}"
q30=model_specs/qwen3-30b-a3b.yaml
q36=model_specs/qwen3.6-35b-a3b.yaml
export FTC_DEVICE_PLAN=1
if [[ $part == *experts* ]]; then
  for fmt in mxfp4 nvfp4; do
    timeout 90 ftc bench experts $q30 --random-weights --target h200 --override expert_format=$fmt --tokens 1 \
      -o "$out/experts_$fmt.json" 2>&1 | grep -E "kernel_gbps|read_gbps|ms_per_layer"
  done
fi
if [[ $part == *q30* ]]; then
  timeout 180 python3 bench/decode_matrix.py $q30 --target h200 --vram-budget 8GiB --override expert_format=mxfp4 \
    --policies adaptive,gpu,cpu --routings uniform,trace:bench/traces/qwen3-30b-a3b-k6.npz --new-tokens 66 \
    -o "$out/decode_q30_mxfp4" 2>&1 | grep "tok/s"
  timeout 110 ftc bench prefill $q30 --random-weights --target h200 --vram-budget 8GiB --override expert_format=mxfp4 \
    --lengths 8192 -o "$out/prefill_q30_mxfp4.json" 2>&1 | grep -v "━" | tail -12
fi
if [[ $part == *q36* ]]; then
  timeout 300 python3 bench/decode_matrix.py $q36 --target h200 --vram-budget 8GiB --override expert_format=nvfp4 \
    --policies adaptive,cpu --routings uniform --new-tokens 66 -o "$out/decode_q36_nvfp4" 2>&1 | grep "tok/s"
  timeout 200 ftc bench prefill $q36 --random-weights --target h200 --vram-budget 8GiB --override expert_format=nvfp4 \
    --lengths 8192 -o "$out/prefill_q36_nvfp4.json" 2>&1 | grep -v "━" | tail -12
fi
