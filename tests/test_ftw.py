"""FTW: the bytes loaded equal the tensors written; damage anywhere is refused, naming what is wrong."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from ftc.compile.ftw_writer import FtwWriter
from ftc_runtime.artifact import file_sha256
from ftc_runtime.io import ftw

HIDDEN, INTERMEDIATE = 90, 32  # row bytes not multiples of 4096: padding is exercised
SHAPES = {"gate_up": (2 * INTERMEDIATE, HIDDEN), "down": (HIDDEN, INTERMEDIATE)}


def _write(path: Path, rng: random.Random, layers: int = 2, experts: int = 3) -> tuple[list[dict], str]:
    """bf16 experts (the format stores them as they are), drawn from `rng`."""
    header = ftw.FtwHeader.create("bf16", layers, experts, HIDDEN, INTERMEDIATE)
    writer = FtwWriter(path, header)
    g = torch.Generator().manual_seed(rng.randrange(2**31))
    rows = []
    for _ in range(header.num_rows):
        r = {n: torch.randn(s, generator=g).bfloat16() for n, s in SHAPES.items()}
        writer.append(r)
        rows.append(r)
    return rows, writer.close()


def _tensor(pool: ftw.ExpertPool, name: str, row: int) -> torch.Tensor:
    gate_up, down = pool.header.dequantize(pool.experts[row])
    return {"gate_up": gate_up, "down": down}[name]


def test_round_trip_bytes_and_layout(tmp_path: Path, seed):
    rows, sha = _write(tmp_path / "e.ftw", random.Random(seed))
    assert sha == file_sha256(tmp_path / "e.ftw")
    pool = ftw.load(tmp_path / "e.ftw")
    h = pool.header
    assert (h.expert_format, h.num_moe_layers, h.num_experts, h.num_rows) == ("bf16", 2, 3, 6)
    raw = (tmp_path / "e.ftw").read_bytes()
    for i, r in enumerate(rows):
        for name, t in r.items():
            assert torch.equal(_tensor(pool, name, i), t)
            assert torch.equal(pool.bank(name)[i], t.view(torch.uint8).reshape(-1))
            bank = h.bank(name)
            start = h.data_offset + i * h.expert_stride + bank.offset
            assert raw[start:start + bank.row_bytes] == t.view(torch.uint8).numpy().tobytes()
            assert start % ftw.ALIGN == 0  # every row is O_DIRECT- and cache-line aligned
        assert pool.bank("gate_up")[i].data_ptr() % 64 == 0


def test_writer_refuses_wrong_rows(tmp_path: Path):
    header = ftw.FtwHeader.create("bf16", 1, 1, HIDDEN, INTERMEDIATE)
    writer = FtwWriter(tmp_path / "e.ftw", header)
    with pytest.raises(ValueError, match="bank 'gate_up'"):
        writer.append({"gate_up": torch.randn(64, 89).bfloat16(), "down": torch.randn(90, 32).bfloat16()})
    with pytest.raises(ValueError, match="bank 'down'"):
        writer.append({"gate_up": torch.randn(64, 90), "down": torch.ones(90, 32, dtype=torch.int16)})
    down = torch.full((90, 32), 0.5)
    down[3, 4] = 3.4e38  # finite in fp32, beyond bf16's range: Inf once encoded
    with pytest.raises(ValueError, match="bank 'down': 1 NaN or Inf values"):
        writer.append({"gate_up": torch.randn(64, 90), "down": down})
    with pytest.raises(ValueError, match="0 experts written, expected 1"):
        writer.close()


@pytest.mark.parametrize("where", ["header", "data", "trailer"])
def test_truncation_is_refused(tmp_path: Path, where: str, seed):
    rng = random.Random(seed)
    _write(tmp_path / "e.ftw", rng)
    header, _ = ftw.read_header(tmp_path / "e.ftw")
    cut = {"header": rng.randrange(1, 4000), "data": header.data_offset + rng.randrange(header.data_bytes),
           "trailer": header.trailer_offset + rng.randrange(1, 40)}[where]
    raw = (tmp_path / "e.ftw").read_bytes()
    (tmp_path / "e.ftw").write_bytes(raw[:cut])
    with pytest.raises(ftw.FtwError, match=r"e\.ftw: .*(truncated|corrupted)"):
        ftw.load(tmp_path / "e.ftw")


def test_flipped_byte_in_a_row_names_bank_layer_and_expert(tmp_path: Path, seed):
    rng = random.Random(seed)
    _write(tmp_path / "e.ftw", rng)
    header, _ = ftw.read_header(tmp_path / "e.ftw")
    row = rng.randrange(header.num_rows)
    bank = rng.choice(header.banks)
    pos = header.data_offset + row * header.expert_stride + bank.offset + rng.randrange(bank.row_bytes)
    data = bytearray((tmp_path / "e.ftw").read_bytes())
    data[pos] ^= 1 << rng.randrange(8)
    (tmp_path / "e.ftw").write_bytes(bytes(data))
    layer, expert = divmod(row, header.num_experts)
    with pytest.raises(ftw.FtwError, match=f"bank '{bank.name}' row {row} \\(MoE layer {layer}, expert {expert}\\)"):
        ftw.load(tmp_path / "e.ftw")


def test_padding_bytes_are_not_checked_but_rows_are(tmp_path: Path, seed):
    """Flipping a pad byte changes no expert; the file still loads with the same rows."""
    rows, _ = _write(tmp_path / "e.ftw", random.Random(seed))
    header, _ = ftw.read_header(tmp_path / "e.ftw")
    bank = header.bank("gate_up")
    pad = header.data_offset + bank.offset + bank.row_bytes + 5
    data = bytearray((tmp_path / "e.ftw").read_bytes())
    data[pad] ^= 0xFF
    (tmp_path / "e.ftw").write_bytes(bytes(data))
    assert torch.equal(_tensor(ftw.load(tmp_path / "e.ftw"), "gate_up", 0), rows[0]["gate_up"])


def test_damaged_headers_are_refused(tmp_path: Path, seed):
    _write(tmp_path / "e.ftw", random.Random(seed))
    raw = (tmp_path / "e.ftw").read_bytes()
    cases = [
        ("not an FTW", b"GGUF" + raw[4:]),
        ("corrupted header", raw[:20] + b"}" + raw[21:]),
        ("disagree", raw.replace(b'"num_experts":3', b'"num_experts":4', 1)),
        ("disagree", raw.replace(b'"bits":16', b'"bits":15', 1)),  # a bank that its format does not give
        ("version 2 is not supported", raw.replace(b'"version":3', b'"version":2', 1)),  # the previous layout
        ("format 'fp77', which this runtime does not know", raw.replace(b'"bf16"', b'"fp77"', 1)),
    ]
    for expected, data in cases:
        (tmp_path / "bad.ftw").write_bytes(data)
        with pytest.raises(ftw.FtwError, match=expected):
            ftw.read_header(tmp_path / "bad.ftw")
    with pytest.raises(ftw.FtwError, match="file not found"):
        ftw.read_header(tmp_path / "missing.ftw")


def test_damaged_trailer_is_refused(tmp_path: Path, seed):
    _write(tmp_path / "e.ftw", random.Random(seed))
    header, sums = ftw.read_header(tmp_path / "e.ftw")
    raw = (tmp_path / "e.ftw").read_bytes()
    short = json.dumps({k: [f"{c:08x}" for c in v[:-1]] for k, v in sums.items()}).encode()
    (tmp_path / "e.ftw").write_bytes(raw[: header.trailer_offset] + short)
    with pytest.raises(ftw.FtwError, match="checksum trailer has 5 rows"):
        ftw.load(tmp_path / "e.ftw")


@pytest.mark.parametrize("direct", [True, False])
@pytest.mark.parametrize("pages", [True, False])
def test_direct_reads_give_the_bytes_on_disk(tmp_path, direct, pages, seed):
    """Parallel reads of a file region into a page-aligned buffer: O_DIRECT where asked and the
    offset and length are page multiples (and the filesystem takes it), buffered otherwise; either
    way the bytes on disk. A region past the end of the file is refused."""
    from ftc_runtime.io.direct_read import PAGE, aligned_empty, read_into, sequential_direct_read

    rng = random.Random(seed)
    n = rng.randrange(1, 40) * PAGE + (0 if pages else rng.randrange(1, PAGE))
    data = rng.randbytes(PAGE + n + 100)
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
