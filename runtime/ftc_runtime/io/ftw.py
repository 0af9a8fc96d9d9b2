"""FTW, the routed-expert weight file, and the host pool it is loaded into.

Layout (version 3):

    b"FTW1" | u64 LE header length | JSON header | pad to 4096 | experts | checksum trailer (JSON)

The header names the experts' format (`ftc_runtime.formats`) and shapes; the format gives the
banks. An expert is several tensors; each tensor kind is a *bank* (bf16: `gate_up` [2I, H] with
the gate rows first, `down` [H, I]; block-scaled formats add banks of scales). Row `id = l·E + e`
of every bank is expert `e` of MoE layer `l`. The rows of one expert lie together (expert-major):
expert `id` starts at `data_offset + id·expert_stride`, each of its rows padded to 4096 bytes. So
the file is written in one sequential pass (its sha256 is computed on the way), a GPU fill of one
expert is one contiguous copy, and O_DIRECT can read the data region straight into the final host
buffer. The trailer holds a CRC-32 for every row, so corruption is reported as the exact bank,
layer and expert.

A packaged engine stores the same bytes in several files (`FtwShards`: consecutive byte ranges,
cut at expert boundaries, so that every shard's experts still start on a 4096-byte boundary of
its file and read with O_DIRECT): the header in the first, the trailer in the last. Every reader
here takes either one path or the shards (`FtwSource`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import os
import struct
import zlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import torch

from ftc_runtime import formats
from ftc_runtime.formats.base import BankLayout, ExpertFormat
from ftc_runtime.io.direct_read import ReadResult, aligned_empty, read_regions

MAGIC = b"FTW1"
VERSION = 3
ALIGN = 4096
PREFIX = struct.Struct("<4sQ")
HEADER_ROOM = 4096  # magic, length and JSON header; the first expert starts here


class FtwError(ValueError):
    """The FTW file is missing, truncated, corrupted or of another version; the message says which."""


def _positive_int(n: object) -> bool:
    return isinstance(n, int) and not isinstance(n, bool) and n > 0


def round_up(n: int, align: int = ALIGN) -> int:
    return (n + align - 1) // align * align


@dataclass(frozen=True)
class FtwShards:
    """One FTW file's bytes as consecutive files: `paths[i]` holds `sizes[i]` bytes from
    `starts[i]` on."""

    paths: tuple[Path, ...]
    sizes: tuple[int, ...]

    @property
    def starts(self) -> tuple[int, ...]:
        return tuple(itertools.accumulate(self.sizes[:-1], initial=0))

    @property
    def size(self) -> int:
        return sum(self.sizes)

    def file_at(self, offset: int) -> Path:
        """The shard that holds byte `offset` of the whole."""
        for path, start, n in zip(self.paths, self.starts, self.sizes, strict=True):
            if offset < start + n:
                return path
        return self.paths[-1]

    def check_cuts(self, header: FtwHeader) -> None:
        """Every cut lies on an expert boundary after the header and before the trailer: the
        header is read from the first shard, the trailer from the last, each expert from one."""
        for path, start in zip(self.paths[1:], self.starts[1:], strict=True):
            rows, rest = divmod(start - header.data_offset, header.expert_stride)
            if rest or not 0 < rows < header.num_rows:
                raise FtwError(f"{path}: starts at byte {start} of the experts, not at an expert boundary after "
                               f"the header and before the checksum trailer (shards cut elsewhere, or one shard "
                               f"before it has the wrong size)")


FtwSource = Path | FtwShards  # one FTW file, or the shards of one


def shard_regions(source: FtwSource) -> list[tuple[Path, int, int]]:
    """(path, start in the whole, bytes) of each file of `source`."""
    if isinstance(source, FtwShards):
        return list(zip(source.paths, source.starts, source.sizes, strict=True))
    return [(source, 0, os.stat(source).st_size)]


def data_regions(source: FtwSource, header: FtwHeader) -> list[tuple[Path, int, int, int]]:
    """(path, offset in that file, offset in the data region, bytes) of each file's part of the
    experts (not the header, not the trailer)."""
    regions = []
    for path, start, n in shard_regions(source):
        a, b = max(start, header.data_offset), min(start + n, header.trailer_offset)
        if a < b:
            regions.append((path, a - start, a - header.data_offset, b - a))
    return regions


@dataclass(frozen=True)
class Bank(BankLayout):
    offset: int  # offset of the bank's row from the start of its expert's stretch


@dataclass(frozen=True)
class FtwHeader:
    expert_format: str  # a name of `ftc_runtime.formats`
    num_moe_layers: int
    num_experts: int
    hidden: int
    intermediate: int
    banks: tuple[Bank, ...]

    @classmethod
    def create(cls, expert_format: str, num_moe_layers: int, num_experts: int, hidden: int,
               intermediate: int) -> FtwHeader:
        """The header of num_moe_layers × num_experts experts of these shapes in `expert_format`."""
        # A damaged header read back must not yield negative offsets or sizes (seeks, allocations).
        for what, n in (("num_moe_layers", num_moe_layers), ("num_experts", num_experts), ("hidden", hidden),
                        ("intermediate", intermediate)):
            if not _positive_int(n):
                raise ValueError(f"FTW {what} = {n!r}: expected a positive integer")
        out, offset = [], 0
        for layout in formats.expert_format(expert_format).banks(hidden, intermediate):
            out.append(Bank(**dataclasses.asdict(layout), offset=offset))
            offset += round_up(layout.row_bytes)
        return cls(expert_format, num_moe_layers, num_experts, hidden, intermediate, tuple(out))

    @property
    def format(self) -> ExpertFormat:
        return formats.expert_format(self.expert_format)

    @property
    def num_rows(self) -> int:
        return self.num_moe_layers * self.num_experts

    @property
    def expert_stride(self) -> int:
        return sum(round_up(b.row_bytes) for b in self.banks)

    @property
    def data_offset(self) -> int:
        return HEADER_ROOM

    @property
    def data_bytes(self) -> int:
        return self.num_rows * self.expert_stride

    @property
    def trailer_offset(self) -> int:
        return self.data_offset + self.data_bytes

    def bank(self, name: str) -> Bank:
        for b in self.banks:
            if b.name == name:
                return b
        raise KeyError(name)

    def rows(self, expert: torch.Tensor) -> dict[str, torch.Tensor]:
        """The bank rows of one expert from its stretch (uint8 [expert_stride]: a host row, a
        device slot): {bank name: uint8 [row_bytes]}, views."""
        return {b.name: expert[b.offset:b.offset + b.row_bytes] for b in self.banks}

    def dequantize(self, expert: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One expert's (gate_up [2I, H], down [H, I]) from its stretch, through its format's reference."""
        return self.format.dequantize(self.rows(expert), self.hidden, self.intermediate)

    def encode(self) -> bytes:
        body = json.dumps({
            "version": VERSION, "expert_format": self.expert_format, "num_moe_layers": self.num_moe_layers,
            "num_experts": self.num_experts, "hidden": self.hidden, "intermediate": self.intermediate,
            "expert_stride": self.expert_stride, "data_offset": self.data_offset,
            "banks": [{"name": b.name, "dtype": b.dtype, "bits": b.bits, "block": b.block, "packing": b.packing,
                       "row_shape": list(b.row_shape), "row_bytes": b.row_bytes, "offset": b.offset}
                      for b in self.banks],
            "checksums": {"algo": "crc32", "offset": self.trailer_offset},
        }, separators=(",", ":")).encode()
        room = HEADER_ROOM - PREFIX.size
        if len(body) > room:
            raise ValueError(f"FTW header needs {len(body)} bytes, only {room} fit")
        return PREFIX.pack(MAGIC, room) + body + b" " * (room - len(body))


