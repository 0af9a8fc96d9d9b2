#!/usr/bin/env bash
# The device machine's runs, as named stages, with default settings (no FTC_* variable is set here).
#
#   bash bench/device.sh OUT_DIR STAGE [STAGE ...]
#
# Stages:
#   gpu-tests [-- PYTEST_ARGS]  every GPU test (pytest -m gpu tests), its log in OUT_DIR/pytest_gpu.txt;
#                               arguments after -- narrow it (e.g. -- -k deepseek)
#   matrix                      decode tok/s of each engine of the README's table under the miss policies
#                               adaptive, gpu and cpu, twice (the second time in reverse order; the table
#                               gives each one's median run), (`ftc bench matrix`: one expert pool per engine, drawn
#                               in memory; qwen3-30b-a3b bf16 at 32 GiB and MXFP4 at 8 GiB with the bundled
#                               trace and uniform routing, qwen3.6-35b-a3b bf16 at 32 GiB and NVFP4 at 8 GiB
#                               uniform): the tables into OUT_DIR/matrix.txt, each engine's runs (what
#                               `ftc bench decode` prints for each) into OUT_DIR/matrix-MODEL-FORMAT-BUDGET.json
#   matrix:ROW                  one engine of that table (ROW: one of $rows below), where a call's time
#                               holds no more
#   pdl                         the qwen3-30b-a3b bf16 32 GiB trace row again with FTC_PDL=0 and 1, into
#                               OUT_DIR/pdl.txt and OUT_DIR/pdl0.json, pdl1.json
#   speculate                   decode of 256 tokens (a sequence's first passes of each size run eagerly and
#                               capture their graphs) without drafts and with --draft-oracle 0.6, 0.8 and 0.9
#                               (--speculate auto: the controller picks each pass's drafts), adaptive, on qwen3.6-35b-a3b
#                               bf16 at 32 GiB and NVFP4 at 8 GiB (uniform), qwen3-30b-a3b MXFP4 at 8 GiB (the trace)
#                               and DeepSeek-V4-Flash cut to 20 layers with its MTP layer (MXFP4, FP8 projections,
#                               16 GiB, uniform): OUT_DIR/speculate.txt and OUT_DIR/speculate-ROW.json
#   speculate:ROW               one of those (ROW: one of $drafted_rows below)
#   anchor                      llama.cpp's MXFP4 decode at -ncmoe 30 on the same machine (needs .anchors/,
#                               see ../shared/anchors/README.md), into OUT_DIR/anchor
#
# The machine has no package registry: wheels the GPU tests need (fla-core, einops) travel in .whl/
# (name it in the call's carry); the project installs from this tree without its dependencies.
set -uo pipefail
out=${1:?output directory}
shift
mkdir -p "$out"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -2
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/machine.txt"

q30=model_specs/qwen3-30b-a3b.yaml
q36=model_specs/qwen3.6-35b-a3b.yaml
trace=bench/traces/qwen3-30b-a3b-k6.npz

ftc() { python3 -m ftc.cli.main "$@"; }  # the console script's folder may not be on the machine's PATH

matrix() {  # NAME SPEC BUDGET [ftc bench matrix options...]
  local name=$1 spec=$2 budget=$3
  shift 3
  ftc bench matrix "$spec" --random-weights --target h200 --vram-budget "$budget" --miss-policy adaptive,gpu,cpu \
    --repeats 2 -o "$out/matrix-$name.json" "$@" 2>&1 | tee -a "$out/matrix.txt"
}

