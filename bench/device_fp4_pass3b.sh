#!/usr/bin/env bash
# Issue 18, third session, second call: the next-work-item prefetch against none (and smaller
# down items) for mxfp4, nvfp4 and bf16 on 8-layer qwen3-30b-a3b engines; the 8K prefills of
# qwen3.6-35b-a3b nvfp4 (profiled) and qwen3-30b-a3b mxfp4 at 8 GiB with the host no longer
# waiting for each layer's routing; then every GPU test (last: the figures come back first).
#   bash bench/device_fp4_pass3b.sh OUT_DIR     (carry .whl: fla-core, einops)
set -uo pipefail
out=${1:?output directory}
mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -2
for fmt in mxfp4 nvfp4 bf16; do
  ftc compile model_specs/qwen3-30b-a3b.yaml --random-weights --quant $fmt --target h200 \
    --override num_layers=8 -o /tmp/abl_$fmt --force 2>&1 | tail -1
done
python3 bench/fp4_kernel_ablation.py /tmp/abl_mxfp4 --variants base,noahead,down16,noahead+down16 --threads 16 \
  --rounds 2 --routings cold | tee -a "$out/ablation.jsonl" | grep median
python3 bench/fp4_kernel_ablation.py /tmp/abl_nvfp4 --variants base,noahead --threads 16 --rounds 2 --routings cold \
  | tee -a "$out/ablation.jsonl" | grep median
python3 bench/fp4_kernel_ablation.py /tmp/abl_bf16 --variants base,noahead --threads 16 --rounds 2 --routings cold \
  | tee -a "$out/ablation.jsonl" | grep median
rm -rf /tmp/abl_*
PYTHONUNBUFFERED=1 python3 bench/prefill_profile.py model_specs/qwen3.6-35b-a3b.yaml --tokens 8192 \
  --vram-budget 8GiB --override expert_format=nvfp4 --trace "$out/prefill_q36_nvfp4.json.gz" \
  2>&1 | grep -v "━" | head -16 | tee "$out/prefill_profile.txt"
ftc bench prefill model_specs/qwen3-30b-a3b.yaml --random-weights --target h200 --vram-budget 8GiB \
  --override expert_format=mxfp4 --lengths 8192 -o "$out/prefill_q30_mxfp4.json" 2>&1 | grep -E "seconds|tok_s|ceiling"
python3 -m pytest -v -p no:cacheprovider -m gpu tests/test_gpu.py 2>&1 | tee "$out/pytest_gpu.txt" \
  | grep -v " PASSED\| SKIPPED" | tail -25
