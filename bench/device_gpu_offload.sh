#!/usr/bin/env bash
# Issue 3 on the device: the GPU tests, then `ftc bench decode` at qwen3-30b-a3b shapes (4 of 48
# layers) for each miss policy. --slots 240 gives the 4-layer engine the share of its pool (47%)
# that a 32 GiB budget gives the whole 48-layer model (`ftc inspect --vram-budget 32GiB` on it).
# Usage on the device machine: bash bench/device_gpu_offload.sh OUT_DIR [NEW_TOKENS]
set -euo pipefail
out=${1:?output directory}
new=${2:-64}
mkdir -p "$out"
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -2
python3 -m pytest -q -p no:cacheprovider -m gpu tests > "$out/pytest_gpu.txt" 2>&1 || true
tail -3 "$out/pytest_gpu.txt"
engine=/tmp/ftc-q30-4l
ftc compile model_specs/qwen3-30b-a3b.yaml --target h200 --random-weights --override num_layers=4 -o $engine \
  2>&1 | tail -1
for policy in adaptive gpu cpu; do
  ftc bench $engine decode --device cuda --vram-budget 32GiB --slots 240 --miss-policy $policy \
    --new-tokens "$new" -o "$out/decode_$policy.json" > /dev/null
  python3 -c "import json,sys; r=json.load(open(sys.argv[1])); e=r['experts']; print('$policy', r['decode_tok_s'], \
'tok/s', r['ms_per_token'], 'ms/token; bound', r['miss_bound_ms_per_token'], 'miss rate', round(e['miss_rate'], 3), \
'mean m', round(e['mean_m'], 2), 'q', round(e['mean_q'], 2), e['ms_per_call'])" "$out/decode_$policy.json"
done