rows="qwen3-30b-a3b-bf16-32GiB qwen3-30b-a3b-mxfp4-8GiB qwen3.6-35b-a3b-bf16-32GiB qwen3.6-35b-a3b-nvfp4-8GiB"
row() {  # NAME: one engine of the README's table under the three policies
  case $1 in
    qwen3-30b-a3b-bf16-32GiB) matrix "$1" $q30 32GiB --routing-trace $trace --uniform ;;
    qwen3-30b-a3b-mxfp4-8GiB) matrix "$1" $q30 8GiB --routing-trace $trace --uniform --override expert_format=mxfp4 ;;
    qwen3.6-35b-a3b-bf16-32GiB) matrix "$1" $q36 32GiB --uniform ;;
    qwen3.6-35b-a3b-nvfp4-8GiB) matrix "$1" $q36 8GiB --uniform --override expert_format=nvfp4 ;;
    *) echo "unknown matrix row: $1 (one of: $rows)" >&2; return 2 ;;
  esac
}

drafted() {  # NAME SPEC BUDGET [ftc bench matrix options...]: adaptive without drafts and at each oracle P
  local name=$1 spec=$2 budget=$3
  shift 3
  ftc bench matrix "$spec" --random-weights --target h200 --vram-budget "$budget" --miss-policy adaptive \
    --speculate auto --draft-oracle 0.6,0.8,0.9 --new-tokens 256 -o "$out/speculate-$name.json" "$@" 2>&1 \
    | tee -a "$out/speculate.txt"
}

drafted_rows="qwen3.6-35b-a3b-bf16-32GiB qwen3.6-35b-a3b-nvfp4-8GiB qwen3-30b-a3b-mxfp4-8GiB deepseek-v4-flash-20-16GiB"
drafted_row() {  # NAME: one engine of the speculative table
  case $1 in
    qwen3.6-35b-a3b-bf16-32GiB) drafted "$1" $q36 32GiB --uniform ;;
    qwen3.6-35b-a3b-nvfp4-8GiB) drafted "$1" $q36 8GiB --uniform --override expert_format=nvfp4 ;;
    qwen3-30b-a3b-mxfp4-8GiB) drafted "$1" $q30 8GiB --routing-trace $trace --override expert_format=mxfp4 ;;
    deepseek-v4-flash-20-16GiB) drafted "$1" model_specs/deepseek-v4-flash.yaml 16GiB --uniform \
      --override num_layers=20 --override dense_format=fp8 ;;
    *) echo "unknown speculate row: $1 (one of: $drafted_rows)" >&2; return 2 ;;
  esac
}

while [ $# -gt 0 ]; do
  stage=$1
  shift
  case $stage in
    gpu-tests)
      args=()
      if [ "${1:-}" = "--" ]; then shift; args=("$@"); set --; fi
      # -v: each test's outcome as it ends, so that a log cut off by the call's limit still names a failure
      # (the machine lacks uvicorn: the two modules of CPU-only serving tests that import it fail to collect)
      # (tests/failures_as_they_happen.py prints each failure's report as it ends, so a log cut off by the
      # call's limit still says why)
      PYTHONPATH=tests${PYTHONPATH:+:$PYTHONPATH} python3 -m pytest -v -p no:cacheprovider -p failures_as_they_happen \
        --continue-on-collection-errors -m gpu tests "${args[@]}" 2>&1 \
        | tee "$out/pytest_gpu.txt" | grep -v " PASSED\| SKIPPED" | tail -40 ;;
    matrix)
      for name in $rows; do row "$name"; done ;;
    matrix:*)
      row "${stage#matrix:}" ;;
    speculate)
      for name in $drafted_rows; do drafted_row "$name"; done ;;
    speculate:*)
      drafted_row "${stage#speculate:}" ;;
    pdl)
      for pdl in 0 1; do
        FTC_PDL=$pdl ftc bench matrix $q30 --random-weights --target h200 --vram-budget 32GiB --miss-policy adaptive \
          --routing-trace $trace -o "$out/pdl$pdl.json" 2>&1 | tee -a "$out/pdl.txt"
      done ;;
    anchor)
      bash .anchors/llama_anchor.sh "$out/anchor" mxfp4 "30" 2>&1 | tail -20 ;;
    *)
      echo "unknown stage: $stage (gpu-tests, matrix, matrix:ROW, speculate, speculate:ROW, pdl, anchor)" >&2
      exit 2 ;;
  esac
done
