#!/usr/bin/env bash
# Issue 20 after its second device session: the decode path's new GPU code checked first (the
# Triton decode attention and router, the step counters, the plan kernel reading the staged call
# in place, embedding and rotary table inside the step's graph), then its figures. Three calls of
# under 10 minutes on one machine (carry .whl):
#   bash bench/device_decode_step.sh OUT_DIR 1   GPU tests of the decode path (both families, every format)
#   bash bench/device_decode_step.sh OUT_DIR 2   qwen3-30b-a3b matrices: mxfp4 8 GiB and bf16 32 GiB, uniform
#                                                and trace, the policies in reverse order (the first engine
#                                                of a process ran faster in the session before)
#   bash bench/device_decode_step.sh OUT_DIR 3   aggregate throughput at 1-16 sequences; qwen3.6 bf16 32 GiB
#                                                and nvfp4 8 GiB
source bench/device_setup.sh "$@"
q30=model_specs/qwen3-30b-a3b.yaml
q36=model_specs/qwen3.6-35b-a3b.yaml
trace=trace:bench/traces/qwen3-30b-a3b-k6.npz
[ "$part" = 1 ] || export FTC_DEVICE_PLAN=1  # the GPU tests choose their own
if [ "$part" = 1 ]; then
  timeout 560 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_kv_cache.py tests/test_router.py \
    tests/test_timeline.py tests/test_cpu_doorbell.py tests/test_device_plan.py tests/test_gpu.py 2>&1 \
    | tee "$out/pytest_gpu.txt" | grep -E "passed|failed|^FAILED|^ERROR" | tail -30
elif [ "$part" = 2 ]; then
  timeout 250 python3 bench/decode_matrix.py $q30 --target h200 --vram-budget 8GiB --override expert_format=mxfp4 \
    --policies cpu,gpu,adaptive --routings uniform,$trace --new-tokens 66 -o "$out/q30_mxfp4" 2>&1 | grep "tok/s"
  timeout 300 python3 bench/decode_matrix.py $q30 --target h200 --vram-budget 32GiB \
    --policies cpu,gpu,adaptive --routings $trace,uniform --new-tokens 66 -o "$out/q30_bf16" 2>&1 | grep "tok/s"
else
  timeout 200 ftc bench decode $q30 --random-weights --target h200 --vram-budget 32GiB --sequences 1,2,4,8,16 \
    -o "$out/sequences_q30_bf16.json" 2>&1 | grep -E "sequences|aggregate_tok_s|per_sequence|ms_per_step"
  timeout 160 python3 bench/decode_matrix.py $q36 --target h200 --vram-budget 32GiB --policies adaptive,cpu \
    --routings uniform --new-tokens 66 -o "$out/q36_bf16" 2>&1 | grep "tok/s"
  timeout 160 python3 bench/decode_matrix.py $q36 --target h200 --vram-budget 8GiB --override expert_format=nvfp4 \
    --policies adaptive,cpu --routings uniform --new-tokens 66 -o "$out/q36_nvfp4" 2>&1 | grep "tok/s"
fi
