#!/usr/bin/env bash
# Issue 22's device runs, each one call of under 10 minutes (carry .whl):  bash bench/device_dsv4.sh OUT_DIR PART
# Part 1: the GPU tests of the DeepSeek-V4 family (the tiny spec on the GPU against the CPU
# engine, bf16 and MXFP4 experts; the decode attention kernel with sinks at Flash's shape, timed)
# and of the one-graph MoE step; `ftc inspect` of DeepSeek-V4-Flash
# cut to 20 layers on this GPU and of the whole model on an RTX 5090 server at 32 GiB (13.3% of
# the pool in slots); then the cut (a 64 GiB MXFP4 pool of random weights in memory) at that share
# of its pool (16 GiB here: 682 slots, beyond the 2 × 256 that prompt chunks stream through):
# decode with uniform routing against the bound, and a 2048-token prompt.
# Part 2: the family's decode graphs: their GPU tests (against the eager step, across a store's
# growth, a restored checkpoint and batches; bf16 and MXFP4) with the family's other GPU tests and
# one other family's batched graphs; then the cut above decoding as one whole-step graph
# (FTC_DEVICE_PLAN=1), the step's device timeline printed.
# Part 4: issue 22's closing run: the family's GPU tests, `ftc inspect` of the cut and of the whole
# model (this GPU and an RTX 5090 server, FP8 projections), the cut with FP8 projections at 16 GiB
# (no profiler), decode and a 2048-token prompt.
# Part 3: the family's GPU tests after the fused step (the hyper-connections' kernel, the compiled
# attention projections and compressor steps, FP8 projections), then the cut with FP8 projections
# at the share of its pool that a 32 GB card caches of the whole model with them (16 GiB here:
# 17.1%), decode (profiled) and a 2048-token prompt.
source bench/device_setup.sh "$@"
end=$(( $(date +%s) + ${FTC_CALL_S:-570} ))  # FTC_CALL_S: seconds this call may take
spec=model_specs/deepseek-v4-flash.yaml
cut="--override num_layers=20"
if [ "$part" = 4 ]; then
  timeout 240 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu.py tests/test_deepseek_v4_family.py \
    -k deepseek 2>&1 | tee "$out/pytest_gpu.txt" | grep -E "passed|failed|^FAILED|^ERROR" | tail -20
  for args in "$cut --vram-budget 16GiB" "--target rtx-5090-server --vram-budget 32GiB" "--vram-budget 32GiB"; do
    ftc inspect $spec --target h200 $args --dense-format fp8 2>&1 | tee -a "$out/dsv4_inspect.txt" \
      | grep -E -A1 "expert slots|decode \(|prefill"
  done
  FTC_DEVICE_PLAN=1 timeout $(( end - $(date +%s) )) python3 bench/decode_matrix.py $spec --target h200 \
    --vram-budget 16GiB $cut --override dense_format=fp8 --policies adaptive --routings uniform --new-tokens 66 \
    --prefill-lengths 2048 -o "$out/dsv4" > "$out/dsv4.log" 2>&1
  echo "dsv4 rc $?"; grep -E "tok/s|in memory" "$out/dsv4.log" || tail -c 2500 "$out/dsv4.log"
  exit 0
fi
if [ "$part" = 3 ]; then
  timeout 240 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu.py tests/test_deepseek_v4_family.py \
    -k deepseek 2>&1 | tee "$out/pytest_gpu.txt" | grep -E "passed|failed|^FAILED|^ERROR" | tail -20
  FTC_DEVICE_PLAN=1 timeout $(( end - $(date +%s) )) python3 bench/decode_matrix.py $spec --target h200 \
    --vram-budget 16GiB $cut --override dense_format=fp8 --policies adaptive --routings uniform --new-tokens 34 \
    --profile --prefill-lengths 2048 -o "$out/dsv4f" > "$out/dsv4f.log" 2>&1
  echo "dsv4 rc $?"; grep -E "tok/s|in memory|VRAM" "$out/dsv4f.log" || tail -c 2500 "$out/dsv4f.log"
  sed -n 48,80p "$out/dsv4f/profile.txt"  # the table by CUDA time
  exit 0
fi
if [ "$part" = 2 ]; then
  timeout 240 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu.py tests/test_deepseek_v4_family.py \
    -k deepseek 2>&1 | tee "$out/pytest_gpu.txt" | grep -E "passed|failed|^FAILED|^ERROR" | tail -20
  timeout 60 python3 -m pytest -q -p no:cacheprovider -m gpu \
    "tests/test_gpu.py::test_batched_decode_graphs_equal_the_eager_batch[qwen3-moe-tiny-None-bf16]" 2>&1 \
    | tee "$out/pytest_gpu_qwen.txt" | grep -E "passed|failed|^FAILED|^ERROR" | tail -5
  FTC_DEVICE_PLAN=1 timeout $(( end - $(date +%s) )) python3 bench/decode_matrix.py $spec --target h200 \
    --vram-budget 16GiB $cut --policies adaptive --routings uniform --new-tokens 34 -o "$out/dsv4g" \
    > "$out/dsv4g.log" 2>&1
  echo "dsv4 rc $?"; grep -E "tok/s|in memory|timeline|ms per" "$out/dsv4g.log" || tail -c 2500 "$out/dsv4g.log"
  exit 0
fi
timeout 200 python3 -m pytest -q -s -p no:cacheprovider -m gpu tests/test_deepseek_v4_family.py tests/test_gpu.py \
  -k "deepseek or device_step" 2>&1 | tee "$out/pytest_gpu.txt" \
  | grep -E "passed|failed|^FAILED|^ERROR|µs" | tail -20
for args in "$cut --vram-budget 16GiB" "--target rtx-5090-server --vram-budget 32GiB"; do
  ftc inspect $spec --target h200 $args 2>&1 | tee -a "$out/dsv4_inspect.txt" | grep -E -A1 "expert slots|decode \(|prefill"
done
timeout $(( end - $(date +%s) )) python3 bench/decode_matrix.py $spec --target h200 --vram-budget 16GiB $cut \
  --policies adaptive --routings uniform --new-tokens 34 --prefill-lengths 2048 -o "$out/dsv4" > "$out/dsv4.log" 2>&1
echo "dsv4 rc $?"; grep -E "tok/s|in memory" "$out/dsv4.log" || tail -c 2500 "$out/dsv4.log"
