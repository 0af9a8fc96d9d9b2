#!/usr/bin/env bash
# Issue 18, fourth session: where the adaptive decode's host time goes. The 4-bit adaptive decode
# fell behind the cpu policy (40.97 against 61.068 tok/s, q30 mxfp4 8 GiB, uniform) with the
# host's fill time per layer at 0.179 ms for 2.17 fills: the host cost of one fill by the way it is
# queued, the decode matrix with the run-splitting fix (plus a torch profile of the adaptive run,
# and the GPU-driving thread pinned as a variant), and the hybrid GPU test on three seeds.
#   bash bench/device_fp4_pass4.sh OUT_DIR     (carry .whl: fla-core, einops)
set -uo pipefail
out=${1:?output directory}
mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -2
python3 bench/dev/fill_cost.py 2>&1 | tee "$out/fill_cost.txt"
python3 bench/decode_matrix.py model_specs/qwen3-30b-a3b.yaml --target h200 --vram-budget 8GiB \
  --override expert_format=mxfp4 --policies adaptive,gpu,cpu --routings uniform --new-tokens 66 \
  --variant "" --variant FTC_PIN_GPU_THREAD=1 --profile -o "$out/decode_q30_mxfp4" 2>&1 | grep "tok/s"
for s in 1 2 3; do
  FTC_TEST_SEED=$s python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu.py -k "hybrid_engine" 2>&1 \
    | tail -1
done
