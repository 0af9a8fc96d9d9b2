"""FTW's packing of 4-bit codes and their block scales (`ftc_runtime.formats.e2m1`) against the
numpy reference (fp4_reference) restated from the byte rule: for a matrix [N, K],

- codes: (row n, column k) at byte ((n // 16) · (K / 8) + k // 8) · 64 + (n % 16) · 4 + (k % 8) % 4,
  in the low nibble when k % 8 < 4 and the high one otherwise;
- scales: (row n, block b) at byte ((n // 16) · (K / block) + b) · 16 + n % 16.

The project's repacking and reading back agree with the reference byte for byte on random codes
and scales, a lone code or scale lands exactly where the rule puts it, and the header names the
packings 'e2m1r16' (codes) and 'r16' (scales): a layout that drifts fails here first."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ftc_runtime.formats import expert_format
from ftc_runtime.formats.e2m1 import PACKING, SCALE_PACKING, ftw_codes, ftw_scales, to_ftw_packing, to_ftw_scales

from fp4_reference import (
    checkpoint_packing,
    checkpoint_scale_packing,
    ftw_code_offset,
    ftw_packing,
    ftw_scale_offset,
    ftw_scale_packing,
    pack_nibbles,
    unpack_nibbles,
)

SHAPES = [(16, 64), (32, 128), (48, 192), (128, 64), (64, 256)]  # [N, K]: N % 16 == 0, K % 64 == 0
BLOCKS = (16, 32)  # nvfp4's and mxfp4's


def random_codes(rng: np.random.Generator, n: int, k: int) -> np.ndarray:
    """Checkpoint-packed codes [n, k/2] (low nibble the even column), any bytes."""
    return rng.integers(0, 256, (n, k // 2), dtype=np.uint8)


@pytest.mark.parametrize("n,k", SHAPES)
def test_codes_agree_with_the_reference_byte_for_byte(n, k, seed):
    """to_ftw_packing = the reference's ftw_packing; ftw_codes reads back every code; the reference's
    inverse gives the checkpoint's bytes again."""
    rng = np.random.default_rng(seed)
    packed = random_codes(rng, n, k)
    ours = to_ftw_packing(torch.from_numpy(packed))
    assert ours.dtype == torch.uint8 and tuple(ours.shape) == (n, k // 2)
    want = ftw_packing(packed)
    np.testing.assert_array_equal(ours.numpy().reshape(-1), want.reshape(-1))
    row = torch.from_numpy(want.reshape(-1).copy())
    np.testing.assert_array_equal(ftw_codes(row, n, k).numpy(), unpack_nibbles(packed))
    np.testing.assert_array_equal(checkpoint_packing(want.reshape(-1), n, k), packed)


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("block", BLOCKS)
def test_scales_agree_with_the_reference_byte_for_byte(n, k, block, seed):
    """to_ftw_scales = the reference's ftw_scale_packing; ftw_scales reads them back; the reference's
    inverse gives the row-major scales again."""
    rng = np.random.default_rng(seed)
    scales = rng.integers(0, 256, (n, k // block), dtype=np.uint8)
    ours = to_ftw_scales(torch.from_numpy(scales))
    assert ours.dtype == torch.uint8 and tuple(ours.shape) == (n, k // block)
    want = ftw_scale_packing(scales)
    np.testing.assert_array_equal(ours.contiguous().numpy().reshape(-1), want.reshape(-1))
    row = torch.from_numpy(want.reshape(-1).copy())
    np.testing.assert_array_equal(ftw_scales(row, n, k // block).numpy(), scales)
    np.testing.assert_array_equal(checkpoint_scale_packing(want.reshape(-1), n, k // block), scales)


def lone_code_row(n: int, k: int, row: int, col: int, code: int) -> np.ndarray:
    """The project's FTW bytes of an [n, k] matrix of zero codes but `code` at (row, col)."""
    codes = np.zeros((n, k), np.uint8)
    codes[row, col] = code
    return to_ftw_packing(torch.from_numpy(pack_nibbles(codes))).numpy().reshape(-1)


@pytest.mark.parametrize("n,k,row,col,byte,high", [
    (16, 64, 0, 0, 0, False),
    (16, 64, 0, 4, 0, True),
    (16, 64, 0, 1, 1, False),
    (16, 64, 0, 7, 3, True),
    (16, 64, 1, 0, 4, False),
    (16, 64, 15, 3, 63, False),
    (16, 64, 0, 8, 64, False),
    (32, 128, 17, 13, (1 * 16 + 1) * 64 + 1 * 4 + 1, True),  # 1093
    (48, 192, 47, 191, (2 * 24 + 23) * 64 + 15 * 4 + 3, True),  # the last byte
])
def test_a_code_lands_where_the_rule_says(n, k, row, col, byte, high):
    """Worked examples of the rule, written out: the lone code's byte and nibble, and the reference's
    offset agrees."""
    assert tuple(map(int, ftw_code_offset(row, col, k))) == (byte, high)
    got = lone_code_row(n, k, row, col, 0xB)
    assert np.flatnonzero(got).tolist() == [byte], (row, col)
    assert got[byte] == (0xB0 if high else 0x0B), (row, col, hex(got[byte]))


@pytest.mark.parametrize("n,k", SHAPES)
def test_random_codes_land_where_the_rule_says(n, k, seed):
    """Codes at random places, each alone: the project puts it at the rule's byte and nibble."""
    rng = np.random.default_rng(seed)
    for _ in range(16):
        row, col, code = int(rng.integers(n)), int(rng.integers(k)), int(rng.integers(1, 16))
        byte = (row // 16 * (k // 8) + col // 8) * 64 + row % 16 * 4 + col % 8 % 4
        got = lone_code_row(n, k, row, col, code)
        assert np.flatnonzero(got).tolist() == [byte], (row, col)
        assert got[byte] == (code << 4 if col % 8 >= 4 else code), (row, col, code, hex(got[byte]))


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("block", BLOCKS)
def test_a_scale_lands_where_the_rule_says(n, k, block, seed):
    """Scales at random places (and the first and last), each alone: the project puts it at the
    rule's byte."""
    rng = np.random.default_rng(seed)
    blocks = k // block
    places = [(0, 0), (n - 1, blocks - 1)] + [(int(rng.integers(n)), int(rng.integers(blocks))) for _ in range(16)]
    for row, b in places:
        scales = np.zeros((n, blocks), np.uint8)
        value = int(rng.integers(1, 256))
        scales[row, b] = value
        got = to_ftw_scales(torch.from_numpy(scales)).contiguous().numpy().reshape(-1)
        byte = (row // 16 * blocks + b) * 16 + row % 16
        assert int(ftw_scale_offset(row, b, blocks)) == byte
        assert np.flatnonzero(got).tolist() == [byte] and got[byte] == value, (row, b)


def test_gate_and_up_are_packed_apart_then_concatenated(seed):
    """A format's `pack`: the gate_up banks are the gate's FTW bytes, then the up's (each [I, H]),
    codes and scales both; down's its own."""
    rng = np.random.default_rng(seed)
    hidden, intermediate = 128, 192
    for name in ("mxfp4", "nvfp4"):
        fmt = expert_format(name)
        gate, up, down = (fmt.random(r, c, 0.02, torch.Generator().manual_seed(int(rng.integers(2**31))), m)
                          for r, c, m in ((intermediate, hidden, "gate"), (intermediate, hidden, "up"),
                                          (hidden, intermediate, "down")))
        rows = {bank: t.numpy() for bank, t in fmt.pack(gate, up, down).items()}
        codes, scales = ([f(getattr(m, part).numpy()) for m in (gate, up)]
                         for f, part in ((ftw_packing, "codes"), (ftw_scale_packing, "scales")))
        np.testing.assert_array_equal(rows["gate_up"], np.concatenate(codes).ravel(), err_msg=name)
        np.testing.assert_array_equal(rows["gate_up_scales"], np.concatenate(scales).ravel(), err_msg=name)
        np.testing.assert_array_equal(rows["down"], ftw_packing(down.codes.numpy()).ravel(), err_msg=name)
        np.testing.assert_array_equal(rows["down_scales"], ftw_scale_packing(down.scales.numpy()).ravel(),
                                      err_msg=name)


def test_the_packings_are_named_in_the_header():
    assert (PACKING, SCALE_PACKING) == ("e2m1r16", "r16")
    for name in ("mxfp4", "nvfp4"):
        banks = {b.name: b.packing for b in expert_format(name).banks(128, 64)}
        assert {n: banks[n] for n in ("gate_up", "down")} == {"gate_up": "e2m1r16", "down": "e2m1r16"}
        assert {n: banks[n] for n in ("gate_up_scales", "down_scales")} == {"gate_up_scales": "r16",
                                                                          "down_scales": "r16"}


def test_the_reference_refuses_shapes_the_packing_cannot_hold():
    with pytest.raises(ValueError, match="groups of 16"):
        ftw_packing(np.zeros((8, 32), np.uint8))
    with pytest.raises(ValueError, match="groups of 16"):
        ftw_scale_packing(np.zeros((24, 2), np.uint8))
