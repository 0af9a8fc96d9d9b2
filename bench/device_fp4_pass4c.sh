#!/usr/bin/env bash
# Issue 18, fourth session, last call (200 s of device time were left): the 16-row interleaved
# 4-bit layout on the device. The GPU tests of the Triton kernels on it (decode and grouped against
# torch, the engine against the CPU engine), `ftc bench experts` for mxfp4 (48 layers, batch 1), and
# the Triton kernels of both packings side by side (bench/dev/triton_fp4_layouts.py).
#   bash bench/device_fp4_pass4c.sh OUT_DIR     (carry .whl: fla-core, einops)
set -uo pipefail
out=${1:?output directory}
mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -2
timeout 70 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu.py \
  -k "fp4 and (triton_expert_kernel or grouped_expert_kernel or gpu_engine_matches_the_cpu_engine)" 2>&1 \
  | tee "$out/pytest.txt" | tail -3
timeout 80 ftc bench experts model_specs/qwen3-30b-a3b.yaml --random-weights --target h200 --override \
  expert_format=mxfp4 --tokens 1 -o "$out/experts_mxfp4.json" 2>&1 | grep -E "kernel_gbps|read_gbps"
OUT=$out/layouts ROUNDS=3 timeout 40 python3 bench/dev/triton_fp4_layouts.py 2>&1 | tail -12
