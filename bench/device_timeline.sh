#!/usr/bin/env bash
# Issue 20: where the one-graph decode step's time goes, and the adaptive split tuned by the step's
# own waits. The GPU tests of the device step, its timeline and the tuning, then the decode matrix
# with the per-layer device timeline: qwen3-30b-a3b mxfp4 at 8 GiB (uniform routing and the
# replayed trace), then bf16 at 32 GiB with the trace. One call (carry .whl):
#   bash bench/device_timeline.sh OUT_DIR
# No --profile here: the torch profiler left every later run of its process slower (host CPU 5-6
# ms per token instead of 1.4-1.9), so profiles are taken in a run of their own.
source bench/device_setup.sh "$1" all
q30=model_specs/qwen3-30b-a3b.yaml
trace=trace:bench/traces/qwen3-30b-a3b-k6.npz
export FTC_DEVICE_PLAN=1
timeout 110 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_timeline.py tests/test_cpu_doorbell.py \
  tests/test_device_plan.py tests/test_gpu.py -k "timeline or tunes or triton_plan or device_step" 2>&1 | tail -4
timeout 200 python3 bench/decode_matrix.py $q30 --target h200 --vram-budget 8GiB --override expert_format=mxfp4 \
  --policies adaptive,gpu,cpu --routings uniform,$trace --new-tokens 66 -o "$out/q30_mxfp4" 2>&1 | grep "tok/s"
timeout 230 python3 bench/decode_matrix.py $q30 --target h200 --vram-budget 32GiB \
  --policies adaptive,gpu,cpu --routings $trace --new-tokens 66 -o "$out/q30_bf16" 2>&1 | grep "tok/s"
