#!/usr/bin/env bash
# Issues 6 and 7 on the device: the qwen3.6-35b-a3b hybrid (40 layers, bf16 random weights generated
# into memory, no weight file) at --vram-budget 32GiB: decode by routing, prefill at 8K with two
# layer buffers and with one, then the agent session grown to about 20K tokens with the prefix
# cache, without checkpoints and without any cache. Four JSON files land in OUT_DIR.
#   bash bench/device_hybrid.sh OUT_DIR [NEW_TOKENS] [SESSION_TOKENS] [STAGES]
# STAGES (default decode,prefill,agent): all three take about 10 minutes on the device, each
# drawing the 64 GB pool again, so one device call of at most 10 minutes takes one or two.
# The Gated DeltaNet kernels come from flash-linear-attention (`pip install '.[gpu]'`). The device
# machine has no package index: put the fla_core wheel in .whl/ here (it is ignored by git), name
# .whl in the call's carry, and the script installs it.
set -euo pipefail
if ls .whl/fla_core-*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/fla_core-*.whl
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
python3 -c "import fla.ops.gated_delta_rule" 2>/dev/null ||
  echo "device_hybrid.sh: fla-core is not installed: the recurrence runs in torch (much slower)" >&2
out=${1:?output directory}
new=${2:-66}
session=${3:-20000}
stages=,${4:-decode,prefill,agent},
spec=model_specs/qwen3.6-35b-a3b.yaml
mkdir -p "$out"
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -2
stage() { [[ $stages == *,$1,* ]]; }
if stage decode; then
  python3 bench/decode_matrix.py "$spec" --target h200 --vram-budget 32GiB --policies adaptive,gpu,cpu \
    --routings sampled,uniform --new-tokens "$new" -o "$out" 2>&1 | grep -v "━"
fi
if stage prefill; then
  ftc bench prefill "$spec" --random-weights --target h200 --device cuda --vram-budget 32GiB --lengths 8192 \
    --compare -o "$out/prefill_hybrid.json" 2>&1 | grep -v "━" | tail -n 3
fi
if stage agent; then
  ftc bench agent "$spec" --random-weights --target h200 --device cuda --vram-budget 32GiB \
    --session-tokens "$session" --compare --plot "$out/agent.png" -o "$out/agent.json" 2>&1 | grep -v "━" | tail -n 3
fi
