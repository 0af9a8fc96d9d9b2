#!/usr/bin/env bash
# Issue 23 on the device: the qwen3-30b-a3b bf16 engine (random weights, 58 GB of experts)
# packaged into 48 GB shards on disk, then loaded from the package: its read rate against the
# disk's own sequential O_DIRECT rate over the same shards, measured in the same run (`ftc bench
# load`). The engine and its package take 2 x 58 GB: where the disk cannot hold both (one H200's
# machine has 64 GiB of disk), the engine is compiled into /dev/shm (64 GiB, half the RAM) and
# removed once packaged, before the package's 58 GB pool is loaded into memory.
#   bash bench/device_package.sh OUT_DIR
source bench/device_setup.sh "$1" package
package=/tmp/ftc-package/qwen3-30b-a3b-ftc
need=$((2 * 60 * 10**9))
engine_root=/tmp/ftc-package
(( $(df -B1 --output=avail /tmp | tail -1) > need )) || engine_root=/dev/shm/ftc-package
engine=$engine_root/qwen3-30b-a3b
df -h /tmp /dev/shm | tail -2
mkdir -p /tmp/ftc-package
[[ -f $engine/engine.json ]] ||
  ftc compile model_specs/qwen3-30b-a3b.yaml --random-weights --target h200 -o "$engine" 2>&1 | grep -v "━" | tail -n 2
rm -rf "$package"
/usr/bin/time -f "package: %e s" ftc package "$engine" -o "$package" --shard-size 48GB 2>&1 | grep -v "━" | tail -n 3
ls -l "$package"
[[ $engine_root == /dev/shm/* ]] && rm -rf "$engine_root"
ftc bench load "$package" --device cuda -o "$out/load_package.json" 2>&1 | grep -v "━" | tail -n 12
