"""`take_from_host`: out += a pinned host buffer, which is left zeroed, on the device: a kernel reads
the buffer over PCIe through its device mapping and writes zeros back, with no copy engine.
`take_when_signaled` does so once a flag in pinned memory says the host's producer (the CPU
kernel's pool, `CpuExpertKernel.start_signaled`) is done with the buffer: the device waits for
it, not the host, which queues the next layers meanwhile.

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
from ftc_runtime.io.mapped_flags import wait_for_flag

BLOCK = 4096  # fp32 values per program: enough loads in flight over PCIe
SPINS = 1 << 26  # looks at the flag before the take gives up (each crosses PCIe: tens of seconds)


@triton.jit
def _add_block(out, src, n, BLOCK: tl.constexpr, VOLATILE: tl.constexpr):
    """out += src, src = 0 over the program's block; with VOLATILE src's loads skip any cached
    line (the host wrote it after the launch was queued), at the cost of vector loads."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    y = tl.load(src + offs, mask=mask, volatile=VOLATILE)
    tl.store(out + offs, tl.load(out + offs, mask=mask) + y, mask=mask)
    tl.store(src + offs, tl.zeros([BLOCK], dtype=tl.float32), mask=mask)


@triton.jit
def _take(out, src, n, BLOCK: tl.constexpr):
    _add_block(out, src, n, BLOCK, False)


@triton.jit(do_not_specialize=["seq"])  # a value, not a constant: the kernel waits on it
def _wait(flag, seq, status, SPINS: tl.constexpr):
    wait_for_flag(flag, seq, status, SPINS)


@triton.jit
def _take_unless_given_up(out, src, n, status, BLOCK: tl.constexpr):
    """`_take` after a wait, skipped where a wait gave up (the buffer may be half written)."""
    if tl.load(status) == 0:
        _add_block(out, src, n, BLOCK, True)


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


def take_when_signaled(out: torch.Tensor, host: torch.Tensor, flag: torch.Tensor, seq: int, status: torch.Tensor,
                       spins: int = SPINS) -> None:
    """Queues: once flag[0] (int64, pinned) reaches `seq`, out (fp32, contiguous, on the device)
    += host (pinned fp32 of out's shape, read through its mapping), host = 0. Where the flag
    does not get there within `spins` looks, out is left alone and status[0] (int64, on the
    device) = 1, and later takes are skipped too until the caller, which checks it at a safe
    point, clears it; status[1] = whether the device had to wait for the flag. Two kernels: one
    program waits, then the take's programs run (none of them spins waiting for another). CUDA
    loads a kernel at its first launch, and that load may wait for the kernels running (CUDA's
    lazy loading): the first take's launch may return only once the flag is raised, so the flag's
    producer must not be this thread (the CPU kernel's pool raises it on its own)."""
    if host.shape != out.shape or host.dtype != torch.float32 or not host.is_contiguous():
        raise ValueError(f"take_when_signaled: host {tuple(host.shape)} {host.dtype} for out {tuple(out.shape)}")
    take_mapped_when_signaled(out, MappedHost.of(host), MappedHost.of(flag), seq, status, spins)


def take_mapped_when_signaled(out: torch.Tensor, src: MappedHost | torch.Tensor, flag: MappedHost | torch.Tensor,
                              seq: int, status: torch.Tensor, spins: int = SPINS) -> None:
    """`take_when_signaled` over out's number of fp32 values, `src` and `flag` mapped host
    addresses or tensors the kernels can read and write."""
    if out.dtype != torch.float32 or not out.is_contiguous():
        raise ValueError(f"take_when_signaled: out must be contiguous fp32, got {out.dtype} of stride {out.stride()}")
    _wait[(1,)](flag, seq, status, SPINS=spins)
    n = out.numel()
    if n:
        _take_unless_given_up[(triton.cdiv(n, BLOCK),)](out, src, n, status, BLOCK=BLOCK)
