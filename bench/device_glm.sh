#!/usr/bin/env bash
# Issue 21's device run, one call of under 10 minutes (carry .whl):  bash bench/device_glm.sh OUT_DIR 1
# First the GPU tests of the GLM family, of batched graphs and of the doorbell (a call without CPU
# experts posts no job); then GLM-5.2's real shapes cut to 14 layers (11 MoE layers, a 59.8 GB NVFP4 pool of random
# weights in memory: what one call's time allows; the host's 128 GiB would hold about 20) at the
# share of the pool a 96 GB card caches of the whole model (16.0%; 446 slots, 15.8%, at 19 GiB
# here): decode and prefill against the bound, beside `ftc inspect`'s prediction of the same cut.
source bench/device_setup.sh "$@"
glm=model_specs/glm-5.2.yaml
cut="--override num_layers=14"
budget=19GiB
timeout 190 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu.py tests/test_cpu_doorbell.py \
  -k "glm or batched or doorbell or wait_tunes or device_step" 2>&1 | tee "$out/pytest_gpu.txt" \
  | grep -E "passed|failed|^FAILED|^ERROR" | tail -20
ftc inspect $glm --target h200 --vram-budget $budget $cut > "$out/glm_inspect.txt" 2>&1
grep -E "expert slots|decode|prefill|tok/s" "$out/glm_inspect.txt"
FTC_DEVICE_PLAN=1 timeout 360 python3 bench/decode_matrix.py $glm --target h200 --vram-budget $budget $cut \
  --policies adaptive --routings uniform --new-tokens 34 --prefill-lengths 2048,8192 -o "$out/glm" \
  > "$out/glm.log" 2>&1
echo "glm rc $?"; grep -E "tok/s|in memory" "$out/glm.log" || tail -c 2000 "$out/glm.log"
