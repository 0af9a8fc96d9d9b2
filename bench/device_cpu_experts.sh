#!/usr/bin/env bash
# Issue 2's device run: the CPU expert kernel at qwen3-30b-a3b shapes (4 of its 48 layers, so the
# pool is 4.8 GB, far beyond the L3, without a 58 GB file), against torch bf16 and a plain read.
# Usage on the device machine: bash bench/device_cpu_experts.sh OUT_DIR
set -euo pipefail
out=${1:?output directory}
mkdir -p "$out"
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -2
lscpu | grep -E "Model name|^CPU\(s\)|Thread|Core|Socket|L3|Flags" | cut -c1-200 > "$out/lscpu.txt"
engine=/tmp/ftc-q30-4l
ftc compile model_specs/qwen3-30b-a3b.yaml --random-weights --override num_layers=4 -o $engine 2>&1 | tail -3
for t in 1 4; do
  ftc bench $engine experts --tokens $t --seconds 3 -o "$out/bench_experts_t$t.json"
done
python3 bench/tune_cpu_kernel.py $engine --threads 8,12,16 --prefetch 0,1,2,4 --chunk 8,16,32 --seconds 1.5 \
  | tee "$out/tune.jsonl"
