#!/usr/bin/env bash
# Issue 18, third pass: is the 4-bit AVX-512 kernel bound by its instructions or by memory?
# bench/fp4_kernel_ablation.py's `l1` variant runs the same instructions on rows that stay in L1
# (the kernel's ceiling), beside the shipped kernel, smaller work items and an empty call, on 16
# workers and on one; then `ftc bench experts` for bf16, mxfp4 and nvfp4 on the same 8-layer shapes
# (the plain read of the moment), and mxfp4 at 16 tokens.
#   bash bench/device_fp4_ceiling.sh OUT_DIR [MX_VARIANTS] [NV_VARIANTS]
set -uo pipefail
out=${1:?output directory}
mx=${2:-base,l1,nogateup+nodown,down16,gu16+down16}
nv=${3:-base,l1}
mkdir -p "$out"
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -2
for fmt in mxfp4 nvfp4; do
  ftc compile model_specs/qwen3-30b-a3b.yaml --random-weights --quant $fmt --target h200 \
    --override num_layers=8 -o /tmp/abl_$fmt --force 2>&1 | tail -1
done
python3 bench/fp4_kernel_ablation.py /tmp/abl_mxfp4 --variants "$mx" --threads 16,1 --rounds 2 \
  | tee -a "$out/ablation.jsonl" | grep median
python3 bench/fp4_kernel_ablation.py /tmp/abl_nvfp4 --variants "$nv" --threads 16,1 --routings cold --rounds 2 \
  | tee -a "$out/ablation.jsonl" | grep median
for fmt in bf16 mxfp4 nvfp4; do
  ftc bench experts model_specs/qwen3-30b-a3b.yaml --random-weights --target h200 --override expert_format=$fmt \
    --override num_layers=8 --tokens 1 -o "$out/experts_$fmt.json" 2>&1 | grep -v "━" | tail -4
done
ftc bench experts model_specs/qwen3-30b-a3b.yaml --random-weights --target h200 --override expert_format=mxfp4 \
  --override num_layers=8 --tokens 16 -o "$out/experts_mxfp4_t16.json" 2>&1 | grep -v "━" | tail -4