def encode_trailer(checksums: dict[str, list[int]]) -> bytes:
    return json.dumps({k: [f"{c:08x}" for c in v] for k, v in checksums.items()}).encode()


def read_header(source: FtwSource) -> tuple[FtwHeader, dict[str, tuple[int, ...]]]:
    """Parse and check the header (from the first file) and the checksum trailer (from the last);
    the data region is not read."""
    reading = source if isinstance(source, Path) else source.paths[0]  # the file an error names
    try:
        files = shard_regions(source)
        size = sum(n for _, _, n in files)
        with open(reading, "rb") as f:
            header = _parse_header(f, size, reading)
        if isinstance(source, FtwShards):
            source.check_cuts(header)
        reading, last_start, _ = files[-1]
        if size <= header.trailer_offset:
            raise FtwError(f"{reading}: truncated: {size} bytes on disk, the experts alone need "
                           f"{header.trailer_offset} plus the checksum trailer")
        # Bounded, so that a damaged header over a huge file cannot make the trailer a huge read.
        limit = _trailer_limit(header)
        if size - header.trailer_offset > limit:
            raise FtwError(f"{reading}: corrupted: {size - header.trailer_offset} bytes after the experts, "
                           f"the checksum trailer of {header.num_rows} rows takes at most {limit}")
        with open(reading, "rb") as f:
            f.seek(header.trailer_offset - last_start)
            trailer = json.loads(f.read())
        checksums = {b.name: tuple(int(c, 16) for c in trailer[b.name]) for b in header.banks}
    except FileNotFoundError as e:
        raise FtwError(f"{e.filename or reading}: file not found") from None
    except FtwError:
        raise
    except OSError as e:
        raise FtwError(f"{e.filename or reading}: cannot be read ({e.strerror or e})") from None
    except (ValueError, KeyError, TypeError, RecursionError) as e:  # JSON and UTF-8 errors are ValueErrors
        raise FtwError(f"{reading}: corrupted header or checksum trailer ({type(e).__name__}: {e})") from None
    for b in header.banks:
        if len(checksums[b.name]) != header.num_rows:
            raise FtwError(f"{reading}: checksum trailer has {len(checksums[b.name])} rows for bank "
                           f"'{b.name}', expected {header.num_rows} (truncated or corrupted)")
    return header, checksums


