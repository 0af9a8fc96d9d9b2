"""How fast the plan's fill kernel (`experts/device/gather_fills.py`) moves expert rows from the pinned,
mapped host pool into device slots, against one `copy_` per row (the copy engines), on the GPU.

    python bench/dev/gather_fill_rate.py [--expert-bytes 2506752] [--fills 1,2,4,8]
        [--shapes 32x2048x4,64x2048x4]   # the kernel's programs per row x words per step x warps
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.testing

from ftc_runtime.experts.device.device_plan import LayerPlan
from ftc_runtime.experts.device.gather_fills import CHUNK, PARTS, gather_fills
from ftc_runtime.io.host_memory import MappedHost, mapped_address, pin_in_place


def timed(fn) -> float:
    """Median seconds of `fn` (CUDA events, after warm-up)."""
    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median") / 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--expert-bytes", type=int, default=2506752)
    ap.add_argument("--fills", default="1,2,4,8")
    ap.add_argument("--shapes", default=f"{PARTS}x{CHUNK}x4", help="PARTSxCHUNKxWARPS,... of the kernel")
    a = ap.parse_args()
    shapes = [tuple(int(v) for v in s.split("x")) for s in a.shapes.split(",")]
    rows = 256
    pool = torch.randint(0, 256, (rows, a.expert_bytes), dtype=torch.uint8)
    assert pin_in_place(pool), "the pool could not be pinned"
    mapped = MappedHost(mapped_address(pool, pool.data_ptr()))
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
        gb = q * a.expert_bytes / 1e9
        copy_s = timed(lambda ids=ids: [slots[j].copy_(pool[int(i)], non_blocking=True) for j, i in enumerate(ids)])
        print(f"{q} fills of {a.expert_bytes} bytes: copies {gb / copy_s:.2f} GB/s ({copy_s * 1e6:.1f} µs)", flush=True)
        for parts, chunk, warps in shapes:
            slots.zero_()
            kernel_s = timed(lambda plan=plan, p=parts, c=chunk, w=warps: gather_fills(mapped, slots, plan, p, c, w))
            assert torch.equal(slots[:q].cpu(), pool[ids]), f"kernel {parts}x{chunk}x{warps}: rows differ"
            print(f"  kernel {parts}x{chunk}x{warps}: {gb / kernel_s:.2f} GB/s ({kernel_s * 1e6:.1f} µs)", flush=True)


if __name__ == "__main__":
    main()
