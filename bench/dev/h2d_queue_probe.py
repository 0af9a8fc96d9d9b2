"""Does a small host→device copy wait behind a large one queued before it on another stream?

A streamed prompt layer queues the next layer's expert copies (about 1 GB) on a copy stream, then
small host→device copies on the compute stream that the layer needs at once (its slot table, the
CPU part's result). This probe queues a large copy on one stream, then on another stream a small
copy, or a kernel that reads the same bytes through the host buffer's device mapping
(`io/host_take.py`), and prints when each finished after the large copy started (CUDA events), in ms.

    python bench/dev/h2d_queue_probe.py [--large-mb 1024] [--small-mb 16] [--reps 5]
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from ftc_runtime.io.host_take import take_from_host


def timed_pair(large: tuple[torch.Tensor, torch.Tensor], small: tuple[torch.Tensor, torch.Tensor], how: str
               ) -> tuple[float, float]:
    """(ms to the large copy's end, ms to the small one's end), both from the large copy's start."""
    copy_stream, main = torch.cuda.Stream(), torch.cuda.current_stream()
    start, large_done, small_done = (torch.cuda.Event(enable_timing=True) for _ in range(3))
    torch.cuda.synchronize()
    with torch.cuda.stream(copy_stream):
        start.record()
        large[1].copy_(large[0], non_blocking=True)
        large_done.record()
    main.wait_event(start)
    host, dev = small
    if how == "copy":
        dev.copy_(host, non_blocking=True)
    elif how == "mapped":
        take_from_host(dev, host)
    else:  # "d2h": the other direction, for comparison
        host.copy_(dev, non_blocking=True)
    small_done.record(main)
    torch.cuda.synchronize()
    return start.elapsed_time(large_done), start.elapsed_time(small_done)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--large-mb", type=int, default=1024)
    ap.add_argument("--small-mb", type=float, default=16)
    ap.add_argument("--reps", type=int, default=5)
    a = ap.parse_args()
    large = (torch.empty(a.large_mb << 20, dtype=torch.uint8, pin_memory=True),
             torch.empty(a.large_mb << 20, dtype=torch.uint8, device="cuda"))
    n = int(a.small_mb * (1 << 20)) // 4
    small = (torch.randn(n).pin_memory(), torch.zeros(n, device="cuda"))
    rows = {}
    for how in ("copy", "mapped", "d2h"):
        timed_pair(large, small, how)  # warm-up
        runs = [timed_pair(large, small, how) for _ in range(a.reps)]
        rows[how] = {"large_end_ms": round(statistics.median(r[0] for r in runs), 3),
                     "small_end_ms": round(statistics.median(r[1] for r in runs), 3)}
    alone = [timed_pair((large[0][:0], large[1][:0]), small, "copy")[1] for _ in range(a.reps)]
    rows["copy_alone"] = {"small_end_ms": round(statistics.median(alone), 3)}
    print(json.dumps({"large_mb": a.large_mb, "small_mb": a.small_mb, **rows}, indent=1))


if __name__ == "__main__":
    main()
