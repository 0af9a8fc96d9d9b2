#!/usr/bin/env bash
# Issue 21's device runs, each one call of under 10 minutes (carry .whl):  bash bench/device_glm.sh OUT_DIR PART
# Part 1:
# First the GPU tests of the GLM family (bf16 and FP8 projections), of batched graphs, of the
# doorbell (a call without CPU experts posts no job) and of the FP8 kernels; then GLM-5.2's real
# shapes cut to 16 layers (13 MoE layers, a 70.7 GB NVFP4 pool of random weights in memory: what
# one call's time and the host's 128 GiB allow) at the share of the pool a 96 GB card caches of the
# whole model (16.0% with bf16 projections: 532 slots at 21.5 GiB here, at least the 2 × 256 that
# prompt chunks stream through, as on that card): decode and prefill against the bound, beside
# `ftc inspect`'s prediction of the cut and of the whole model on rtx-pro-6000; then, in the time
# left, the same cut with FP8 projections at that card's FP8 share (19.8%: 20.6 GiB here).
# Part 2: that FP8 cut alone, decode and prefill.
# Part 3: the sparse latent attention kernel's GPU tests (alone, then inside GLM's decode graphs),
# then the FP8 cut's decode and its 2048-token prefill in the time left.
# Part 4: the FP8 gemv as an op that torch.compile keeps whole (GLM's functions compiled with FP8
# projections): the FP8 GPU tests and GLM's FP8 graph cases, then the FP8 cut's decode with a
# profile of its steps (where the body's 0.35-0.83 ms per MoE layer goes); about 300 s.
# Part 5: part 3 with the sparse kernel's tilings swept (bench/dev/sparse_mla.py) before the cut.
# Part 6: GPU tests (the sparse kernel, GLM's graphs, FP8, the device step) and the decode expert
# kernel's tilings on GLM-5.2's and qwen3.6's NVFP4 shapes (bench/tune_decode_experts.py); ~350 s.
source bench/device_setup.sh "$@"
end=$(( $(date +%s) + 570 ))
glm=model_specs/glm-5.2.yaml
cut="--override num_layers=16"
if [ "$part" = 3 ] || [ "$part" = 5 ]; then
  timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_glm_layers.py tests/test_gpu.py \
    -k "sparse_latent or glm_decode_graphs" 2>&1 | tee "$out/pytest_gpu.txt" | grep -E "passed|failed|^FAILED|^ERROR"
  [ "$part" = 5 ] && timeout 120 python3 bench/dev/sparse_mla.py -o "$out/sparse_mla" 2>&1 | tail -20
  FTC_DEVICE_PLAN=1 timeout $(( end - $(date +%s) )) python3 bench/decode_matrix.py $glm --target h200 \
    --vram-budget 20.6GiB $cut --override dense_format=fp8 --policies adaptive --routings uniform --new-tokens 34 \
    --prefill-lengths 2048 -o "$out/glm_fp8" > "$out/glm_fp8.log" 2>&1
  echo "glm fp8 rc $?"; grep -E "tok/s|in memory" "$out/glm_fp8.log" || tail -c 1500 "$out/glm_fp8.log"
  exit 0
fi
if [ "$part" = 6 ]; then
  timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_glm_layers.py tests/test_gpu.py \
    tests/test_fp8_linear.py -k "sparse_latent or glm_decode_graphs or fp8 or device_step" 2>&1 \
    | tee "$out/pytest_gpu.txt" | grep -E "passed|failed|^FAILED|^ERROR"
  for spec in "$glm" "model_specs/qwen3.6-35b-a3b.yaml"; do
    timeout 150 python3 bench/tune_decode_experts.py $spec --override expert_format=nvfp4 2>&1 \
      | tee -a "$out/tune_decode_experts.txt" | grep -E "best|error"
  done
  exit 0
fi
if [ "$part" = 4 ]; then
  timeout 120 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_fp8_linear.py tests/test_gpu.py \
    -k "fp8" 2>&1 | tee "$out/pytest_gpu.txt" | grep -E "passed|failed|^FAILED|^ERROR"
  FTC_DEVICE_PLAN=1 timeout 300 python3 bench/decode_matrix.py $glm --target h200 --vram-budget 20.6GiB $cut \
    --override dense_format=fp8 --policies adaptive --routings uniform --new-tokens 34 --profile \
    -o "$out/glm_fp8" > "$out/glm_fp8.log" 2>&1
  echo "glm fp8 rc $?"; grep -E "tok/s|in memory" "$out/glm_fp8.log" || tail -c 1500 "$out/glm_fp8.log"
  head -45 "$out/glm_fp8/profile.txt"
  exit 0
fi
if [ "$part" = 2 ]; then
  FTC_DEVICE_PLAN=1 timeout 560 python3 bench/decode_matrix.py $glm --target h200 --vram-budget 20.6GiB $cut \
    --override dense_format=fp8 --policies adaptive --routings uniform --new-tokens 34 --prefill-lengths 2048,8192 \
    -o "$out/glm_fp8" > "$out/glm_fp8.log" 2>&1
  echo "glm fp8 rc $?"; grep -E "tok/s|in memory" "$out/glm_fp8.log" || tail -c 1500 "$out/glm_fp8.log"
  exit 0
fi
timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu.py tests/test_cpu_doorbell.py \
  tests/test_fp8_linear.py -k "glm or batched or doorbell or wait_tunes or device_step_graphs or fp8" 2>&1 \
  | tee "$out/pytest_gpu.txt" | grep -E "passed|failed|^FAILED|^ERROR" | tail -20
for args in "$cut --vram-budget 21.5GiB" "$cut --vram-budget 20.6GiB --dense-format fp8" \
            "--target rtx-pro-6000 --vram-budget 96GiB"; do
  ftc inspect $glm --target h200 $args 2>&1 | tee -a "$out/glm_inspect.txt" | grep -E "expert slots|decode \(|prefill"
done
export FTC_DEVICE_PLAN=1
timeout $(( end - $(date +%s) < 330 ? end - $(date +%s) : 330 )) python3 bench/decode_matrix.py $glm --target h200 \
  --vram-budget 21.5GiB $cut --policies adaptive --routings uniform --new-tokens 34 --prefill-lengths 2048,8192 \
  -o "$out/glm" > "$out/glm.log" 2>&1
echo "glm rc $?"; grep -E "tok/s|in memory" "$out/glm.log" || tail -c 2000 "$out/glm.log"
timeout $(( end - $(date +%s) )) python3 bench/decode_matrix.py $glm --target h200 --vram-budget 20.6GiB $cut \
  --override dense_format=fp8 --policies adaptive --routings uniform --new-tokens 34 -o "$out/glm_fp8" \
  > "$out/glm_fp8.log" 2>&1
echo "glm fp8 rc $?"; grep -E "tok/s|in memory" "$out/glm_fp8.log" || tail -c 1500 "$out/glm_fp8.log"
