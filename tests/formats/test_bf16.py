"""The bf16 expert format against an independent numpy reference: encoding is round to nearest,
ties to even, of every weight's fp32 bits; dequantization gives those bf16 values back; the banks'
row sizes; and an FTW file written and loaded through the format."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from ftc.compile.ftw_writer import FtwWriter
from ftc_runtime.formats import FORMATS, expert_format
from ftc_runtime.formats.base import BankLayout
from ftc_runtime.io import ftw

FORMAT = expert_format("bf16")
SHAPES = [(64, 32), (90, 32), (256, 96)]  # hidden, intermediate (90: rows not multiples of 4096 bytes)


def bf16_bits_np(x: np.ndarray) -> np.ndarray:
    """The reference: fp32 → bf16 bits, round to nearest, ties to even (finite inputs)."""
    u = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def bf16_values_np(bits: np.ndarray) -> np.ndarray:
    """bf16 bits → their fp32 values (exact: bf16 is fp32's upper half)."""
    return (bits.astype(np.uint32) << 16).view(np.float32)


def random_weights(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """fp32 weights over many binades, with exact ties and values just beside them."""
    x = (rng.standard_normal(shape) * np.exp2(rng.integers(-20, 20, shape))).astype(np.float32)
    bits = x.reshape(-1).view(np.uint32)
    at = rng.choice(bits.size, size=bits.size // 4, replace=False)
    low = rng.choice(np.array([0x8000, 0x7FFF, 0x8001, 0x0000, 0xFFFF], dtype=np.uint32), size=at.size)
    bits[at] = (bits[at] & 0xFFFF0000) | low  # ties (0x8000) with even and odd upper halves
    return x


def expert_np(rng: np.random.Generator, hidden: int, intermediate: int) -> dict[str, np.ndarray]:
    return {"gate_up": random_weights(rng, (2 * intermediate, hidden)),
            "down": random_weights(rng, (hidden, intermediate))}


@pytest.mark.parametrize("hidden,intermediate", SHAPES)
def test_encode_rounds_to_nearest_even(seed, hidden, intermediate):
    rng = np.random.default_rng(seed)
    w = expert_np(rng, hidden, intermediate)
    rows = FORMAT.encode(torch.from_numpy(w["gate_up"]), torch.from_numpy(w["down"]))
    assert set(rows) == {"gate_up", "down"}
    for name, x in w.items():
        assert rows[name].dtype == torch.uint8 and rows[name].dim() == 1
        assert rows[name].numpy().tobytes() == bf16_bits_np(x).astype("<u2").tobytes(), name


def test_encode_of_other_float_dtypes(seed):
    """bf16 input is stored as it is; fp16 and fp64 values that bf16 holds exactly are stored exactly."""
    rng = np.random.default_rng(seed)
    hidden, intermediate = 64, 32
    exact = {n: bf16_values_np(bf16_bits_np(x)) for n, x in expert_np(rng, hidden, intermediate).items()}
    for dtype in (torch.bfloat16, torch.float64):
        t = {n: torch.from_numpy(x).to(dtype) for n, x in exact.items()}
        rows = FORMAT.encode(t["gate_up"], t["down"])
        for name, x in exact.items():
            assert rows[name].numpy().tobytes() == bf16_bits_np(x).astype("<u2").tobytes(), (dtype, name)
    small = {n: (rng.integers(-64, 64, x.shape) / 8).astype(np.float16) for n, x in exact.items()}
    rows = FORMAT.encode(torch.from_numpy(small["gate_up"]), torch.from_numpy(small["down"]))
    for name, x in small.items():
        assert rows[name].numpy().tobytes() == bf16_bits_np(x.astype(np.float32)).astype("<u2").tobytes()


@pytest.mark.parametrize("hidden,intermediate", SHAPES)
def test_dequantize_round_trip(seed, hidden, intermediate):
    rng = np.random.default_rng(seed)
    w = expert_np(rng, hidden, intermediate)
    rows = FORMAT.encode(torch.from_numpy(w["gate_up"]), torch.from_numpy(w["down"]))
    gate_up, down = FORMAT.dequantize(rows, hidden, intermediate)
    assert gate_up.shape == (2 * intermediate, hidden) and down.shape == (hidden, intermediate)
    for name, t in (("gate_up", gate_up), ("down", down)):
        want = bf16_values_np(bf16_bits_np(w[name]))
        np.testing.assert_array_equal(t.float().numpy(), want, err_msg=name)
        # within half a bf16 unit in the last place of the input
        np.testing.assert_allclose(t.float().numpy(), w[name], rtol=2.0**-8, atol=0)
    again = FORMAT.encode(gate_up, down)  # bf16 values encode to themselves
    for name in rows:
        assert torch.equal(again[name], rows[name])


def test_encode_refuses_tensors_of_the_wrong_shape_or_dtype():
    with pytest.raises(ValueError, match="'gate_up'"):
        FORMAT.encode(torch.zeros(64, 89), torch.zeros(90, 32))
    with pytest.raises(ValueError, match="'down'"):
        FORMAT.encode(torch.zeros(64, 90), torch.zeros(90, 32, dtype=torch.int32))


@pytest.mark.parametrize("hidden,intermediate", SHAPES)
def test_banks_and_row_bytes(hidden, intermediate):
    banks = FORMAT.banks(hidden, intermediate)
    assert [(b.name, b.dtype, b.bits, b.block, b.row_shape) for b in banks] == [
        ("gate_up", "bf16", 16, 1, (2 * intermediate, hidden)), ("down", "bf16", 16, 1, (hidden, intermediate))]
    assert [b.row_bytes for b in banks] == [4 * intermediate * hidden, 2 * hidden * intermediate]
    assert FORMAT.expert_bytes(hidden, intermediate) == 3 * hidden * intermediate * 2


def test_row_bytes_round_up_to_whole_bytes():
    """Sub-byte elements pack densely: 15 four-bit codes take 8 bytes, 16 take 8, 17 take 9."""
    for n, nbytes in ((15, 8), (16, 8), (17, 9)):
        assert BankLayout("codes", "e2m1", 4, (1, n), 32, "").row_bytes == nbytes
    assert BankLayout("scales", "ue8m0", 8, (6, 3), 32, "").row_bytes == 18


def test_the_registry_gives_this_module():
    assert FORMATS["bf16"] == "ftc_runtime.formats.bf16" and FORMAT.name == "bf16"
    assert FORMAT.slot_dtype == torch.bfloat16
    assert set(FORMAT.cpu_templates) == {"avx512_bf16", "avx2"}
    with pytest.raises(ValueError, match="not known"):
        expert_format("fp3")


def test_ftw_round_trip_through_the_format(tmp_path: Path, seed):
    """Float tensors written through FtwWriter (which encodes them) are, on disk, the reference's
    bytes at every bank's offset, and load back as the reference's bf16 values."""
    rng = np.random.default_rng(seed)
    hidden, intermediate = SHAPES[int(rng.integers(len(SHAPES)))]
    header = ftw.FtwHeader.create("bf16", 2, 3, hidden, intermediate)
    writer = FtwWriter(tmp_path / "e.ftw", header)
    experts = [expert_np(rng, hidden, intermediate) for _ in range(header.num_rows)]
    for w in experts:
        writer.append({n: torch.from_numpy(x) for n, x in w.items()})
    writer.close()
    pool = ftw.load(tmp_path / "e.ftw")
    assert pool.header == header and pool.header.expert_format == "bf16"
    raw = (tmp_path / "e.ftw").read_bytes()
    for row, w in enumerate(experts):
        gate_up, down = pool.header.dequantize(pool.experts[row])
        for name, t in (("gate_up", gate_up), ("down", down)):
            bits = bf16_bits_np(w[name])
            bank = header.bank(name)
            start = header.data_offset + row * header.expert_stride + bank.offset
            assert raw[start:start + bank.row_bytes] == bits.astype("<u2").tobytes(), (row, name)
            np.testing.assert_array_equal(t.float().numpy(), bf16_values_np(bits))
