#!/usr/bin/env bash
# Issue 18's kernel pass on the device: the 4-bit AVX-512 kernels' tests, then
# bench/fp4_kernel_ablation.py over 8-layer qwen3-30b-a3b engines of random 4-bit experts
# (2.5 GB: beyond L3) for both formats, then `ftc bench experts` (48 layers) for both.
#   bash bench/device_fp4_ablation.sh OUT_DIR [MX_VARIANTS] [NV_VARIANTS]
set -uo pipefail
out=${1:?output directory}
mx=${2:-base,pf_nta,nofold}
nv=${3:-base,pf_nta}
mkdir -p "$out"
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -2
python3 -m pytest -q -p no:cacheprovider tests/test_cpu_kernels.py -k "fp4 and avx512" 2>&1 | tail -3
for fmt in mxfp4 nvfp4; do
  ftc compile model_specs/qwen3-30b-a3b.yaml --random-weights --quant $fmt --target h200 \
    --override num_layers=8 -o /tmp/abl_$fmt --force 2>&1 | tail -1
done
python3 bench/fp4_kernel_ablation.py /tmp/abl_mxfp4 --variants "$mx" --pages 2m,4k --rounds 2 \
  | tee -a "$out/ablation.jsonl" | grep median
python3 bench/fp4_kernel_ablation.py /tmp/abl_nvfp4 --variants "$nv" --rounds 2 | tee -a "$out/ablation.jsonl" | grep median
for fmt in mxfp4 nvfp4; do
  ftc bench experts model_specs/qwen3-30b-a3b.yaml --random-weights --target h200 --override expert_format=$fmt \
    --tokens 1 -o "$out/experts_$fmt.json" 2>&1 | grep -v "━" | tail -4
done
