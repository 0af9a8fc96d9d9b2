"""FTW, the routed-expert weight file, and the host pool it is loaded into.

Layout (version 1):

    b"FTW1" | u64 LE header length | JSON header | pad to 4096 | experts | checksum trailer (JSON)

An expert is several tensors; each tensor kind is a *bank* (`gate_up` [2I, H] with the gate rows
first, `down` [H, I]). Row `id = l·E + e` of every bank is expert `e` of MoE layer `l`. The rows
of one expert lie together (expert-major): expert `id` starts at `data_offset + id·expert_stride`,
each of its rows padded to 4096 bytes. So the file is written in one sequential pass (its sha256
is computed on the way), a GPU fill of one expert is one contiguous copy, and O_DIRECT can read the
data region straight into the final host buffer. The trailer holds a CRC-32 for every row, so
corruption is reported as the exact bank, layer and expert.
"""

from __future__ import annotations

import json
import os
import struct
import zlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from .direct_read import ReadResult, aligned_empty, read_into

MAGIC = b"FTW1"
VERSION = 1
ALIGN = 4096
PREFIX = struct.Struct("<4sQ")
HEADER_ROOM = 4096  # magic, length and JSON header; the first expert starts here
_DTYPE_BYTES = {"bf16": 2}


class FtwError(ValueError):
    """The FTW file is missing, truncated, corrupted or of another version; the message says which."""


def round_up(n: int, align: int = ALIGN) -> int:
    return (n + align - 1) // align * align


@dataclass(frozen=True)
class Bank:
    name: str
    dtype: str
    row_shape: tuple[int, ...]
    offset: int  # offset of row 0 from the start of the data region

    @property
    def row_bytes(self) -> int:
        n = _DTYPE_BYTES[self.dtype]
        for d in self.row_shape:
            n *= d
        return n


@dataclass(frozen=True)
class FtwHeader:
    num_moe_layers: int
    num_experts: int
    banks: tuple[Bank, ...]

    @classmethod
    def create(cls, num_moe_layers: int, num_experts: int,
               banks: list[tuple[str, str, tuple[int, ...]]]) -> FtwHeader:
        out, offset = [], 0
        for name, dtype, shape in banks:
            if dtype not in _DTYPE_BYTES:
                raise ValueError(f"FTW bank {name!r}: dtype {dtype!r} is not one of {list(_DTYPE_BYTES)}")
            bank = Bank(name, dtype, tuple(shape), offset)
            out.append(bank)
            offset += round_up(bank.row_bytes)
        return cls(num_moe_layers, num_experts, tuple(out))

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

    def encode(self) -> bytes:
        body = json.dumps({
            "version": VERSION, "num_moe_layers": self.num_moe_layers, "num_experts": self.num_experts,
            "expert_stride": self.expert_stride, "data_offset": self.data_offset,
            "banks": [{"name": b.name, "dtype": b.dtype, "row_shape": list(b.row_shape),
                       "row_bytes": b.row_bytes, "offset": b.offset} for b in self.banks],
            "checksums": {"algo": "crc32", "offset": self.trailer_offset},
        }, separators=(",", ":")).encode()
        room = HEADER_ROOM - PREFIX.size
        if len(body) > room:
            raise ValueError(f"FTW header needs {len(body)} bytes, only {room} fit")
        return PREFIX.pack(MAGIC, room) + body + b" " * (room - len(body))


def bf16_expert_banks(hidden: int, intermediate: int) -> list[tuple[str, str, tuple[int, ...]]]:
    """The banks of a bf16 SwiGLU expert: gate_up [2I, H] (gate rows first), down [H, I]."""
    return [("gate_up", "bf16", (2 * intermediate, hidden)), ("down", "bf16", (hidden, intermediate))]


def encode_trailer(checksums: dict[str, list[int]]) -> bytes:
    return json.dumps({k: [f"{c:08x}" for c in v] for k, v in checksums.items()}).encode()


