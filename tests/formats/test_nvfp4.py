"""The nvfp4 expert format against the independent numpy reference (fp4_reference): encoding rounds
as the reference's quantizer, dequantization gives the reference's values bit for bit, repacking a
checkpoint's codes only moves nibbles, gate and up keep their own tensor scales, the banks' row
sizes, and the refusals of scales that are no number."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ftc_runtime.formats import FORMATS, expert_format
from ftc_runtime.formats.base import QuantizedMatrix

from fp4_reference import E4M3, dequantize_nvfp4, float_bits, ftw_packing, ftw_scale_packing, quantize_nvfp4

FORMAT = expert_format("nvfp4")
SHAPES = [(64, 64), (128, 64), (192, 128)]  # hidden, intermediate: multiples of 64
FINITE_E4M3 = np.array([c for c in range(256) if c & 0x7F != 0x7F], np.uint8)


def float_bits_of(t: torch.Tensor) -> np.ndarray:
    return float_bits(t.float().numpy())


def random_matrix(rng: np.random.Generator, rows: int, cols: int) -> np.ndarray:
    """fp32 weights of one magnitude (drawn over many binades) whose blocks span 2^-24 to 1 of it, so
    some block scales are e4m3 subnormals or round to zero; with all-zero blocks."""
    spread = 2.0 ** rng.uniform(-24, 0, (rows, cols // 16)).repeat(16, 1)
    w = rng.standard_normal((rows, cols)) * spread * 2.0 ** rng.uniform(-60, 60)
    w[rng.random((rows, cols // 16)).repeat(16, 1) < 0.05] = 0.0
    return w.astype(np.float32)


def tensor_scale_of(rng: np.random.Generator) -> float:
    return float(np.float32(2.0 ** rng.uniform(-30, 10)))


def random_quantized(rng: np.random.Generator, rows: int, cols: int, name: str) -> QuantizedMatrix:
    """Codes as checkpoints pack them (any bytes), finite e4m3 scales of either sign, a tensor scale."""
    return QuantizedMatrix(torch.from_numpy(rng.integers(0, 256, (rows, cols // 2), dtype=np.uint8)),
                           torch.from_numpy(rng.choice(FINITE_E4M3, (rows, cols // 16))), tensor_scale_of(rng), name)


def reference(m: QuantizedMatrix) -> np.ndarray:
    return dequantize_nvfp4(m.codes.numpy(), m.scales.numpy(), np.float32(m.tensor_scale))


@pytest.mark.parametrize("hidden,intermediate", SHAPES)
def test_encode_rounds_and_dequantizes_as_the_reference(seed, hidden, intermediate):
    """encode → rows: codes and e4m3 scales (both in FTW's packing) and the tensor scales (gate, up, down) of
    the reference's quantizer of each matrix; dequantize → the reference's values, bit for bit."""
    rng = np.random.default_rng(seed)
    gate, up = (random_matrix(rng, intermediate, hidden) for _ in range(2))
    down = random_matrix(rng, hidden, intermediate)
    rows = FORMAT.encode(torch.from_numpy(np.concatenate([gate, up])), torch.from_numpy(down))
    gate_up_t, down_t = FORMAT.dequantize(rows, hidden, intermediate)
    q = [quantize_nvfp4(m) for m in (gate, up, down)]
    codes = [ftw_packing(p) for p, _, _ in q[:2]]
    np.testing.assert_array_equal(rows["gate_up"].numpy(), np.concatenate(codes).ravel())
    np.testing.assert_array_equal(rows["down"].numpy(), ftw_packing(q[2][0]).ravel())
    scales = [ftw_scale_packing(s) for _, s, _ in q[:2]]
    np.testing.assert_array_equal(rows["gate_up_scales"].numpy(), np.concatenate(scales).ravel())
    np.testing.assert_array_equal(rows["down_scales"].numpy(), ftw_scale_packing(q[2][1]).ravel())
    np.testing.assert_array_equal(rows["tensor_scales"].numpy().view(np.float32), [ts for _, _, ts in q])
    want = [dequantize_nvfp4(*x) for x in q]
    np.testing.assert_array_equal(float_bits_of(gate_up_t), float_bits(np.concatenate(want[:2])))
    np.testing.assert_array_equal(float_bits_of(down_t), float_bits(want[2]))


def test_pack_only_moves_nibbles(seed):
    """A checkpoint's codes, scales (every finite e4m3, both signs) and tensor scales, repacked: the
    code banks are the reference's nibble permutation, the scale banks its byte permutation, and the
    weights the reference's of its bytes."""
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
    want = np.concatenate([reference(gate), reference(up)])
    np.testing.assert_array_equal(float_bits_of(gate_up_t), float_bits(want))
    np.testing.assert_array_equal(float_bits_of(down_t), float_bits(reference(down)))


def test_gate_and_up_keep_their_own_tensor_scales(seed):
    """A fused gate_up holds two matrices of different tensor scales: the bank keeps both (and the
    down's), and each half of the rows dequantizes with its own, not the other's."""
    rng = np.random.default_rng(seed)
    hidden, intermediate = 64, 128
    gate, up = (random_quantized(rng, intermediate, hidden, n) for n in ("gate", "up"))
    down = random_quantized(rng, hidden, intermediate, "down")
    up = QuantizedMatrix(gate.codes, gate.scales, gate.tensor_scale * 2.0 ** int(rng.integers(3, 9)), "up")
    rows = FORMAT.pack(gate, up, down)
    ts = rows["tensor_scales"].numpy().view(np.float32)
    assert ts.tolist() == [gate.tensor_scale, up.tensor_scale, down.tensor_scale]
    gate_up_t, _ = FORMAT.dequantize(rows, hidden, intermediate)
    g, u = gate_up_t[:intermediate], gate_up_t[intermediate:]
    np.testing.assert_array_equal(float_bits_of(g), float_bits(reference(gate)))
    np.testing.assert_array_equal(float_bits_of(u), float_bits(reference(up)))
    assert not torch.equal(g, u)  # the same codes and block scales, another tensor scale


def test_every_scale_byte_dequantizes_as_the_reference(seed):
    """Every finite e4m3 byte (subnormals, ±448, -0) times random codes and a tensor scale."""
    rng = np.random.default_rng(seed)
    hidden, intermediate = 64, 64
    scales = np.resize(FINITE_E4M3, (intermediate, hidden // 16))  # 256 scales: 254 finite bytes and two more
    gate, up = (QuantizedMatrix(torch.from_numpy(rng.integers(0, 256, (intermediate, hidden // 2), dtype=np.uint8)),
                                torch.from_numpy(s.copy()), tensor_scale_of(rng), n)
                for s, n in ((scales, "gate"), (scales[::-1], "up")))
    rows = FORMAT.pack(gate, up, random_quantized(rng, hidden, intermediate, "down"))
    gate_up_t, _ = FORMAT.dequantize(rows, hidden, intermediate)
    want = np.concatenate([reference(gate), reference(up)])
    np.testing.assert_array_equal(float_bits_of(gate_up_t), float_bits(want))
    assert set(np.unique(scales)) == set(FINITE_E4M3) and np.isfinite(E4M3[FINITE_E4M3]).all()


@pytest.mark.parametrize("hidden,intermediate", SHAPES)
def test_banks_and_row_bytes(hidden, intermediate):
    banks = FORMAT.banks(hidden, intermediate)
    assert [(b.name, b.dtype, b.bits, b.block, b.packing, b.row_shape) for b in banks] == [
        ("gate_up", "e2m1", 4, 16, "e2m1r16", (2 * intermediate, hidden)),
        ("down", "e2m1", 4, 16, "e2m1r16", (hidden, intermediate)),
        ("gate_up_scales", "e4m3", 8, 16, "r16", (2 * intermediate, hidden // 16)),
        ("down_scales", "e4m3", 8, 16, "r16", (hidden, intermediate // 16)),
        ("tensor_scales", "f32", 32, 1, "", (3,))]
    n = hidden * intermediate
    assert [b.row_bytes for b in banks] == [n, n // 2, n // 8, n // 16, 12]
    assert FORMAT.expert_bytes(hidden, intermediate) == 3 * n // 2 + 3 * n // 16 + 12


@pytest.mark.parametrize("byte", [0x7F, 0xFF])
def test_a_nan_block_scale_is_refused_naming_it(byte, seed):
    rng = np.random.default_rng(seed)
    gate, up, down = (random_quantized(rng, 64, 64, n) for n in ("g", "u", "d"))
    down.scales[12, 3] = byte
    with pytest.raises(ValueError, match=rf"d: e4m3 scale of row 12, block 3 is NaN \(byte 0x{byte:02x}\); 1 such"):
        FORMAT.pack(gate, up, down)


@pytest.mark.parametrize("tensor_scale", [0.0, -1.0, float("inf"), float("nan"), None])
def test_a_tensor_scale_that_is_no_positive_number_is_refused(tensor_scale, seed):
    rng = np.random.default_rng(seed)
    gate, up, down = (random_quantized(rng, 64, 64, n) for n in ("g", "u", "d"))
    up = QuantizedMatrix(up.codes, up.scales, tensor_scale, "u")
    with pytest.raises(ValueError, match=rf"u: nvfp4 tensor scale is {tensor_scale}"):
        FORMAT.pack(gate, up, down)


def test_random_draws_have_the_asked_spread(seed):
    """`random`: finite scales, weights of about the asked standard deviation, one draw per
    generator state."""
    std = 2.0 ** np.random.default_rng(seed).uniform(-8, 0)
    draw = [FORMAT.random(128, 256, std, torch.Generator().manual_seed(seed), "r") for _ in range(2)]
    assert torch.equal(draw[0].codes, draw[1].codes) and torch.equal(draw[0].scales, draw[1].scales)
    assert draw[0].scales.shape == (128, 16) and np.isfinite(E4M3[draw[0].scales.numpy()]).all()
    assert 0.6 < reference(draw[0]).std() / std < 1.6


def test_the_registry_gives_this_module():
    assert FORMATS["nvfp4"] == "ftc_runtime.formats.nvfp4" and FORMAT.name == "nvfp4"
    assert (FORMAT.block, FORMAT.scale_dtype, FORMAT.slot_dtype) == (16, "e4m3", torch.uint8)
    assert set(FORMAT.cpu_templates) == {"avx512_bf16", "avx2"}
