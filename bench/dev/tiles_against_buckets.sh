#!/usr/bin/env bash
# The CPU kernel at T tokens per expert: tiles (this tree) against the row buckets alone (the same
# source with the tile thresholds out of reach) and torch's bf16 matmul, per format, on this
# machine (docs/history/performance-log.md, issue 24). Run from the repository root after `make test`'s venv.
set -euo pipefail
for fmt in bf16 mxfp4 nvfp4; do
  .venv/bin/ftc compile model_specs/qwen3-30b-a3b.yaml --random-weights --target auto --override num_layers=1 \
    --quant $fmt -o /tmp/eng/q30-$fmt --force > /dev/null 2>&1
  rm -rf /tmp/eng/q30-$fmt-buckets && cp -r /tmp/eng/q30-$fmt /tmp/eng/q30-$fmt-buckets
  sed -i -E 's/TILE_MIN_AMX = [0-9]+, TILE_MIN_AVX512 = [0-9]+/TILE_MIN_AMX = 1 << 30, TILE_MIN_AVX512 = 1 << 30/' \
    /tmp/eng/q30-$fmt-buckets/kernels/expert_ffn_avx512_bf16.cpp
  .venv/bin/python -c "
from pathlib import Path; import tempfile
from ftc_runtime.kernel_build import build_kernels
e = Path('/tmp/eng/q30-$fmt-buckets')
build_kernels(e / 'kernels', e / 'lib', Path(tempfile.mkdtemp()))"
  for v in "" "-buckets"; do
    echo "== $fmt$v"
    .venv/bin/python bench/dev/cpu_batch_throughput.py /tmp/eng/q30-$fmt$v --tokens 1,8,16,32,64,128,256,512 --seconds 1
  done
done
