"""`ftc bench load ENGINE`: how fast an engine comes up, against the disk. The expert file's data
region is first read by one thread, sequentially, with O_DIRECT (the disk's own rate, nothing
cached), then loaded by the engine's loader (parallel direct reads into the final buffer, every
row's checksum checked), then the rest of the engine (dense weights, kernels, pinning) loads
around that pool. Both reads bypass the page cache where the filesystem allows, so their order
does not favour either."""

from __future__ import annotations

import time
from pathlib import Path

from ftc_runtime import Engine
from ftc_runtime.artifact import EngineManifest
from ftc_runtime.engine import OffloadConfig
from ftc_runtime.io import ftw
from ftc_runtime.io.direct_read import ReadResult, sequential_direct_read


def bench_load(engine_dir: Path, offload: OffloadConfig | None) -> dict:
    source = EngineManifest.read(engine_dir).experts_source()
    header, _ = ftw.read_header(source)
    n = header.data_bytes
    disk = _disk_rate(source, header)
    reads: list[ReadResult] = []
    t0 = time.perf_counter()
    pool = ftw.load(source, on_read=reads.append)
    t1 = time.perf_counter()
    Engine.load(engine_dir, offload=offload, pool=pool)
    t2 = time.perf_counter()
    read = reads[0]
    files = [str(source)] if isinstance(source, Path) else [str(p) for p in source.paths]
    return {"files": files, "bytes": n,
            "disk_s": round(disk.seconds, 4), "disk_gbps": round(disk.gbps(n), 3), "disk_direct": disk.direct,
            "read_s": round(read.seconds, 4), "read_gbps": round(read.gbps(n), 3), "read_direct": read.direct,
            "of_disk": round(read.gbps(n) / disk.gbps(n), 3) if disk.seconds > 0 else None,
            "verify_s": round(t1 - t0 - read.seconds, 4), "rest_of_engine_s": round(t2 - t1, 4),
            "total_s": round(t2 - t0, 4)}


def _disk_rate(source: ftw.FtwSource, header: ftw.FtwHeader) -> ReadResult:
    """The disk's own rate for the experts' bytes: each file's part read sequentially in turn,
    O_DIRECT where possible (`direct`: every part was)."""
    parts = [sequential_direct_read(path, offset, n) for path, offset, _, n in ftw.data_regions(source, header)]
    return ReadResult(sum(p.seconds for p in parts), all(p.direct for p in parts))
