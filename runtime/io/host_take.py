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
from ftc_runtime.io.mapped_flags import wait_relayed

BLOCK = 4096  # fp32 values per program: enough loads in flight over PCIe
# Programs of a signaled take, each over every PROGRAMS-th block: few enough that all of them are
# resident at once, since the others spin until program 0 relays the flag
PROGRAMS = 128
SPINS = 1 << 26  # looks at the flag before the take gives up (each crosses PCIe: tens of seconds)


@triton.jit
def _take(out, src, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(out + offs, tl.load(out + offs, mask=mask) + tl.load(src + offs, mask=mask), mask=mask)
    tl.store(src + offs, tl.zeros([BLOCK], dtype=tl.float32), mask=mask)


@triton.jit(do_not_specialize=["seq"])  # a value, not a constant: the kernel waits on it
def _take_when_signaled(out, src, n, flag, seq, relay, status, SPINS: tl.constexpr, BLOCK: tl.constexpr):
    reached, waited = wait_relayed(flag, relay, seq, status, SPINS)
    if tl.program_id(0) == 0:
        tl.store(status + 1, waited.to(tl.int64))
    if reached:
        for block in range(tl.program_id(0), tl.cdiv(n, BLOCK), tl.num_programs(0)):
            offs = block.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
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


def signal_relay(device: torch.device | str) -> torch.Tensor:
    """The device memory through which a signaled take's programs learn the flag's answer:
    [the last job relayed, whether its flag was reached] (jobs numbered from 1)."""
    return torch.zeros(2, dtype=torch.int64, device=device)


def take_when_signaled(out: torch.Tensor, host: torch.Tensor, flag: torch.Tensor, seq: int, relay: torch.Tensor,
                       status: torch.Tensor, spins: int = SPINS) -> None:
    """Queues: once flag[0] (int64, pinned) reaches `seq`, out (fp32, contiguous, on the device)
    += host (pinned fp32 of out's shape, read through its mapping), host = 0. Where the flag
    does not get there within `spins` looks, out is left alone and status[0] (int64, on the
    device) = 1: the caller checks it at a safe point; status[1] = whether the device had to
    wait for the flag. `relay` from `signal_relay`, one per sequence of jobs."""
    if host.shape != out.shape or host.dtype != torch.float32 or not host.is_contiguous() \
            or out.dtype != torch.float32 or not out.is_contiguous():
        raise ValueError(f"take_when_signaled: host {tuple(host.shape)} {host.dtype} for out {tuple(out.shape)} "
                         f"{out.dtype} (both contiguous fp32)")
    src, flag_address = mapped_address(host, host.data_ptr()), mapped_address(flag, flag.data_ptr())
    if src is None or flag_address is None:
        raise ValueError("take_when_signaled: the buffer and the flag must be pinned host memory the device maps")
    n = out.numel()
    _take_when_signaled[(max(1, min(PROGRAMS, triton.cdiv(n, BLOCK))),)](
        out, MappedHost(src, torch.float32), n, MappedHost(flag_address, torch.int64), seq, relay, status,
        SPINS=spins, BLOCK=BLOCK)
