#!/usr/bin/env bash
# Issue 21's device run: GLM-5.2's real shapes cut to the layers the device's host memory holds
# (16: 13 MoE layers, a 70.6 GB NVFP4 pool of random weights in memory) with the share of the pool
# a 96 GB card caches of the whole model (16.0%: 21.5 GiB here), decode and prefill against the
# bound and `ftc inspect`'s prediction of the same cut; then the GPU tests of the family and of
# the doorbell (a call without CPU experts posts no job). One call of under 10 minutes (carry .whl):
#   bash bench/device_glm.sh OUT_DIR 1
source bench/device_setup.sh "$@"
glm=model_specs/glm-5.2.yaml
cut="--override num_layers=16"
budget=21.5GiB
timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu.py tests/test_cpu_doorbell.py \
  -k "glm or doorbell or wait_tunes or device_step" 2>&1 | tee "$out/pytest_gpu.txt" \
  | grep -E "passed|failed|^FAILED|^ERROR" | tail -20
ftc inspect $glm --target h200 --vram-budget $budget $cut > "$out/glm_inspect.txt" 2>&1
grep -E "expert slots|decode|prefill|tok/s" "$out/glm_inspect.txt"
FTC_DEVICE_PLAN=1 timeout 400 python3 bench/decode_matrix.py $glm --target h200 --vram-budget $budget $cut \
  --policies adaptive --routings uniform --new-tokens 34 --prefill-lengths 2048,8192 -o "$out/glm" \
  > "$out/glm.log" 2>&1
echo "glm rc $?"; grep -E "tok/s|in memory" "$out/glm.log" || tail -c 2000 "$out/glm.log"