def _check_packing(fields: dict, header: FtwHeader, path: Path) -> None:
    """A bank packed another way than this runtime packs it (an engine of an earlier ftc: the same
    bytes in another order) is refused as such, not as a corrupted header."""
    banks = fields.get("banks")
    if not isinstance(banks, list) or len(banks) != len(header.banks):
        return
    for stored, bank in zip(banks, header.banks, strict=True):
        packing = stored.get("packing") if isinstance(stored, dict) else None
        if isinstance(packing, str) and packing != bank.packing:
            raise FtwError(f"{path}: bank {bank.name!r} is packed {packing!r}, this runtime reads {bank.packing!r}: "
                           "the engine was compiled by another version of ftc; compile it again")


def _parse_header(f: BinaryIO, size: int, path: Path) -> FtwHeader:
    prefix = f.read(PREFIX.size)
    if len(prefix) < PREFIX.size:
        raise FtwError(f"{path}: truncated: {size} bytes, too short for an FTW header")
    magic, length = PREFIX.unpack(prefix)
    if magic != MAGIC:
        raise FtwError(f"{path}: not an FTW v{VERSION} file (magic {magic!r}, expected {MAGIC!r})")
    if length != HEADER_ROOM - PREFIX.size:
        raise FtwError(f"{path}: corrupted header (length field {length})")
    raw = f.read(length)
    if len(raw) < length:
        raise FtwError(f"{path}: truncated inside its header ({size} bytes)")
    h = json.loads(raw)
    if not isinstance(h, dict) or "version" not in h:
        raise FtwError(f"{path}: corrupted header (no 'version' field)")
    if h["version"] != VERSION:
        raise FtwError(f"{path}: FTW version {h['version']} is not supported (this runtime reads version {VERSION})")
    name = h.get("expert_format")
    if not isinstance(name, str) or name not in formats.FORMATS:
        raise FtwError(f"{path}: experts of format {name!r}, which this runtime does not know "
                       f"(it knows {', '.join(formats.FORMATS)})")
    header = FtwHeader.create(name, h["num_moe_layers"], h["num_experts"], h["hidden"], h["intermediate"])
    _check_packing(h, header, path)
    if header.encode()[PREFIX.size:].rstrip() != raw.rstrip():
        raise FtwError(f"{path}: corrupted header (its fields disagree with each other)")
    return header


def _trailer_limit(header: FtwHeader) -> int:
    """An upper bound of `encode_trailer`'s length: 8 hex digits, quotes and a separator per row."""
    return 2 + sum(6 * len(b.name) + 8 + 12 * header.num_rows for b in header.banks)


def verify_file(source: FtwSource, header: FtwHeader, checksums: dict[str, tuple[int, ...]]) -> list[str]:
    """Reads the file (or each shard) once, checking every row against its CRC-32 (as `load` does)
    and hashing it (engine.json records each file's sha256); returns the sha256 of each file, in
    order. Nothing is kept in memory."""
    return [_verify_one(path, start, n, header, checksums) for path, start, n in shard_regions(source)]


