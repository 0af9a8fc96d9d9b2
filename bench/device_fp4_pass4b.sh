#!/usr/bin/env bash
# Issue 18, fourth session, second call: the 16-row interleaved 4-bit layout against the shipped
# row-contiguous one (bench/dev/fp4_row_interleave.cpp, same prefetch and work split), and the
# hybrid GPU test's errors over several prompts (its restored-checkpoint bound failed on 2 of 3
# seeds in the first call).
#   bash bench/device_fp4_pass4b.sh OUT_DIR     (carry .whl: fla-core, einops)
set -uo pipefail
out=${1:?output directory}
mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -2
g++ -O3 -march=native -fopenmp -std=c++17 bench/dev/fp4_row_interleave.cpp -o /tmp/fp4_row_interleave
for t in 16 1; do OMP_PROC_BIND=close /tmp/fp4_row_interleave $t 2>&1 | tee -a "$out/row_interleave.txt"; done
python3 bench/dev/hybrid_gpu_errors.py --seeds 1,2,3,4 2>&1 | grep seed | tee "$out/hybrid_errors.txt"
