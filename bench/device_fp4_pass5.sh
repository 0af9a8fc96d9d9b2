#!/usr/bin/env bash
# Issue 18's measurements on the 16-row packing still owed after its fourth session, in two calls
# of under 10 minutes (the first part, then the second):
#   bash bench/device_fp4_pass5.sh OUT_DIR 1     the GPU tests in full, ftc bench experts (both formats)
#   bash bench/device_fp4_pass5.sh OUT_DIR 2     the decode matrices and the 8K prefills
# (carry .whl: fla-core, einops)
source bench/device_setup.sh "$@"
if [ "$part" = 1 ]; then
  python3 -m pytest -v -p no:cacheprovider -m gpu tests/test_gpu.py 2>&1 | tee "$out/pytest_gpu.txt" \
    | grep -E "PASSED|FAILED|ERROR|passed|failed" | sed 's/.*:://' | tail -60
  grep -A40 "^____" "$out/pytest_gpu.txt" | grep -E "^E |assert|seed" | head -40
  for fmt in mxfp4 nvfp4; do
    ftc bench experts model_specs/qwen3-30b-a3b.yaml --random-weights --target h200 --override expert_format=$fmt \
      --tokens 1 -o "$out/experts_$fmt.json" 2>&1 | grep -E "kernel_gbps|read_gbps"
  done
else
  python3 bench/decode_matrix.py model_specs/qwen3-30b-a3b.yaml --target h200 --vram-budget 8GiB \
    --override expert_format=mxfp4 --policies adaptive,gpu,cpu \
    --routings uniform,trace:bench/traces/qwen3-30b-a3b-k6.npz --new-tokens 66 \
    -o "$out/decode_q30_mxfp4" 2>&1 | grep "tok/s"
  ftc bench prefill model_specs/qwen3-30b-a3b.yaml --random-weights --target h200 --vram-budget 8GiB \
    --override expert_format=mxfp4 --lengths 8192 -o "$out/prefill_q30_mxfp4.json" 2>&1 | tail -25
  python3 bench/decode_matrix.py model_specs/qwen3.6-35b-a3b.yaml --target h200 --vram-budget 8GiB \
    --override expert_format=nvfp4 --policies adaptive,cpu --routings uniform --new-tokens 66 \
    -o "$out/decode_q36_nvfp4" 2>&1 | grep "tok/s"
  ftc bench prefill model_specs/qwen3.6-35b-a3b.yaml --random-weights --target h200 --vram-budget 8GiB \
    --override expert_format=nvfp4 --lengths 8192 -o "$out/prefill_q36_nvfp4.json" 2>&1 | tail -25
fi
