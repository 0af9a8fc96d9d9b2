"""Whether programmatic dependent launch (PDL, Hopper and later) shortens a decode step's chain of
small dependent kernels: a chain of one-row GEMVs, each reading its own weight and, as its input,
the output of the kernel before it, captured as one CUDA graph and replayed. Per kernel µs:

- `plain`: no PDL (what the decode step's kernels are today);
- `wait_first`: launched with PDL, each kernel waiting for its predecessor (`gdc_wait`) before it
  reads anything, and letting its successor launch once it has read its input;
- `weights_first`: the same, but each kernel loads its weight rows before it waits: the weights do
  not depend on the kernel before, so their reads overlap its tail.

The three chains' outputs must be equal (the same arithmetic in the same order).

    python bench/dev/pdl_chain.py [--rows 2048,4096,128] [--cols 2048] [--kernels 96]
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl

from ftc.bench.graph_timing import graph_us

MODES = ("plain", "wait_first", "weights_first")
BLOCK_N = 2  # rows per program, as the decode step's GEMVs (`gemv_kernel.gemv_blocks`)


@triton.jit
def _chain_gemv(x, w, out, N, K: tl.constexpr, BLOCK_N: tl.constexpr, MODE: tl.constexpr):
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    kk = tl.arange(0, K)
    if MODE == 1:
        tl.extra.cuda.gdc_wait()
    wt = tl.load(w + n[:, None] * K + kk[None, :], mask=(n < N)[:, None], other=0.0)
    if MODE == 2:
        tl.extra.cuda.gdc_wait()
    xk = tl.load(x + kk).to(tl.float32)
    if MODE > 0:
        tl.extra.cuda.gdc_launch_dependents()
    y = tl.sum(wt.to(tl.float32) * xk[None, :], 1)
    tl.store(out + n, y.to(out.dtype.element_ty), mask=n < N)


def chain(mode: int, weights: list[torch.Tensor], bufs: list[torch.Tensor]) -> None:
    """Kernel i: bufs[i + 1][:N_i] = weights[i] · bufs[i][:K] (every buffer at least K long)."""
    k = weights[0].shape[1]
    for i, w in enumerate(weights):
        n = w.shape[0]
        _chain_gemv[(triton.cdiv(n, BLOCK_N),)](bufs[i], w, bufs[i + 1], n, K=k, BLOCK_N=BLOCK_N, MODE=mode,
                                                launch_pdl=mode > 0, num_warps=4)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="2048,4096,128", help="the weights' rows, repeated along the chain")
    ap.add_argument("--cols", type=int, default=2048)
    ap.add_argument("--kernels", type=int, default=96)
    a = ap.parse_args()
    rows = [int(r) for r in a.rows.split(",")]
    g = torch.Generator(device="cuda").manual_seed(0)
    weights = [torch.randn(rows[i % len(rows)], a.cols, generator=g, device="cuda", dtype=torch.bfloat16) / a.cols**0.5
               for i in range(a.kernels)]
    size = max(max(rows), a.cols)
    first = torch.randn(size, generator=g, device="cuda", dtype=torch.bfloat16)
    results = {}
    for mode, name in enumerate(MODES):
        bufs = [first] + [torch.zeros(size, device="cuda", dtype=torch.bfloat16) for _ in weights]
        us = graph_us(lambda mode=mode, bufs=bufs: chain(mode, weights, bufs), calls=1, replays=200) / len(weights)
        results[name] = bufs[-1].clone()
        mb = sum(w.numel() * 2 for w in weights) / len(weights) / 1e6
        print(f"{name:>14}: {us:.3f} µs per kernel ({mb:.2f} MB of weight each, {mb * 1e-3 / (us * 1e-6):.0f} GB/s)",
              flush=True)
    for name in MODES[1:]:
        assert torch.equal(results[name], results["plain"]), f"{name}: the chain's output differs from plain's"


if __name__ == "__main__":
    main()
