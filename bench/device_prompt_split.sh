#!/usr/bin/env bash
# Issue 24 on the device: prompt chunks on both paths (the CPU computing part of each streamed
# layer's uncached experts in place, `--prefill-split`) and the tile kernels for many tokens per
# expert (AMX there). Calls of under 10 minutes on one machine (carry .whl: fla-core, einops):
#   bash bench/device_prompt_split.sh OUT_DIR 1   the GPU tests of the split and of streaming, the CPU
#                                                 kernels' tests (AMX tiles: their first run on AMX), the
#                                                 tile kernels' TFLOP/s against torch's bf16 matmul at 16-1024
#                                                 tokens per expert (AMX, then FTC_AMX=0: AVX-512 BF16), per
#                                                 format; qwen3-30b-a3b bf16 32 GiB prefill 2K-8K, split off
#                                                 against auto (bar: 8K at 1.3x the PCIe ceiling)
#   bash bench/device_prompt_split.sh OUT_DIR 2   the agent session (qwen3.6-35b-a3b bf16 32 GiB, 20K tokens,
#                                                 --compare) with the split, then its edit turn without
#   bash bench/device_prompt_split.sh OUT_DIR 3   prefill at 8 GiB of the 4-bit engines (qwen3-30b-a3b mxfp4,
#                                                 qwen3.6-35b-a3b nvfp4), split off against auto
#   bash bench/device_prompt_split.sh OUT_DIR 4   recurrent-state captures: fla's kernels against the torch
#                                                 recurrence and the hybrid engine's checkpoint tests, then
#                                                 bench/capture_cost.py at qwen3.6-35b-a3b's shapes (bar: 5 ms)
#   bash bench/device_prompt_split.sh OUT_DIR 5   where a split chunk's time goes: whether a small host→device copy
#                                                 waits behind another stream's (bench/dev/h2d_queue_probe.py), the
#                                                 GPU tests of the split, bench/prefill_profile.py on qwen3-30b-a3b
#                                                 bf16 32 GiB at 2K and 8K tokens, split off and auto (traces)
#   bash bench/device_prompt_split.sh OUT_DIR 6   where an agent turn's time goes: bench/agent_profile.py on the
#                                                 agent session (qwen3.6-35b-a3b bf16 32 GiB, 20K, split auto), tool
#                                                 turns 13 and 14 against the edit turn 16 (traces)
#   bash bench/device_prompt_split.sh OUT_DIR 7   the device waiting for each CPU part (io/host_take.py's signaled
#                                                 take): its GPU tests and the decode doorbell's (which shares its
#                                                 flag code), then bench/prefill_profile.py as in part 5 with
#                                                 FTC_DEVICE_WAITS_CPU_PART=0, then 1 (traces)
#   bash bench/device_prompt_split.sh OUT_DIR 8   part 7 in under 6 minutes: the take's and the split's GPU tests,
#                                                 then a 2K split prompt with the device waiting and without
#   bash bench/device_prompt_split.sh OUT_DIR 9   the split's estimates as medians: the doorbell's and the signaled
#                                                 take's GPU tests, then qwen3-30b-a3b bf16 32 GiB prefill 2K-8K with
#                                                 the device waiting (split off and auto), then the host waiting (auto)
#   bash bench/device_prompt_split.sh OUT_DIR 10  the agent session (split auto, --compare), then the 4-bit engines at
#                                                 8 GiB as in part 3, in under 10 minutes (FTC_DEVICE_WAITS_CPU_PART
#                                                 as the caller sets it)
#   bash bench/device_prompt_split.sh OUT_DIR 11  the split priced with the result's read and the copies' rate alone:
#                                                 the signaled take's GPU test, qwen3-30b-a3b bf16 32 GiB prefill 2K-8K
#                                                 (split off and auto), then the agent session (split auto, --compare)
source bench/device_setup.sh "$@"
q30=model_specs/qwen3-30b-a3b.yaml
q36=model_specs/qwen3.6-35b-a3b.yaml
throughput() {  # FORMAT: a 1-layer qwen3-30b-a3b engine's CPU kernel against torch, AMX and not
  ftc compile $q30 --random-weights --target auto --override num_layers=1 --quant "$1" -o "/tmp/q30-$1" \
    --force 2>&1 | grep -E "kernel check|error" | tail -2
  for amx in 1 0; do
    FTC_AMX=$amx timeout 100 python3 bench/cpu_batch_throughput.py "/tmp/q30-$1" --tokens 1,16,32,64,128,256,1024 \
      --seconds 0.5 2>&1 | tee -a "$out/cpu_tiles_$1.jsonl" | tail -7
  done
}
bf16_prefill() {  # TIMEOUT SPLITS NAME: qwen3-30b-a3b bf16 32 GiB, one 2K and one 8K prompt
  timeout "$1" ftc bench prefill $q30 --random-weights --target h200 --vram-budget 32GiB --lengths 2048,8192 \
    --prefill-split "$2" -o "$out/$3.json" 2>&1 | grep -v "━" | tail -n 30
}
four_bit_prefill() {  # TIMEOUT_MXFP4 TIMEOUT_NVFP4: the 4-bit engines at 8 GiB, 2K and 8K, split off and auto
  timeout "$1" ftc bench prefill $q30 --random-weights --target h200 --vram-budget 8GiB --override expert_format=mxfp4 \
    --lengths 2048,8192 --prefill-split off,auto -o "$out/prefill_q30_mxfp4.json" 2>&1 | grep -v "━" | tail -n 30
  timeout "$2" ftc bench prefill $q36 --random-weights --target h200 --vram-budget 8GiB \
    --override expert_format=nvfp4 --lengths 2048,8192 --prefill-split off,auto -o "$out/prefill_q36_nvfp4.json" \
    2>&1 | grep -v "━" | tail -n 30
}
agent() {  # TIMEOUT SPLIT NAME [--compare]: the agent session, qwen3.6-35b-a3b bf16 32 GiB, 20K tokens
  timeout "$1" ftc bench agent $q36 --random-weights --target h200 --vram-budget 32GiB --session-tokens 20000 \
    --prefill-split "$2" "${@:4}" -o "$out/$3.json" 2>&1 | grep -v "━" | tail -n 40
}
if [ "$part" = 1 ]; then
  timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu.py -k "prefill or streamed" 2>&1 \
    | tee "$out/pytest_gpu.txt" | grep -E "passed|failed|^FAILED|^ERROR" | tail -20
  timeout 150 python3 -m pytest -q -p no:cacheprovider -rs tests/test_cpu_kernels.py -k avx512 2>&1 \
    | tee "$out/pytest_cpu.txt" | grep -E "passed|failed|^FAILED|^ERROR|SKIP" | tail -20
  for fmt in bf16 mxfp4 nvfp4; do throughput $fmt; done
  bf16_prefill 150 off,auto prefill_q30_bf16
