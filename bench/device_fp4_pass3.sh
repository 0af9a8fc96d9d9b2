#!/usr/bin/env bash
# Issue 18, third session, on the device: the 4-bit kernel's ablation (its L1 ceiling, the
# version-5 lookup, 8-bit activations, smaller work items), `ftc bench experts` on the 48-layer
# qwen3-30b-a3b shapes (and bf16 on 8 layers, the memory rate of the moment), then where the
# qwen3.6-35b-a3b nvfp4 8K prefill spends its time (bench/prefill_profile.py).
#   bash bench/device_fp4_pass3.sh OUT_DIR [MX_VARIANTS] [NV_VARIANTS]     (carry .whl: fla-core, einops)
set -uo pipefail
out=${1:?output directory}
mx=${2:-base,shuf,q8,l1,down16,nogateup+nodown}
nv=${3:-base,q8,l1}
mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -2
for fmt in mxfp4 nvfp4; do
  ftc compile model_specs/qwen3-30b-a3b.yaml --random-weights --quant $fmt --target h200 \
    --override num_layers=8 -o /tmp/abl_$fmt --force 2>&1 | tail -1
done
python3 bench/fp4_kernel_ablation.py /tmp/abl_mxfp4 --variants "$mx" --threads 16 --rounds 2 \
  | tee -a "$out/ablation.jsonl" | grep median
python3 bench/fp4_kernel_ablation.py /tmp/abl_mxfp4 --variants base,l1 --threads 1 --rounds 1 \
  | tee -a "$out/ablation.jsonl" | grep median
python3 bench/fp4_kernel_ablation.py /tmp/abl_nvfp4 --variants "$nv" --threads 16 --rounds 2 \
  | tee -a "$out/ablation.jsonl" | grep median
for fmt in mxfp4 nvfp4; do
  ftc bench experts model_specs/qwen3-30b-a3b.yaml --random-weights --target h200 --override expert_format=$fmt \
    --tokens 1 -o "$out/experts_$fmt.json" 2>&1 | grep -E "kernel_gbps|read|bf16_gbps"
done
ftc bench experts model_specs/qwen3-30b-a3b.yaml --random-weights --target h200 --override expert_format=bf16 \
  --override num_layers=8 --tokens 1 -o "$out/experts_bf16_8l.json" 2>&1 | grep -E "kernel_gbps|read"
PYTHONUNBUFFERED=1 python3 bench/prefill_profile.py model_specs/qwen3.6-35b-a3b.yaml --tokens 8192 \
  --vram-budget 8GiB --override expert_format=nvfp4 --trace "$out/prefill_q36_nvfp4.json.gz" \
  2>&1 | grep -v "━" | tee "$out/prefill_profile.json"
