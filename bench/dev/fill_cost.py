"""Host time to queue one expert fill (a host→device copy of one pinned FTW row into a slot), by
the way it is queued: torch's `copy_` (what `SlotStore.copy_rows_now` does), the same inside the
CUDA-event timer the offload stats wrap it in, and a direct `cudaMemcpyAsync` through ctypes.

    python bench/dev/fill_cost.py [--row-bytes 2506752] [--rows 512] [--fills 4000]
"""

from __future__ import annotations

import argparse
import ctypes
import random
import time

import torch

from ftc_runtime.experts.stats import _Timer
from ftc_runtime.io.host_memory import _cudart, pin_in_place


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--row-bytes", type=int, default=2506752)  # one qwen3-30b-a3b mxfp4 expert
    ap.add_argument("--rows", type=int, default=512)
    ap.add_argument("--slots", type=int, default=64)
    ap.add_argument("--fills", type=int, default=4000)
    a = ap.parse_args()
    host = torch.empty(a.rows, a.row_bytes, dtype=torch.uint8)
    host.fill_(1)
    assert pin_in_place(host)
    slots = torch.empty(a.slots, a.row_bytes, dtype=torch.uint8, device="cuda")
    rng = random.Random(0)
    pairs = [(rng.randrange(a.slots), rng.randrange(a.rows)) for _ in range(a.fills)]
    cudart = _cudart()
    cudart.cudaMemcpyAsync.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                                       ctypes.c_void_p]
    timer = _Timer(torch.device("cuda"))

    def torch_copy(s: int, i: int) -> None:
        slots[s:s + 1].copy_(host[i:i + 1], non_blocking=True)

    def timed_copy(s: int, i: int) -> None:
        with timer.measure():
            slots[s:s + 1].copy_(host[i:i + 1], non_blocking=True)

    def raw_copy(s: int, i: int) -> None:
        stream = torch.cuda.current_stream().cuda_stream
        cudart.cudaMemcpyAsync(slots[s].data_ptr(), host[i].data_ptr(), a.row_bytes, 1, stream)

    for name, fn in (("torch copy_", torch_copy), ("copy_ in the stats timer", timed_copy),
                     ("cudaMemcpyAsync (ctypes)", raw_copy)):
        host_s = 0.0
        torch.cuda.synchronize()
        t_all = time.perf_counter()
        for j in range(0, a.fills, 4):  # a decode layer's few fills, then the device catches up
            t0 = time.perf_counter()
            for s, i in pairs[j:j + 4]:
                fn(s, i)
            host_s += time.perf_counter() - t0
            torch.cuda.synchronize()
        wall = time.perf_counter() - t_all
        print(f"{name:<28} {host_s / a.fills * 1e6:8.2f} µs host per fill, "
              f"{a.fills * a.row_bytes / wall / 1e9:6.2f} GB/s with the syncs", flush=True)


if __name__ == "__main__":
    main()
