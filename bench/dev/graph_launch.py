"""Host time of one CUDA graph launch, by what the graph holds and what the CPU does meanwhile.

Decode on the device spent 62-89 µs of host time per `cudaGraphLaunch` (docs/history/performance-log.md),
two launches per layer. This separates the suspects: the number of kernel nodes, memcpy nodes
to and from pinned host memory (a decode layer graph has both), and the CPU expert workers
streaming host memory on the other cores while the launching thread works.

    python bench/dev/graph_launch.py -o OUT_DIR [--replays 2000] [--load-procs 14]

Writes `graph_launch.jsonl` (one line per graph kind × CPU load) and prints a table.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import time
from pathlib import Path

import torch


def _stream_memory(cpu: int, stop: mp.Event) -> None:
    """One busy core reading a buffer far larger than the caches, as an expert worker does."""
    os.sched_setaffinity(0, {cpu})
    torch.set_num_threads(1)
    a = torch.ones(1 << 27)  # 512 MiB of fp32
    while not stop.is_set():
        a.sum()


def build(kind: str, nodes: int, dev: torch.device) -> tuple[torch.cuda.CUDAGraph, tuple]:
    """`nodes` small elementwise kernels; `memcpy`: also one pinned host→device and one
    device→host copy of 8 KiB, as a decode layer graph has."""
    x = torch.zeros(2048, device=dev)
    host_in = torch.zeros(2048, pin_memory=True)
    host_out = torch.zeros(2048, pin_memory=True)
    staging = torch.zeros(2048, device=dev)

    def work() -> None:
        if kind == "memcpy":
            staging.copy_(host_in, non_blocking=True)
            x.add_(staging)
        for _ in range(nodes):
            x.mul_(1.0001)
        if kind == "memcpy":
            host_out.copy_(x, non_blocking=True)

    work()  # warm up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        work()
    return graph, (x, host_in, host_out, staging)  # the graph holds their addresses: keep them


def launch_us(graph: torch.cuda.CUDAGraph, replays: int) -> dict:
    """Host µs per replay() call and per launch-then-synchronize round, as decode does them."""
    stream = torch.cuda.current_stream()
    launch, rounds = [], []
    for _ in range(replays):
        t0 = time.perf_counter()
        graph.replay()
        t1 = time.perf_counter()
        stream.synchronize()
        launch.append(t1 - t0)
        rounds.append(time.perf_counter() - t0)
    return {"launch_us_median": round(1e6 * statistics.median(launch), 2),
            "launch_us_mean": round(1e6 * statistics.fmean(launch), 2),
            "round_us_median": round(1e6 * statistics.median(rounds), 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-o", "--output", type=Path, required=True)
    ap.add_argument("--replays", type=int, default=2000)
    ap.add_argument("--load-procs", type=int, default=max(1, (os.cpu_count() or 2) - 2))
    a = ap.parse_args()
    a.output.mkdir(parents=True, exist_ok=True)
    dev = torch.device("cuda")
    graphs = {(kind, n): build(kind, n, dev) for kind in ("kernels", "memcpy") for n in (4, 16, 48)}
    cpus = sorted(os.sched_getaffinity(0))
    for load in ("idle", "busy"):
        stop, procs = mp.Event(), []
        if load == "busy":  # the expert workers' cores: all but the first two
            ctx = mp.get_context("spawn")
            stop = ctx.Event()
            procs = [ctx.Process(target=_stream_memory, args=(cpu, stop)) for cpu in cpus[2:2 + a.load_procs]]
            for p in procs:
                p.start()
            time.sleep(10.0)  # each process imports torch and allocates before it streams
        for (kind, n), (graph, _) in graphs.items():
            r = {"graph": kind, "kernel_nodes": n, "cpu": load, "load_procs": len(procs)} | launch_us(graph, a.replays)
            with open(a.output / "graph_launch.jsonl", "a") as f:
                f.write(json.dumps(r) + "\n")
            print(f"{load:<5} {kind:<8} {n:>3} nodes  launch {r['launch_us_median']:>8} µs (mean "
                  f"{r['launch_us_mean']})  launch+sync {r['round_us_median']:>8} µs", flush=True)
        stop.set()
        for p in procs:
            p.join()


if __name__ == "__main__":
    main()
