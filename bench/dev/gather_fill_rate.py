"""How fast the plan's fill kernel (`decode/gather_fills.py`) moves expert rows from the pinned,
mapped host pool into device slots, against one `copy_` per row (the copy engines), on the GPU.

    python bench/dev/gather_fill_rate.py [--expert-bytes 2506752] [--fills 1,2,4,8]
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.testing

from ftc_runtime.decode.device_plan import LayerPlan
from ftc_runtime.decode.gather_fills import MappedRows, gather_fills
from ftc_runtime.io.host_memory import mapped_address, pin_in_place


def timed(fn) -> float:
    """Median seconds of `fn` (CUDA events, after warm-up)."""
    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median") / 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--expert-bytes", type=int, default=2506752)
    ap.add_argument("--fills", default="1,2,4,8")
    a = ap.parse_args()
    rows = 256
    pool = torch.randint(0, 256, (rows, a.expert_bytes), dtype=torch.uint8)
    assert pin_in_place(pool), "the pool could not be pinned"
    mapped = MappedRows(mapped_address(pool, pool.data_ptr()))
    slots = torch.empty(16, a.expert_bytes, dtype=torch.uint8, device="cuda")
    for q in (int(x) for x in a.fills.split(",")):
        ids = torch.randperm(rows)[:q]
        n = 16
        fill_rows = torch.full((n,), -1, dtype=torch.long)
        fill_rows[:q] = ids
        fill_slots = torch.full((n,), -1, dtype=torch.long)
        fill_slots[:q] = torch.arange(q)
        unused = torch.zeros(n, dtype=torch.long, device="cuda")
        plan = LayerPlan(unused.view(2, 8), fill_rows.cuda(), fill_slots.cuda(), unused, unused, unused,
                         unused.float(), torch.tensor([0, q, 0], device="cuda"), unused.int().expand(3, n),
                         unused.int().expand(2, 3, n))
        kernel_s = timed(lambda plan=plan: gather_fills(mapped, slots, plan))
        copy_s = timed(lambda ids=ids: [slots[j].copy_(pool[int(i)], non_blocking=True) for j, i in enumerate(ids)])
        gb = q * a.expert_bytes / 1e9
        print(f"{q} fills of {a.expert_bytes} bytes: kernel {gb / kernel_s:.2f} GB/s ({kernel_s * 1e6:.1f} µs), "
              f"copies {gb / copy_s:.2f} GB/s ({copy_s * 1e6:.1f} µs)", flush=True)


if __name__ == "__main__":
    main()
