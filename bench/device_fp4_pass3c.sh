#!/usr/bin/env bash
# Issue 18's measurements still owed after its third session (whose third call was refused):
# `ftc bench experts` (48 layers, batch 1) for mxfp4 and nvfp4 on the shipped kernel (next-item
# prefetch); qwen3-30b-a3b mxfp4 decode at 8 GiB, uniform routing, each miss policy; the GPU tests
# the second call did not reach (hybrid, fla, elastic VRAM); qwen3.6-35b-a3b nvfp4 decode at 8 GiB.
#   bash bench/device_fp4_pass3c.sh OUT_DIR     (carry .whl: fla-core, einops)
set -uo pipefail
out=${1:?output directory}
mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -2
for fmt in mxfp4 nvfp4; do
  ftc bench experts model_specs/qwen3-30b-a3b.yaml --random-weights --target h200 --override expert_format=$fmt \
    --tokens 1 -o "$out/experts_$fmt.json" 2>&1 | grep -E "kernel_gbps|read_gbps"
done
python3 bench/decode_matrix.py model_specs/qwen3-30b-a3b.yaml --target h200 --vram-budget 8GiB \
  --override expert_format=mxfp4 --policies adaptive,gpu,cpu --routings uniform --new-tokens 66 \
  -o "$out/decode_q30_mxfp4" 2>&1 | grep "tok/s"
python3 -m pytest -v -p no:cacheprovider -m gpu tests/test_gpu.py -k "hybrid or fla or elastic" 2>&1 \
  | tee "$out/pytest_gpu.txt" | grep -E "PASSED|FAILED|ERROR|passed|failed" | sed 's/.*:://' | tail -12
python3 bench/decode_matrix.py model_specs/qwen3.6-35b-a3b.yaml --target h200 --vram-budget 8GiB \
  --override expert_format=nvfp4 --policies adaptive,cpu --routings uniform --new-tokens 66 \
  -o "$out/decode_q36_nvfp4" 2>&1 | grep "tok/s"
