"""The mxfp4 expert format against the independent numpy reference (fp4_reference): encoding rounds
as the reference's quantizer, dequantization gives the reference's values bit for bit, repacking a
checkpoint's codes only moves nibbles, the banks' row sizes, and the refusals of scales that are no
number and of shapes the 64-column packing cannot hold."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ftc_runtime.formats import FORMATS, expert_format
from ftc_runtime.formats.base import QuantizedMatrix

from fp4_reference import dequantize_mxfp4, float_bits, ftw_packing, ftw_scale_packing, quantize_mxfp4

FORMAT = expert_format("mxfp4")
SHAPES = [(64, 64), (128, 64), (192, 128)]  # hidden, intermediate: multiples of 64


def float_bits_of(t: torch.Tensor) -> np.ndarray:
    return float_bits(t.float().numpy())


def random_matrix(rng: np.random.Generator, rows: int, cols: int) -> np.ndarray:
    """fp32 weights whose blocks span many binades, with all-zero blocks and values on the grid."""
    w = rng.standard_normal((rows, cols)) * 2.0 ** rng.integers(-40, 40, (rows, cols // 32)).repeat(32, 1)
    w[rng.random((rows, cols // 32)).repeat(32, 1) < 0.05] = 0.0
    return w.astype(np.float32)


def expert_np(rng: np.random.Generator, hidden: int, intermediate: int) -> dict[str, np.ndarray]:
    return {"gate_up": random_matrix(rng, 2 * intermediate, hidden), "down": random_matrix(rng, hidden, intermediate)}


def matrix(packed: np.ndarray, scales: np.ndarray, name: str) -> QuantizedMatrix:
    return QuantizedMatrix(torch.from_numpy(packed), torch.from_numpy(scales), None, name)


def random_quantized(rng: np.random.Generator, rows: int, cols: int, name: str) -> QuantizedMatrix:
    """Codes as checkpoints pack them (any bytes) and scales (any number but 255; no overflow)."""
    return matrix(rng.integers(0, 256, (rows, cols // 2), dtype=np.uint8),
                  rng.integers(0, 250, (rows, cols // 32), dtype=np.uint8), name)


@pytest.mark.parametrize("hidden,intermediate", SHAPES)
def test_encode_rounds_and_dequantizes_as_the_reference(seed, hidden, intermediate):
    """encode → rows: codes and scales (both in FTW's packing) of the reference's quantizer of gate,
    up and down each; dequantize → the reference's dequantization of them, bit for bit."""
    rng = np.random.default_rng(seed)
    w = expert_np(rng, hidden, intermediate)
    rows = FORMAT.encode(torch.from_numpy(w["gate_up"]), torch.from_numpy(w["down"]))
    gate_up, down = FORMAT.dequantize(rows, hidden, intermediate)
    ref = {"gate_up": [quantize_mxfp4(m) for m in np.split(w["gate_up"], 2)], "down": [quantize_mxfp4(w["down"])]}
    for name, t in (("gate_up", gate_up), ("down", down)):
        codes = np.concatenate([ftw_packing(p) for p, _ in ref[name]])
        scales = np.concatenate([ftw_scale_packing(s) for _, s in ref[name]])
        np.testing.assert_array_equal(rows[name].numpy(), codes.reshape(-1), err_msg=name)
        np.testing.assert_array_equal(rows[f"{name}_scales"].numpy(), scales.reshape(-1), err_msg=name)
        want = np.concatenate([dequantize_mxfp4(p, s) for p, s in ref[name]])
        np.testing.assert_array_equal(float_bits_of(t), float_bits(want), err_msg=name)


def test_pack_only_moves_nibbles(seed):
    """A checkpoint's codes and scales, repacked: the code banks are the reference's nibble
    permutation, the scale banks its byte permutation, and the dequantized weights are the
    reference's of the checkpoint's bytes."""
    rng = np.random.default_rng(seed)
    hidden, intermediate = SHAPES[int(rng.integers(len(SHAPES)))]
    gate, up = (random_quantized(rng, intermediate, hidden, n) for n in ("gate", "up"))
    down = random_quantized(rng, hidden, intermediate, "down")
    rows = FORMAT.pack(gate, up, down)
    codes = [ftw_packing(m.codes.numpy()) for m in (gate, up)]
    np.testing.assert_array_equal(rows["gate_up"].numpy(), np.concatenate(codes).ravel())
    np.testing.assert_array_equal(rows["down"].numpy(), ftw_packing(down.codes.numpy()).ravel())
    scales = [ftw_scale_packing(m.scales.numpy()) for m in (gate, up)]
    np.testing.assert_array_equal(rows["gate_up_scales"].numpy(), np.concatenate(scales).ravel())
    np.testing.assert_array_equal(rows["down_scales"].numpy(), ftw_scale_packing(down.scales.numpy()).ravel())
    gate_up_t, down_t = FORMAT.dequantize(rows, hidden, intermediate)
    want = [dequantize_mxfp4(m.codes.numpy(), m.scales.numpy()) for m in (gate, up, down)]
    np.testing.assert_array_equal(float_bits_of(gate_up_t), float_bits(np.concatenate(want[:2])))
    np.testing.assert_array_equal(float_bits_of(down_t), float_bits(want[2]))


def test_every_scale_byte_dequantizes_as_the_reference(seed):
    """Scale bytes 0 (2^-127, an fp32 subnormal) to 254 (2^127: code ±6 overflows to ±Inf) under
    random codes dequantize to the reference's values."""
    rng = np.random.default_rng(seed)
    hidden, intermediate = 128, 256
    scales = np.repeat(np.r_[np.arange(255), 127].astype(np.uint8)[:, None], hidden // 32, 1)
    gate, up = (matrix(rng.integers(0, 256, (intermediate, hidden // 2), dtype=np.uint8), s, n)
                for s, n in ((scales, "gate"), (scales[::-1].copy(), "up")))
    rows = FORMAT.pack(gate, up, random_quantized(rng, hidden, intermediate, "down"))
    gate_up, _ = FORMAT.dequantize(rows, hidden, intermediate)
    with np.errstate(over="ignore"):
        want = np.concatenate([dequantize_mxfp4(m.codes.numpy(), m.scales.numpy()) for m in (gate, up)])
    assert np.isinf(want).any() and (want[0] != 0).any()
    np.testing.assert_array_equal(float_bits_of(gate_up), float_bits(want))


@pytest.mark.parametrize("hidden,intermediate", SHAPES)
def test_banks_and_row_bytes(hidden, intermediate):
    banks = FORMAT.banks(hidden, intermediate)
    assert [(b.name, b.dtype, b.bits, b.block, b.packing, b.row_shape) for b in banks] == [
        ("gate_up", "e2m1", 4, 32, "e2m1r16", (2 * intermediate, hidden)),
        ("down", "e2m1", 4, 32, "e2m1r16", (hidden, intermediate)),
        ("gate_up_scales", "ue8m0", 8, 32, "r16", (2 * intermediate, hidden // 32)),
        ("down_scales", "ue8m0", 8, 32, "r16", (hidden, intermediate // 32))]
    n = hidden * intermediate
    assert [b.row_bytes for b in banks] == [n, n // 2, n // 16, n // 32]
    assert FORMAT.expert_bytes(hidden, intermediate) == 3 * n // 2 + 3 * n // 32


def test_shapes_the_packing_cannot_hold_are_refused():
    for hidden, intermediate, what in ((64, 32, "intermediate size 32"), (96, 64, "hidden size 96")):
        with pytest.raises(ValueError, match=f"{what} is not a multiple of 64"):
            FORMAT.banks(hidden, intermediate)
        with pytest.raises(ValueError, match=what):
            FORMAT.encode(torch.zeros(2 * intermediate, hidden), torch.zeros(hidden, intermediate))


def test_a_nan_scale_or_a_misshapen_tensor_is_refused_naming_it(seed):
    """Scale byte 255 (e8m0's NaN): the tensor, row and block; codes or scales of another shape or
    dtype: the tensor and which part."""
    rng = np.random.default_rng(seed)
    gate, up, down = (random_quantized(rng, r, c, n) for r, c, n in ((64, 64, "g"), (64, 64, "u"), (64, 64, "d")))
    up.scales[5, 1] = 255
    up.scales[7, 0] = 255
    with pytest.raises(ValueError, match=r"u: e8m0 scale of row 5, block 1 is 255 \(NaN\); 2 such"):
        FORMAT.pack(gate, up, down)
    short = QuantizedMatrix(gate.codes[:, :-1], gate.scales, None, "short")
    with pytest.raises(ValueError, match=r"short: mxfp4 codes are torch.uint8 \[64, 31\], expected uint8 \[64, 32\]"):
        FORMAT.pack(short, gate, down)
    wide = QuantizedMatrix(gate.codes, gate.scales.to(torch.int16), None, "wide")
    with pytest.raises(ValueError, match=r"wide: mxfp4 scales are torch.int16"):
        FORMAT.pack(gate, wide, down)


def test_random_draws_have_the_asked_spread(seed):
    """`random`: valid scale bytes, weights of about the asked standard deviation, one draw per
    generator state."""
    std = 2.0 ** np.random.default_rng(seed).uniform(-8, 0)
    draw = [FORMAT.random(128, 256, std, torch.Generator().manual_seed(seed), "r") for _ in range(2)]
    assert torch.equal(draw[0].codes, draw[1].codes) and torch.equal(draw[0].scales, draw[1].scales)
    assert draw[0].codes.shape == (128, 128) and draw[0].scales.shape == (128, 8) and (draw[0].scales < 255).all()
    w = dequantize_mxfp4(draw[0].codes.numpy(), draw[0].scales.numpy())
    assert 0.6 < w.std() / std < 1.6


def test_the_registry_gives_this_module():
    assert FORMATS["mxfp4"] == "ftc_runtime.formats.mxfp4" and FORMAT.name == "mxfp4"
    assert (FORMAT.block, FORMAT.scale_dtype, FORMAT.slot_dtype) == (32, "ue8m0", torch.uint8)
    assert set(FORMAT.cpu_templates) == {"avx512_bf16", "avx2"}