def read_header(path: Path) -> tuple[FtwHeader, dict[str, tuple[int, ...]]]:
    """Parse and check the header and the checksum trailer; the data region is not read."""
    name = path.name
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            prefix = f.read(PREFIX.size)
            if len(prefix) < PREFIX.size:
                raise FtwError(f"{name}: truncated: {size} bytes, too short for an FTW header")
            magic, length = PREFIX.unpack(prefix)
            if magic != MAGIC:
                raise FtwError(f"{name}: not an FTW v{VERSION} file (magic {magic!r}, expected {MAGIC!r})")
            if length != HEADER_ROOM - PREFIX.size:
                raise FtwError(f"{name}: corrupted header (length field {length})")
            raw = f.read(length)
            if len(raw) < length:
                raise FtwError(f"{name}: truncated inside its header ({size} bytes)")
            h = json.loads(raw)
            if not isinstance(h, dict) or "version" not in h:
                raise FtwError(f"{name}: corrupted header (no 'version' field)")
            if h["version"] != VERSION:
                raise FtwError(f"{name}: FTW version {h['version']} is not supported "
                               f"(this runtime reads version {VERSION})")
            header = FtwHeader.create(h["num_moe_layers"], h["num_experts"],
                                      [(b["name"], b["dtype"], tuple(b["row_shape"])) for b in h["banks"]])
            if header.encode()[PREFIX.size:].rstrip() != raw.rstrip():
                raise FtwError(f"{name}: corrupted header (its fields disagree with each other)")
            if size <= header.trailer_offset:
                raise FtwError(f"{name}: truncated: {size} bytes on disk, the experts alone need "
                               f"{header.trailer_offset} plus the checksum trailer")
            f.seek(header.trailer_offset)
            trailer = json.loads(f.read())
            checksums = {b.name: tuple(int(c, 16) for c in trailer[b.name]) for b in header.banks}
    except FileNotFoundError:
        raise FtwError(f"{path}: file not found") from None
    except FtwError:
        raise
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, ValueError) as e:
        raise FtwError(f"{name}: corrupted header or checksum trailer ({type(e).__name__}: {e})") from None
    for b in header.banks:
        if len(checksums[b.name]) != header.num_rows:
            raise FtwError(f"{name}: checksum trailer has {len(checksums[b.name])} rows for bank "
                           f"'{b.name}', expected {header.num_rows} (truncated or corrupted)")
    return header, checksums


class ExpertPool:
    """The whole routed-expert pool in host memory: one buffer, one strided view per bank.

    `bank(name)` is a `[num_rows, row_bytes]` uint8 view whose row stride is the expert stride;
    row `id` is expert `id % E` of MoE layer `id // E`. The CPU kernels read these rows in place.
    """

    def __init__(self, header: FtwHeader, buffer: torch.Tensor):
        if buffer.numel() != header.data_bytes:
            raise ValueError(f"expert pool buffer has {buffer.numel()} bytes, expected {header.data_bytes}")
        self.header = header
        self.buffer = buffer
        self._banks = {b.name: buffer.as_strided((header.num_rows, b.row_bytes), (header.expert_stride, 1),
                                                 buffer.storage_offset() + b.offset)
                       for b in header.banks}

    @property
    def nbytes(self) -> int:
        return self.buffer.numel()

    def bank(self, name: str) -> torch.Tensor:
        return self._banks[name]

    def expert_tensor(self, name: str, row: int) -> torch.Tensor:
        """Row `row` of bank `name` as a bf16 tensor of the bank's row shape (a view, no copy)."""
        b = self.header.bank(name)
        return self._banks[name][row].view(torch.bfloat16).view(b.row_shape)


def load(path: Path, on_bytes: Callable[[int], None] | None = None, direct: bool = True,
         on_read: Callable[[ReadResult], None] | None = None) -> ExpertPool:
    """Read an FTW file's data region straight into one page-aligned host buffer (parallel reads,
    O_DIRECT where the filesystem takes it: no page-cache copy, no repacking) and check every
    row against its checksum. `on_read` receives the read's time and whether it was direct."""
    header, checksums = read_header(path)
    buffer = aligned_empty(header.data_bytes)
    try:
        result = read_into(path, header.data_offset, buffer, direct=direct, on_bytes=on_bytes)
    except EOFError as e:
        raise FtwError(str(e)) from None
    if on_read:
        on_read(result)
    pool = ExpertPool(header, buffer)
    verify_rows(pool, checksums, path.name)
    return pool


def row_checksum(row: torch.Tensor) -> int:
    return zlib.crc32(row.numpy())


def verify_rows(pool: ExpertPool, checksums: dict[str, tuple[int, ...]], name: str) -> None:
    """Check every row's CRC-32 (zlib releases the GIL, so the rows are checked on all cores)."""
    h = pool.header
    jobs = [(b.name, r) for b in h.banks for r in range(h.num_rows)]

    def crc(job: tuple[str, int]) -> int:
        return row_checksum(pool.bank(job[0])[job[1]])

    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as ex:
        for (bank, r), got in zip(jobs, ex.map(crc, jobs, chunksize=16), strict=True):
            if got != checksums[bank][r]:
                layer, expert = divmod(r, h.num_experts)
                raise FtwError(f"{name}: corrupted: bank '{bank}' row {r} (MoE layer {layer}, expert "
                               f"{expert}) fails its checksum (crc32 {got:08x}, expected "
                               f"{checksums[bank][r]:08x})")
