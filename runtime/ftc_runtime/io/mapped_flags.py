"""Flags that a GPU and the host share through the device mapping of pinned host memory, as Triton
device functions: a release store and an acquire load (inline PTX), at "sys" scope for the host's
side and "gpu" scope between the programs of a kernel, and `wait_for_flag`.

Plain loads could be served from a stale line, and system-scope atomics would need PCIe atomics
from the host bridge.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def store_release(ptr, value, SCOPE: tl.constexpr):
    """*ptr = value (int64), every earlier write visible first at `SCOPE` ("sys": to the host)."""
    tl.inline_asm_elementwise("fence.acq_rel." + SCOPE + ";\nst.relaxed." + SCOPE + ".global.b64 [$1], $2;\n"
                              "mov.u32 $0, 0;", "=r,l,l", [ptr, value], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def load_acquire(ptr, SCOPE: tl.constexpr):
    """*ptr (int64), read past any stale line, later reads ordered after it at `SCOPE`."""
    return tl.inline_asm_elementwise("ld.acquire." + SCOPE + ".global.b64 $0, [$1];", "=l,l", [ptr],
                                     dtype=tl.int64, is_pure=False, pack=1)


@triton.jit
def wait_for_flag(flag, seq, status, SPINS: tl.constexpr):
    """Polls the host's `flag` until it reaches `seq` (jobs numbered from 1, increasing), at most
    SPINS looks: status[0] = 1 where they run out (left as it is otherwise: the host clears it),
    status[1] = whether it took more than one look (the host was the later side)."""
    seen = load_acquire(flag, "sys")
    spins = 0
    while (seen < seq) & (spins < SPINS):
        seen = load_acquire(flag, "sys")
        spins += 1
    if seen < seq:
        tl.store(status, 1)
    tl.store(status + 1, (spins > 0).to(tl.int64))
