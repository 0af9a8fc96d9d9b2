#!/usr/bin/env bash
# Issue 3, first device run: the GPU tests, then GPU decode of qwen3-30b-a3b shapes (4 of 48 layers)
# with the experts split between a slot cache and the CPU, for each miss policy. --slots 240 gives
# the 4-layer engine the share of its pool (47%) that a 32 GiB budget gives the whole 48-layer model.
# Usage on the device machine: bash bench/device_gpu_offload.sh OUT_DIR
set -euo pipefail
out=${1:?output directory}
mkdir -p "$out"
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -2
python3 -m pytest -q -p no:cacheprovider -m gpu tests > "$out/pytest_gpu.txt" 2>&1 || true
tail -3 "$out/pytest_gpu.txt"
engine=/tmp/ftc-q30-4l
ftc compile model_specs/qwen3-30b-a3b.yaml --target h200 --random-weights --override num_layers=4 -o $engine \
  2>&1 | tail -1
ftc inspect $engine --vram-budget 32GiB | sed -n '/GPU memory/,/total/p'
prompt=$(python3 -c "import random; r=random.Random(0); print(','.join(str(r.randrange(151000)) for _ in range(128)))")
for policy in adaptive gpu cpu; do
  ftc run $engine --prompt-ids "$prompt" --max-new-tokens 64 --ignore-eos --json --device cuda \
    --vram-budget 32GiB --slots 240 --miss-policy $policy > "$out/decode_$policy.json"
  python3 -c "import json,sys; r=json.load(open(sys.argv[1])); print('$policy', r['timings'], r['offload']['experts'])" \
    "$out/decode_$policy.json"
done
