"""`add_from_host`: out += a pinned host tensor, on the device, read by a kernel over PCIe through
the host memory's device mapping, not copied by a copy engine.

A host→device copy is carried out after the copies queued before it on the same copy engine, from
any stream (`bench/dev/h2d_queue_probe.py` measures it). A streamed layer's CPU result, which the
next layer's input needs at once, would wait there behind the copies of the layers ahead, queued
earlier so that they overlap this one. A kernel's loads share the link with those copies instead.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ftc_runtime.io.host_memory import MappedHost, mapped_address

BLOCK = 4096  # fp32 values per program: enough loads in flight over PCIe


@triton.jit
def _add(out, src, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(out + offs, tl.load(out + offs, mask=mask) + tl.load(src + offs, mask=mask), mask=mask)


def add_mapped(out: torch.Tensor, src: MappedHost | torch.Tensor) -> None:
    """out (contiguous fp32, on the device) += src, as many fp32 values from `src` (a mapped host
    address, or a tensor the kernel can read)."""
    if out.dtype != torch.float32 or not out.is_contiguous():
        raise ValueError(f"add_mapped: out must be contiguous fp32, got {out.dtype} of stride {out.stride()}")
    n = out.numel()
    if n:
        _add[(triton.cdiv(n, BLOCK),)](out, src, n, BLOCK=BLOCK)


def add_from_host(out: torch.Tensor, host: torch.Tensor) -> None:
    """out (fp32, on the device) += host (fp32, pinned, of out's shape): through the mapping where
    the host memory has one, else by a copy."""
    if host.shape != out.shape or host.dtype != torch.float32 or not host.is_contiguous():
        raise ValueError(f"add_from_host: host {tuple(host.shape)} {host.dtype} for out {tuple(out.shape)}")
    address = mapped_address(host, host.data_ptr()) if host.is_pinned() and out.is_contiguous() else None
    if address is None:
        out += host.to(out.device, non_blocking=True)
    else:
        add_mapped(out, MappedHost(address, torch.float32))
