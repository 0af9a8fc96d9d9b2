#!/usr/bin/env bash
# Issue 18's tuning pass on the device: the 4-bit AVX-512 kernels against their torch reference,
# then the CPU kernel's prefetch distance (qwen3-30b-a3b shapes, 12 layers of random experts on
# disk: beyond L3) and the grouped GEMM's tiling per format.
#   bash bench/device_fp4_tune.sh OUT_DIR
set -uo pipefail
out=${1:?output directory}
mkdir -p "$out"
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -2
python3 -m pytest -q -p no:cacheprovider tests/test_cpu_kernels.py -k "fp4 and avx512" 2>&1 | tail -2
for fmt in mxfp4 nvfp4; do
  ftc compile model_specs/qwen3-30b-a3b.yaml --random-weights --quant $fmt --target h200 \
    --override num_layers=12 -o /tmp/tune_$fmt --force 2>&1 | tail -1
  python3 bench/tune_cpu_kernel.py /tmp/tune_$fmt --prefetch 2,4,8 --chunk 16,32 --seconds 1.5 \
    | sed "s/^/$fmt /" | tee -a "$out/tune_cpu.txt"
done
python3 bench/tune_grouped_gemm.py model_specs/qwen3-30b-a3b.yaml 2>&1 | tee "$out/tune_grouped.txt" | tail -20
