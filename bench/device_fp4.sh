#!/usr/bin/env bash
# Issue 18 on the device: qwen3-30b-a3b's shapes with 4-bit experts
# (random codes and scales generated into memory): the CPU expert kernel alone (`ftc bench experts`,
# batch 1), the decode matrix (uniform and replayed-trace routing, each miss policy) and the 8K
# prefill at --vram-budget 8GiB; then qwen3.6-35b-a3b in nvfp4, decode and 8K prefill at 8GiB;
# then the GPU tests (every format).
# Carry .whl (fla_core): the hybrid stage's prefill and the tests (last) need it.
#   bash bench/device_fp4.sh OUT_DIR [STAGES]   STAGES: any of experts,decode,prefill,hybrid,tests (default all)
set -uo pipefail
out=${1:?output directory}
stages=${2:-experts,decode,prefill,hybrid,tests}
mkdir -p "$out"
if ls .whl/fla_core-*.whl >/dev/null 2>&1; then  # the hybrid stage's Gated DeltaNet prefill needs it too
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/fla_core-*.whl
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -2
q30=model_specs/qwen3-30b-a3b.yaml
q36=model_specs/qwen3.6-35b-a3b.yaml
if [[ $stages == *experts* ]]; then
  for fmt in mxfp4 nvfp4; do
    ftc bench experts $q30 --random-weights --target h200 --override expert_format=$fmt --tokens 1 \
      -o "$out/experts_$fmt.json" 2>&1 | grep -v "━" | tail -6
  done
fi
if [[ $stages == *decode* ]]; then
  python3 bench/decode_matrix.py $q30 --target h200 --vram-budget 8GiB --override expert_format=mxfp4 \
    --policies adaptive,gpu,cpu --routings uniform,trace:bench/traces/qwen3-30b-a3b-k6.npz --new-tokens 66 \
    -o "$out/decode_q30_mxfp4" 2>&1 | grep -v "━" | tail -8
fi
if [[ $stages == *prefill* ]]; then
  ftc bench prefill $q30 --random-weights --target h200 --vram-budget 8GiB --override expert_format=mxfp4 \
    --lengths 8192 -o "$out/prefill_q30_mxfp4.json" 2>&1 | grep -v "━" | tail -10
fi
if [[ $stages == *hybrid* ]]; then
  python3 bench/decode_matrix.py $q36 --target h200 --vram-budget 8GiB --override expert_format=nvfp4 \
    --policies adaptive,cpu --routings uniform --new-tokens 66 -o "$out/decode_q36_nvfp4" 2>&1 | grep -v "━" | tail -6
  ftc bench prefill $q36 --random-weights --target h200 --vram-budget 8GiB --override expert_format=nvfp4 \
    --lengths 8192 -o "$out/prefill_q36_nvfp4.json" 2>&1 | grep -v "━" | tail -10
fi
if [[ $stages == *tests* ]]; then  # last: the figures above come back even if the call runs out of time
  bash bench/device_gpu_tests.sh "$out" tests/test_gpu.py tests/test_profile.py | tail -12
fi