elif [ "$part" = 2 ]; then
  agent 420 auto agent_q36_split --compare
  agent 300 off agent_q36_off
elif [ "$part" = 3 ]; then
  four_bit_prefill 200 300
elif [ "$part" = 4 ]; then
  timeout 300 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu.py -k "fla or checkpoint or hybrid_engine" 2>&1 \
    | tee "$out/pytest_gpu_captures.txt" | grep -E "passed|failed|^FAILED|^ERROR" | tail -20
  timeout 200 python3 bench/capture_cost.py $q36 --tokens 2048,8192 --captures 0,1,8,64 -o "$out" 2>&1 | tail -n 20
elif [ "$part" = 5 ]; then
  timeout 60 python3 bench/dev/h2d_queue_probe.py 2>&1 | tee "$out/h2d_queue_probe.json"
  timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu.py -k "prefill or streamed or take_from_host" \
    2>&1 | tee "$out/pytest_gpu.txt" | grep -E "passed|failed|^FAILED|^ERROR" | tail -20
  timeout 200 python3 bench/prefill_profile.py $q30 --tokens 2048,8192 --vram-budget 32GiB --prefill-split off,auto \
    --trace-dir "$out" 2>&1 | grep -v "━" > "$out/prefill_profile.txt"
  grep -E '"(prefill_split|tokens|unprofiled_s|tok_s|cpu_experts|cpu_s|serial_s|cpu_parts_s)"' "$out/prefill_profile.txt"
  find "$out" -name "*.json.gz" -size +15M -delete  # what cannot come back
