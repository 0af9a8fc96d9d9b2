"""Reading a file region straight into its final host buffer: page-aligned buffers, parallel
`pread`s (they release the GIL) with O_DIRECT where the filesystem takes it, so that the bytes go
from the disk to the buffer without the page cache's copy; buffered reads where it does not.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

PAGE = 4096  # O_DIRECT's alignment for addresses, offsets and lengths on common filesystems
PIECE = 32 << 20  # bytes per read: enough in flight per thread, many pieces to balance threads


def aligned_empty(n: int) -> torch.Tensor:
    """An uninitialized uint8 host tensor of n bytes whose first byte is page-aligned (a view of
    a slightly larger allocation, which it keeps alive)."""
    raw = torch.empty(n + PAGE, dtype=torch.uint8)
    skip = -raw.data_ptr() % PAGE
    return raw[skip:skip + n]


@dataclass(frozen=True)
class ReadResult:
    seconds: float
    direct: bool  # O_DIRECT was used

    def gbps(self, n: int) -> float:
        return n / self.seconds / 1e9 if self.seconds > 0 else 0.0


def read_into(path: Path, offset: int, buffer: torch.Tensor, threads: int | None = None, direct: bool = True,
              on_bytes: Callable[[int], None] | None = None) -> ReadResult:
    """Fills `buffer` (page-aligned, as `aligned_empty` makes) with `buffer.numel()` bytes of the file
    from `offset`, in parallel; with `direct`, through O_DIRECT when the offset, the length and
    the filesystem allow it. Raises EOFError(path, why) when the file ends first."""
    return read_regions([(path, offset, buffer)], threads, direct, on_bytes)


def read_regions(regions: list[tuple[Path, int, torch.Tensor]], threads: int | None = None, direct: bool = True,
                 on_bytes: Callable[[int], None] | None = None) -> ReadResult:
    """`read_into` of several (file, offset, buffer) regions at once, their pieces on one pool of
    threads (the shards of one file on one disk, or several). `direct` in the result: every
    region was read with O_DIRECT."""
    fds = []
    try:
        for path, offset, buffer in regions:
            aligned = offset % PAGE == 0 and buffer.numel() % PAGE == 0 and buffer.data_ptr() % PAGE == 0
            fds.append(_open(path, direct and aligned))
        pieces = [(r, a, min(PIECE, buffer.numel() - a)) for r, (_, _, buffer) in enumerate(regions)
                  for a in range(0, buffer.numel(), PIECE)]
        views = [memoryview(buffer.numpy()) for _, _, buffer in regions]

        def read(piece: tuple[int, int, int]) -> None:
            r, a, length = piece
            path, offset, _ = regions[r]
            done = 0
            while done < length:
                got = os.preadv(fds[r][0], [views[r][a + done:a + length]], offset + a + done)
                if got == 0:
                    raise EOFError(path, f"ends at byte {offset + a + done}, before the {offset + views[r].nbytes} "
                                         "bytes its header describes")
                done += got
            if on_bytes:
                on_bytes(length)

        t0 = time.perf_counter()
        with ThreadPoolExecutor(max_workers=threads or min(8, os.cpu_count() or 1)) as ex:
            for _ in ex.map(read, pieces):
                pass
        return ReadResult(time.perf_counter() - t0, all(used for _, used in fds))
    finally:
        for fd, _ in fds:
            os.close(fd)


def sequential_direct_read(path: Path, offset: int, n: int) -> ReadResult:
    """The disk's own rate for the same bytes: one thread, sequential, O_DIRECT where possible,
    into one reused page-aligned piece (nothing kept)."""
    piece = aligned_empty(min(PIECE, n))
    view = memoryview(piece.numpy())
    aligned = offset % PAGE == 0 and n % PAGE == 0
    fd, used_direct = _open(path, aligned)
    t0 = time.perf_counter()
    try:
        a = 0
        while a < n:
            got = os.preadv(fd, [view[:min(PIECE, n - a)]], offset + a)
            if got == 0:
                raise EOFError(f"{path.name}: ends at byte {offset + a}")
            a += got
    finally:
        os.close(fd)
    return ReadResult(time.perf_counter() - t0, used_direct)


def _open(path: Path, direct: bool) -> tuple[int, bool]:
    """The file opened for reading, with O_DIRECT when asked and the filesystem accepts it
    (tmpfs and some overlays refuse it)."""
    if direct and hasattr(os, "O_DIRECT"):
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        except OSError:
            pass
        else:
            # Some filesystems accept the flag at open and refuse the reads: try one page.
            probe = aligned_empty(PAGE)
            try:
                os.preadv(fd, [memoryview(probe.numpy())], 0)
                return fd, True
            except OSError:
                os.close(fd)
    return os.open(path, os.O_RDONLY), False
