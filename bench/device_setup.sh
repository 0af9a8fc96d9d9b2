# Sourced by the bench/device_*.sh scripts of several parts with their arguments (OUT_DIR PART) on
# the device machine, where there is no package registry: sets `out` and `part` (a part number or
# a list of stages), makes the output folder, installs the wheels carried in .whl/ (fla-core,
# einops) into /tmp/site and the project.
set -uo pipefail
out=${1:?output directory}
part=${2:?part or stages}
mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -2
