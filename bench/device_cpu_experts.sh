#!/usr/bin/env bash
# Issue 2's device run: the CPU test suite, then the CPU expert kernel at qwen3-30b-a3b shapes
# (4 of its 48 layers: a 4.8 GB pool, far beyond the L3, without a 58 GB file) against torch bf16
# and a plain read, twice at batch 1 to show the spread, then end-to-end CPU decode; --tune adds
# the tiling sweep.
# Usage on the device machine: bash bench/device_cpu_experts.sh OUT_DIR [--tune]
# (FTC_DEVICE_TESTS=tests/FILE.py runs only that test file first.)
set -euo pipefail
out=${1:?output directory}
mkdir -p "$out"
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -2
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
python3 -m pytest -q -p no:cacheprovider ${FTC_DEVICE_TESTS:-tests} > "$out/pytest.txt" 2>&1 || true
tail -3 "$out/pytest.txt"
engine=/tmp/ftc-q30-4l
ftc compile model_specs/qwen3-30b-a3b.yaml --random-weights --override num_layers=4 -o $engine 2>&1 | tail -1
for run in 1 2; do
  ftc bench experts $engine --tokens 1 --seconds 3 -o "$out/bench_experts_t1_run$run.json" > /dev/null
done
ftc bench experts $engine --tokens 8 --seconds 3 -o "$out/bench_experts_t8.json" > /dev/null
python3 - "$out" <<'PY'
import json, pathlib, sys
for p in sorted(pathlib.Path(sys.argv[1]).glob("bench_experts_*.json")):
    r = json.loads(p.read_text())
    print(f"{p.stem:28s} tokens={r['tokens']} threads={r['threads']} kernel={r['kernel_gbps']} GB/s "
          f"(median {r['kernel_gbps_median']}) "
          f"({r['kernel_ms_per_layer']} ms/layer) torch_bf16={r['torch_bf16_gbps']} read={r['torch_read_gbps']}")
PY
# End-to-end CPU decode of the same engine, with the runtime's OpenMP spin limit (default) and with
# OpenMP's own defaults, to show what the limit is for.
prompt=$(python3 -c "import random; r=random.Random(0); print(','.join(str(r.randrange(151000)) for _ in range(128)))")
for mode in default gomp-default; do
  if [ $mode = gomp-default ]; then export GOMP_SPINCOUNT=300000 KMP_BLOCKTIME=200; fi
  for run in 1 2; do
    ftc run $engine --prompt-ids "$prompt" --max-new-tokens 32 --ignore-eos --json > "$out/decode_${mode}_$run.json"
    python3 -c "import json,sys; t=json.load(open(sys.argv[1]))['timings']; print('$mode', t)" "$out/decode_${mode}_$run.json"
  done
done
unset GOMP_SPINCOUNT KMP_BLOCKTIME
if [ "${2:-}" = "--tune" ]; then
  python3 bench/tune_cpu_kernel.py $engine --threads 8,12,16 --prefetch 0,1,2,4 --chunk 8,16,32 --seconds 1.5 \
    | tee "$out/tune.jsonl"
fi