elif [ "$part" = 6 ]; then
  timeout 400 python3 bench/agent_profile.py $q36 --vram-budget 32GiB --session-tokens 20000 --turns 13,14,16 \
    --prefill-split auto --trace-dir "$out" 2>&1 | grep -v "━" > "$out/agent_profile.txt"
  grep -E '"(turn|kind|wall_s|copy_busy_s|kernel_busy_s|cpu_parts_s|serial_s)"' "$out/agent_profile.txt"
  find "$out" -name "*.json.gz" -size +15M -delete
elif [ "$part" = 7 ]; then
  timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu.py tests/test_cpu_doorbell.py \
    tests/test_device_plan.py -k "prefill or streamed or take or device_step or doorbell or join or abandoned" 2>&1 \
    | tee "$out/pytest_gpu.txt" | grep -E "passed|failed|^FAILED|^ERROR|Error" | tail -20
  for waits in 1 0; do  # split off has no CPU part to wait for: once
    splits=$([ $waits = 0 ] && echo off,auto || echo auto)
    FTC_DEVICE_WAITS_CPU_PART=$waits timeout $([ $waits = 0 ] && echo 200 || echo 170) python3 bench/prefill_profile.py $q30 --tokens 2048,8192 \
      --vram-budget 32GiB --prefill-split $splits --trace-dir "$out/waits$waits" 2>&1 | grep -v "━" \
      > "$out/prefill_profile_waits$waits.txt"
    grep -E '"(prefill_split|tokens|unprofiled_s|tok_s|cpu_experts|cpu_s|serial_s|serial_median_ms|cpu_parts_s|device_take_s|device_wait_s)"' \
      "$out/prefill_profile_waits$waits.txt"
  done
  find "$out" -name "*.json.gz" ! -name "prefill_auto_2048.json.gz" -delete  # 8 files at most come back
  find "$out" -name "*.json.gz" -size +15M -delete
elif [ "$part" = 8 ]; then
  timeout 100 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu.py -k "take or split" 2>&1 \
    | tee "$out/pytest_gpu.txt" | grep -E "passed|failed|^FAILED|^ERROR|Error" | tail -20
  for waits in 1 0; do
    FTC_DEVICE_WAITS_CPU_PART=$waits timeout 120 python3 bench/prefill_profile.py $q30 --tokens 2048 \
      --vram-budget 32GiB --prefill-split auto 2>&1 | grep -v "━" > "$out/prefill_profile_waits$waits.txt"
    grep -E '"(unprofiled_s|tok_s|cpu_experts|cpu_s|serial_s|serial_median_ms|cpu_parts_s|device_take_s|device_wait_s)"' \
      "$out/prefill_profile_waits$waits.txt"
  done
elif [ "$part" = 9 ]; then
  timeout 80 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_cpu_doorbell.py tests/test_gpu.py \
    -k "doorbell or signaled" 2>&1 | tee "$out/pytest_gpu.txt" | grep -E "passed|failed|^FAILED|^ERROR|Error" | tail -20
  for waits in 1 0; do
    FTC_DEVICE_WAITS_CPU_PART=$waits bf16_prefill 180 $([ $waits = 1 ] && echo off,auto || echo auto) \
      "prefill_q30_bf16_waits$waits"
  done
elif [ "$part" = 10 ]; then
  agent 300 auto agent_q36_split --compare
  four_bit_prefill 110 130
elif [ "$part" = 11 ]; then
  timeout 60 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu.py -k signaled 2>&1 \
    | tee "$out/pytest_gpu.txt" | grep -E "passed|failed|^FAILED|^ERROR|Error" | tail -20
  bf16_prefill 150 off,auto prefill_q30_bf16
  agent 300 auto agent_q36_split --compare
fi
