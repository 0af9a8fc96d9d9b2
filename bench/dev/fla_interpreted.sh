#!/usr/bin/env bash
# flash-linear-attention's Triton kernels on a machine without a GPU, through Triton's interpreter
# (TRITON_INTERPRET=1: numpy, slow), to check runtime/ftc_runtime/models/layers/fla_delta_rule.py between device
# sessions: bench/dev/fla_interpreted_check.py against the torch recurrence, in fp16 (the
# interpreter keeps bf16 as raw 16-bit integers and multiplies those). Needs a package index once.
#   bash bench/dev/fla_interpreted.sh [FIRST_SEED LAST_SEED]
# Sets up /tmp/fla-interp: triton 3.6.0, fla-core 0.6.0 and einops, with three local patches for the
# interpreter (none ships): a tensor used as a loop bound is read as its one element; fla's
# `i_t.to(tl.int64)` on a loop counter (a Python int there) becomes `tl.cast`; autotuners take their
# first config (there is no benchmarker without a driver).
set -euo pipefail
site=/tmp/fla-interp
py=${PYTHON:-.venv/bin/python}
if [ ! -f $site/.ready ]; then
  "$py" -m pip install -q --target $site triton==3.6.0 fla-core==0.6.0 einops --no-deps
  sed -i 's/scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data))/scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))/' \
    $site/triton/runtime/interpreter.py
  sed -i 's/\bi_t\.to(tl\.int64)/tl.cast(i_t, tl.int64)/g' $site/fla/ops/common/chunk_delta_h.py
  cat > $site/fla_interp_patch.py <<'PY'
from triton.runtime import autotuner
autotuner.Autotuner.do_bench = property(lambda self: (lambda fn, quantiles: [0.0, 0.0, 0.0]))
PY
  touch $site/.ready
fi
TRITON_INTERPRET=1 PYTHONPATH=$site${PYTHONPATH:+:$PYTHONPATH} "$py" -W ignore bench/dev/fla_interpreted_check.py "${1:-0}" "${2:-24}"
