"""FTW: the bytes loaded equal the tensors written; damage anywhere is refused, naming what is wrong."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest
import torch

from ftc.compile.ftw_writer import FtwWriter
from ftc_runtime.artifact import file_sha256
from ftc_runtime.io import ftw

SHAPES = {"gate_up": (64, 90), "down": (90, 32)}  # row bytes not multiples of 4096: padding is exercised


def _write(path: Path, layers: int = 2, experts: int = 3) -> tuple[list[dict], str]:
    header = ftw.FtwHeader.create(layers, experts, [(n, "bf16", s) for n, s in SHAPES.items()])
    writer = FtwWriter(path, header)
    rows = []
    for _ in range(header.num_rows):
        r = {n: torch.randn(s).bfloat16() for n, s in SHAPES.items()}
        writer.append(r)
        rows.append(r)
    return rows, writer.close()


def test_round_trip_bytes_and_layout(tmp_path: Path):
    rows, sha = _write(tmp_path / "e.ftw")
    assert sha == file_sha256(tmp_path / "e.ftw")
    pool = ftw.load(tmp_path / "e.ftw")
    h = pool.header
    assert (h.num_moe_layers, h.num_experts, h.num_rows) == (2, 3, 6)
    raw = (tmp_path / "e.ftw").read_bytes()
    for i, r in enumerate(rows):
        for name, t in r.items():
            assert torch.equal(pool.expert_tensor(name, i), t)
            bank = h.bank(name)
            start = h.data_offset + i * h.expert_stride + bank.offset
            assert raw[start:start + bank.row_bytes] == t.view(torch.uint8).numpy().tobytes()
            assert start % ftw.ALIGN == 0  # every row is O_DIRECT- and cache-line aligned
        assert pool.bank("gate_up")[i].data_ptr() % 64 == 0


def test_writer_refuses_wrong_rows(tmp_path: Path):
    header = ftw.FtwHeader.create(1, 1, [(n, "bf16", s) for n, s in SHAPES.items()])
    writer = FtwWriter(tmp_path / "e.ftw", header)
    with pytest.raises(ValueError, match="bank 'gate_up'"):
        writer.append({"gate_up": torch.randn(64, 89).bfloat16(), "down": torch.randn(90, 32).bfloat16()})
    with pytest.raises(ValueError, match="0 experts written, expected 1"):
        writer.close()


@pytest.mark.parametrize("where", ["header", "data", "trailer"])
def test_truncation_is_refused(tmp_path: Path, where: str):
    _write(tmp_path / "e.ftw")
    header, _ = ftw.read_header(tmp_path / "e.ftw")
    cut = {"header": random.randrange(1, 4000), "data": header.data_offset + random.randrange(header.data_bytes),
           "trailer": header.trailer_offset + random.randrange(1, 40)}[where]
    raw = (tmp_path / "e.ftw").read_bytes()
    (tmp_path / "e.ftw").write_bytes(raw[:cut])
    with pytest.raises(ftw.FtwError, match=r"e\.ftw: .*(truncated|corrupted)"):
        ftw.load(tmp_path / "e.ftw")


def test_flipped_byte_in_a_row_names_bank_layer_and_expert(tmp_path: Path):
    _write(tmp_path / "e.ftw")
    header, _ = ftw.read_header(tmp_path / "e.ftw")
    row = random.randrange(header.num_rows)
    bank = random.choice(header.banks)
    pos = header.data_offset + row * header.expert_stride + bank.offset + random.randrange(bank.row_bytes)
    data = bytearray((tmp_path / "e.ftw").read_bytes())
    data[pos] ^= 1 << random.randrange(8)
    (tmp_path / "e.ftw").write_bytes(bytes(data))
    layer, expert = divmod(row, header.num_experts)
    with pytest.raises(ftw.FtwError, match=f"bank '{bank.name}' row {row} \\(MoE layer {layer}, expert {expert}\\)"):
        ftw.load(tmp_path / "e.ftw")


def test_padding_bytes_are_not_checked_but_rows_are(tmp_path: Path):
    """Flipping a pad byte changes no expert; the file still loads with the same rows."""
    rows, _ = _write(tmp_path / "e.ftw")
    header, _ = ftw.read_header(tmp_path / "e.ftw")
    bank = header.bank("gate_up")
    pad = header.data_offset + bank.offset + bank.row_bytes + 5
    data = bytearray((tmp_path / "e.ftw").read_bytes())
    data[pad] ^= 0xFF
    (tmp_path / "e.ftw").write_bytes(bytes(data))
    assert torch.equal(ftw.load(tmp_path / "e.ftw").expert_tensor("gate_up", 0), rows[0]["gate_up"])


def test_damaged_headers_are_refused(tmp_path: Path):
    _write(tmp_path / "e.ftw")
    raw = (tmp_path / "e.ftw").read_bytes()
    cases = {
        "not an FTW": b"GGUF" + raw[4:],
        "corrupted header": raw[:20] + b"}" + raw[21:],
        "disagree": raw.replace(b'"num_experts":3', b'"num_experts":4', 1),
        "version 2 is not supported": raw.replace(b'"version":1', b'"version":2', 1),
    }
    for expected, data in cases.items():
        (tmp_path / "bad.ftw").write_bytes(data)
        with pytest.raises(ftw.FtwError, match=expected):
            ftw.read_header(tmp_path / "bad.ftw")
    with pytest.raises(ftw.FtwError, match="file not found"):
        ftw.read_header(tmp_path / "missing.ftw")


def test_damaged_trailer_is_refused(tmp_path: Path):
    _write(tmp_path / "e.ftw")
    header, sums = ftw.read_header(tmp_path / "e.ftw")
    raw = (tmp_path / "e.ftw").read_bytes()
    short = json.dumps({k: [f"{c:08x}" for c in v[:-1]] for k, v in sums.items()}).encode()
    (tmp_path / "e.ftw").write_bytes(raw[: header.trailer_offset] + short)
    with pytest.raises(ftw.FtwError, match="checksum trailer has 5 rows"):
        ftw.load(tmp_path / "e.ftw")


@pytest.mark.parametrize("direct", [True, False])
@pytest.mark.parametrize("pages", [True, False])
def test_direct_reads_give_the_bytes_on_disk(tmp_path, direct, pages):
    """Parallel reads of a file region into a page-aligned buffer: O_DIRECT where asked and the
    offset and length are page multiples (and the filesystem takes it), buffered otherwise; either
    way the bytes on disk. A region past the end of the file is refused."""
    from ftc_runtime.io.direct_read import PAGE, aligned_empty, read_into, sequential_direct_read

    n = random.randrange(1, 40) * PAGE + (0 if pages else random.randrange(1, PAGE))
    data = os.urandom(PAGE + n + 100)
    path = tmp_path / "region.bin"
    path.write_bytes(data)
    buffer = aligned_empty(n)
    assert buffer.data_ptr() % PAGE == 0
    result = read_into(path, PAGE, buffer, threads=3, direct=direct)
    assert bytes(buffer.numpy()) == data[PAGE:PAGE + n]
    if not direct or not pages:
        assert not result.direct
    assert sequential_direct_read(path, PAGE, n).seconds > 0
    with pytest.raises(EOFError, match="region.bin"):
        read_into(path, PAGE + 200, aligned_empty(n), direct=direct)
