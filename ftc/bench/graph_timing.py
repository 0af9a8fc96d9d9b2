"""Time of a GPU call as a decode graph runs it: the call captured `calls` times in one CUDA graph,
the graph replayed, so that launches cost what they cost inside a graph and no host work shows."""

from __future__ import annotations

from collections.abc import Callable

import torch


def graph_us(fn: Callable[[], object], calls: int = 20, replays: int = 10) -> float:
    """µs per call of fn (after a warm-up call that compiles it)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / (replays * calls)
