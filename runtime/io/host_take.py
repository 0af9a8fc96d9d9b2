"""`take_from_host`: out += a pinned host buffer, which is left zeroed, on the device: a kernel reads
the buffer over PCIe through its device mapping and writes zeros back, with no copy engine.

A host→device copy is carried out after the copies queued before it on the same copy engine, from
any stream (`bench/dev/h2d_queue_probe.py`: 16 MB queued behind 1 GB ended at 19.8 ms, read
through the mapping at 0.5 ms). A streamed layer's CPU result, which the next layer's input needs
at once, would wait there behind the copies of the layers ahead, queued earlier so that they
overlap this one; a kernel's loads share the link with them instead. Zeroing the buffer on the
way (the CPU kernel accumulates into it) costs the link's other direction, not the host's time
between two layers, where the host is what the layers wait for.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ftc_runtime.io.host_memory import MappedHost, mapped_address

BLOCK = 4096  # fp32 values per program: enough loads in flight over PCIe


@triton.jit
def _take(out, src, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(out + offs, tl.load(out + offs, mask=mask) + tl.load(src + offs, mask=mask), mask=mask)
    tl.store(src + offs, tl.zeros([BLOCK], dtype=tl.float32), mask=mask)


def take_mapped(out: torch.Tensor, src: MappedHost | torch.Tensor) -> None:
    """out (contiguous fp32, on the device) += src, then src = 0, over out's number of fp32 values
    (`src` a mapped host address, or a tensor the kernel can read and write)."""
    if out.dtype != torch.float32 or not out.is_contiguous():
        raise ValueError(f"take_mapped: out must be contiguous fp32, got {out.dtype} of stride {out.stride()}")
    n = out.numel()
    if n:
        _take[(triton.cdiv(n, BLOCK),)](out, src, n, BLOCK=BLOCK)


def take_from_host(out: torch.Tensor, host: torch.Tensor) -> None:
    """out (fp32, on the device) += host (fp32, contiguous, of out's shape), host = 0 once the
    device gets there: through the mapping where pinned host memory has one, else by a copy up
    and a zero on the host (the host waits for that copy)."""
    if host.shape != out.shape or host.dtype != torch.float32 or not host.is_contiguous():
        raise ValueError(f"take_from_host: host {tuple(host.shape)} {host.dtype} for out {tuple(out.shape)}")
    address = mapped_address(host, host.data_ptr()) if host.is_pinned() and out.is_contiguous() else None
    if address is None:
        out += host.to(out.device)
        host.zero_()
    else:
        take_mapped(out, MappedHost(address, torch.float32))
