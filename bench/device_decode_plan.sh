#!/usr/bin/env bash
# Issue 20's first device runs: the decode plan as data (Triton plan kernels, gathered fills, the
# CPU doorbell, one graph per step) checked on the GPU, then decode with it against the host
# planner, in two calls of under 10 minutes (carry .whl: fla-core, einops):
#   bash bench/device_decode_plan.sh OUT_DIR 1     the GPU tests of the device plan, the fill kernel's rate
#   bash bench/device_decode_plan.sh OUT_DIR 2     decode at 8 GiB, mxfp4, host planner against device steps
source bench/device_setup.sh "$@"
if [ "$part" = 1 ]; then
  python3 -m pytest -v -p no:cacheprovider -m gpu tests/test_device_plan.py tests/test_cpu_doorbell.py tests/test_gpu.py \
    -k "device_plan or triton_plan or replays_in_a_cuda_graph or gather_fills or gpu_rings or device_step \
        or hybrid_decode_graphs or cuda_offload or gpu_engine_matches" 2>&1 | tee "$out/pytest_gpu.txt" \
    | grep -E "PASSED|FAILED|ERROR|passed|failed" | sed 's/.*:://' | tail -60
  grep -A40 "^____" "$out/pytest_gpu.txt" | grep -E "^E |assert|seed" | head -40
  python3 bench/dev/gather_fill_rate.py 2>&1 | tee "$out/gather_fill_rate.txt"
else
  for plan in 0 1; do
    FTC_DEVICE_PLAN=$plan python3 bench/decode_matrix.py model_specs/qwen3-30b-a3b.yaml --target h200 \
      --vram-budget 8GiB --override expert_format=mxfp4 --policies adaptive,cpu --routings uniform \
      --new-tokens 66 -o "$out/decode_q30_mxfp4_plan$plan" 2>&1 | grep "tok/s"
  done
fi
