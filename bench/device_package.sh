#!/usr/bin/env bash
# Issue 23 on the device: the qwen3-30b-a3b bf16 engine (random weights, 58 GB of experts on disk)
# packaged into 48 GB shards, then loaded from the package: its read rate against the disk's own
# sequential O_DIRECT rate over the same shards, measured in the same run (`ftc bench load`), and
# the single-file engine's beside it. The engine and its package need 2 x 58 GB of disk: run it on
# nvidia-h200-x2 (128 GiB of disk; nvidia-h200 has 64).
#   bash bench/device_package.sh OUT_DIR
source bench/device_setup.sh "$1" package
engine=/tmp/ftc-package/qwen3-30b-a3b
package=/tmp/ftc-package/qwen3-30b-a3b-ftc
df -h /tmp | tail -1
[[ -f $engine/engine.json ]] ||
  ftc compile model_specs/qwen3-30b-a3b.yaml --random-weights --target h200 -o "$engine" 2>&1 | grep -v "━" | tail -n 2
rm -rf "$package"
/usr/bin/time -f "package: %e s" ftc package "$engine" -o "$package" --shard-size 48GB 2>&1 | grep -v "━" | tail -n 3
ls -l "$package"
ftc bench load "$package" --device cuda -o "$out/load_package.json" 2>&1 | grep -v "━" | tail -n 12
ftc bench load "$engine" --device cuda -o "$out/load_engine.json" 2>&1 | grep -v "━" | tail -n 12