def _verify_one(path: Path, start: int, n: int, header: FtwHeader, checksums: dict[str, tuple[int, ...]]) -> str:
    """`path` holds bytes [start, start + n) of the whole: its header room (first file), then whole
    experts, then the trailer (last file)."""
    sha = hashlib.sha256()
    first_row = max(0, -(-(start - header.data_offset) // header.expert_stride))
    end_row = min(header.num_rows, max(0, (start + n - header.data_offset) // header.expert_stride))
    per_read = max(1, (32 << 20) // header.expert_stride)  # experts per read
    try:
        with open(path, "rb") as f:
            sha.update(_read_exact(f, max(0, header.data_offset + first_row * header.expert_stride - start), path))
            for first in range(first_row, end_row, per_read):
                block = memoryview(_read_exact(f, min(per_read, end_row - first) * header.expert_stride, path))
                sha.update(block)
                for i in range(len(block) // header.expert_stride):
                    for b in header.banks:
                        at = i * header.expert_stride + b.offset
                        got = zlib.crc32(block[at:at + b.row_bytes])
                        if got != checksums[b.name][first + i]:
                            raise _row_error(str(path), header, b.name, first + i, got, checksums[b.name][first + i])
            while chunk := f.read(16 << 20):
                sha.update(chunk)
    except OSError as e:
        raise FtwError(f"{path}: cannot be read ({e.strerror or e})") from None
    return sha.hexdigest()


def _read_exact(f: BinaryIO, n: int, path: Path) -> bytes:
    data = f.read(n)
    if len(data) < n:
        raise FtwError(f"{path}: truncated: ends at byte {f.tell()}, before the data its header describes")
    return data


def _row_error(name: str, h: FtwHeader, bank: str, r: int, got: int, expected: int) -> FtwError:
    layer, expert = divmod(r, h.num_experts)
    return FtwError(f"{name}: corrupted: bank '{bank}' row {r} (MoE layer {layer}, expert {expert}) fails its "
                    f"checksum (crc32 {got:08x}, expected {expected:08x})")


class ExpertPool:
    """The whole routed-expert pool in host memory: one buffer, one strided view per bank.

    `bank(name)` is a `[num_rows, row_bytes]` uint8 view whose row stride is the expert stride;
    row `id` is expert `id % E` of MoE layer `id // E`. The CPU kernels read these rows in place.
    `experts` is `[num_rows, expert_stride]`: row `id` is that expert's whole stretch (every bank's
    row with its padding), what a device slot holds; `header.dequantize(pool.experts[id])` gives
    its weights through the format's reference.
    """

    def __init__(self, header: FtwHeader, buffer: torch.Tensor):
        if buffer.numel() != header.data_bytes:
            raise ValueError(f"expert pool buffer has {buffer.numel()} bytes, expected {header.data_bytes}")
        self.header = header
        self.buffer = buffer
        self.experts = buffer.view(header.num_rows, header.expert_stride)
        self._banks = {b.name: buffer.as_strided((header.num_rows, b.row_bytes), (header.expert_stride, 1),
                                                 buffer.storage_offset() + b.offset)
                       for b in header.banks}

    @property
    def nbytes(self) -> int:
        return self.buffer.numel()

    def bank(self, name: str) -> torch.Tensor:
        return self._banks[name]


def load(source: FtwSource, on_bytes: Callable[[int], None] | None = None, direct: bool = True,
         on_read: Callable[[ReadResult], None] | None = None) -> ExpertPool:
    """Read an FTW file's data region (from one file or its shards, all at once) straight into one
    page-aligned host buffer (parallel reads, O_DIRECT where the filesystem takes it: no page-cache
    copy, no repacking) and check every row against its checksum. `on_read` receives the read's
    time and whether it was direct."""
    header, checksums = read_header(source)
    buffer = aligned_empty(header.data_bytes)
    regions = [(path, offset, buffer[at:at + n]) for path, offset, at, n in data_regions(source, header)]
    try:
        result = read_regions(regions, direct=direct, on_bytes=on_bytes)
    except EOFError as e:  # a file shrank after its header was read
        raise FtwError(f"{e.args[0]}: truncated while loading ({e.args[1]})") from None
    if on_read:
        on_read(result)
    pool = ExpertPool(header, buffer)
    verify_rows(pool, checksums, source)
    return pool


def row_checksum(row: torch.Tensor) -> int:
    return zlib.crc32(row.numpy())


def verify_rows(pool: ExpertPool, checksums: dict[str, tuple[int, ...]], source: FtwSource) -> None:
    """Check every row's CRC-32 (zlib releases the GIL, so the rows are checked on all cores); an
    error names the file (or the shard) the row was read from."""
    h = pool.header
    jobs = [(b.name, r) for b in h.banks for r in range(h.num_rows)]

    def crc(job: tuple[str, int]) -> int:
        return row_checksum(pool.bank(job[0])[job[1]])

    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as ex:
        for (bank, r), got in zip(jobs, ex.map(crc, jobs, chunksize=16), strict=True):
            if got != checksums[bank][r]:
                name = source.file_at(h.data_offset + r * h.expert_stride) if isinstance(source, FtwShards) else source
                raise _row_error(str(name), h, bank, r, got, checksums[bank][r])
