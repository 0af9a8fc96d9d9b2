#!/usr/bin/env bash
# Every GPU test on the device (pytest -m gpu), flash-linear-attention included: put the fla_core
# wheel in .whl/ here (ignored by git) and name .whl in the call's carry. The log lands in OUT_DIR.
#   bash bench/device_gpu_tests.sh OUT_DIR [PYTEST_ARGS...]
set -euo pipefail
out=${1:?output directory}
shift
if ls .whl/fla_core-*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/fla_core-*.whl
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
mkdir -p "$out"
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -2
# -v: every test's name and outcome as it ends, so a log cut off by the call's time limit still names a failure.
python3 -m pytest -v -p no:cacheprovider -m gpu tests "$@" 2>&1 | tee "$out/pytest_gpu.txt" | grep -v " PASSED\| SKIPPED" | tail -40
