"""Flags that a GPU and the host share through the device mapping of pinned host memory, as Triton
device functions: a release store and an acquire load (inline PTX), at "sys" scope for the host's
side and "gpu" scope between programs, and `wait_relayed`, where one program of a kernel polls
the host's flag and relays its answer to the others through device memory.

Plain loads could be served from a stale line, and system-scope atomics would need PCIe atomics
from the host bridge; one poller, because every program polling the mapped flag across PCIe
slows the kernel (docs/performance.md, the decode join).
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
def wait_relayed(flag, relay, seq, status, SPINS: tl.constexpr):
    """(Whether the host's `flag` reached `seq`, whether program 0 had to look more than once: the
    host was the later side; False in the other programs). Jobs are numbered from 1, increasing.
    Program 0 polls the flag, up to SPINS looks, sets status[0] = 1 where they run out, and relays
    the answer (relay[1]: reached, relay[0]: seq) in device memory; the other programs wait for
    the relay. The host's writes before its release of the flag are visible to every program
    after it."""
    reached = seq >= 0
    waited = seq < 0
    if tl.program_id(0) == 0:
        seen = load_acquire(flag, "sys")
        spins = 0
        while (seen < seq) & (spins < SPINS):
            seen = load_acquire(flag, "sys")
            spins += 1
        reached = seen >= seq
        waited = spins > 0
        if seen < seq:
            tl.store(status, 1)
        tl.store(relay + 1, reached.to(tl.int64))
        tl.debug_barrier()  # the answer's store before the relay's release
        store_release(relay, seq, "gpu")
    else:
        relayed = load_acquire(relay, "gpu")
        spins = 0
        while (relayed < seq) & (spins < SPINS):
            relayed = load_acquire(relay, "gpu")
            spins += 1
        reached = (relayed >= seq) & (tl.load(relay + 1) != 0)
    return reached, waited
