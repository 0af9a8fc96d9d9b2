"""An independent numpy reference of the two 4-bit expert formats, for the tests to hold ftc's own
quantizer and dequantizer to, bit for bit (it imports nothing of ftc):

- MXFP4 (OCP MX): E2M1 codes in blocks of 32 along a row, one e8m0 (power of two) scale per block.
- NVFP4: E2M1 codes in blocks of 16, one e4m3 scale per block and one float32 scale per matrix.

Codes are packed two to a byte: the even column in the low nibble, the odd one in the high nibble.
FTW (the engine's expert file) packs codes and block scales of 16 rows together instead: its byte
rule is restated at `ftw_code_offset` / `ftw_scale_offset`, with `ftw_packing` / `ftw_scale_packing`
and their inverses built on it. All the arithmetic is float32, in the order each function's docstring states.
"""

from __future__ import annotations

import numpy as np

# The value of each 4-bit E2M1 code: bit 3 the sign, bits 0-2 an index into the grid of magnitudes.
E2M1 = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6], np.float32)

MXFP4_BLOCK = 32
NVFP4_BLOCK = 16
E4M3_MAX = 448.0
E8M0_BIAS = 127


def _e4m3_table() -> np.ndarray:
    """The float32 value of every e4m3fn byte (bias 7, subnormals m·2^-9, 0x7F and 0xFF NaN)."""
    codes = np.arange(256)
    exp, man = (codes >> 3) & 0xF, (codes & 7).astype(np.float64)
    mag = np.where(exp == 0, man * 2.0 ** -9, (1 + man / 8) * 2.0 ** (exp - 7))
    value = np.where(codes & 0x80, -mag, mag)
    value[(codes & 0x7F) == 0x7F] = np.nan
    return value.astype(np.float32)


E4M3 = _e4m3_table()


def _round_to_grid(mag: np.ndarray, grid: np.ndarray) -> np.ndarray:
    """Index of the nearest value of the ascending `grid` to each magnitude (within its range), ties
    to the even index. Midpoints of float32 grid values are exact in float64, so the choice is exact."""
    mag = np.asarray(mag, np.float64)
    grid = np.asarray(grid, np.float64)
    hi = np.clip(np.searchsorted(grid, mag, side="left"), 0, len(grid) - 1)
    lo = np.maximum(hi - 1, 0)
    mid = (grid[lo] + grid[hi]) / 2
    pick_hi = (mag > mid) | ((mag == mid) & (hi % 2 == 0))
    return np.where(pick_hi, hi, lo)


def e4m3_to_float(codes: np.ndarray) -> np.ndarray:
    """The float32 values of e4m3fn bytes."""
    return E4M3[np.asarray(codes, np.uint8)]


def float_to_e4m3(x: np.ndarray) -> np.ndarray:
    """e4m3fn bytes of finite float32 values within [-448, 448]: round to nearest on the e4m3 grid
    (subnormals included), ties to even; the sign bit is the input's (so -0.0 gives 0x80)."""
    x = np.asarray(x, np.float32)
    if not np.all(np.isfinite(x)) or np.any(np.abs(x) > E4M3_MAX):
        raise ValueError("e4m3 input must be finite and within [-448, 448]")
    code = _round_to_grid(np.abs(x), E4M3[:127])
    return (code | np.where(np.signbit(x), 0x80, 0)).astype(np.uint8)


def round_e2m1(q: np.ndarray) -> np.ndarray:
    """E2M1 codes of float32 values: nearest of {0, .5, 1, 1.5, 2, 3, 4, 6} to |q| (beyond 6: 6), ties
    to the even code; the sign bit (8) set iff q < 0, also where q rounds to 0."""
    q = np.asarray(q, np.float32)
    code = _round_to_grid(np.minimum(np.abs(q), np.float32(6)), E2M1[:8])
    return (code | np.where(q < 0, 8, 0)).astype(np.uint8)


def pack_nibbles(codes: np.ndarray) -> np.ndarray:
    """Codes [N, K] (K even) as bytes [N, K/2]: column 2k in the low nibble, 2k+1 in the high one."""
    codes = np.asarray(codes, np.uint8)
    if codes.shape[-1] % 2:
        raise ValueError(f"odd row length {codes.shape[-1]}")
    return (codes[..., 0::2] & 0xF) | ((codes[..., 1::2] & 0xF) << 4)


def unpack_nibbles(packed: np.ndarray) -> np.ndarray:
    """The inverse of pack_nibbles: bytes [N, K/2] as codes [N, K]."""
    packed = np.asarray(packed, np.uint8)
    codes = np.empty(packed.shape[:-1] + (packed.shape[-1] * 2,), np.uint8)
    codes[..., 0::2] = packed & 0xF
    codes[..., 1::2] = packed >> 4
    return codes


def _blocks(w: np.ndarray, block: int) -> np.ndarray:
    """A float32 matrix [N, K] as [N, K/block, block]."""
    w = np.asarray(w, np.float32)
    if w.ndim != 2 or w.shape[1] % block:
        raise ValueError(f"shape {w.shape} is not [N, K] with K a multiple of {block}")
    return w.reshape(w.shape[0], w.shape[1] // block, block)


def quantize_mxfp4(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """MXFP4 of a float32 matrix [N, K]: packed codes [N, K/2] and e8m0 scale bytes [N, K/32]. A
    block's scale byte is floor(log2 amax) - 2 + 127 (clipped to [0, 254]; 0 for an all-zero block),
    and its values are scaled by 2^-(byte - 127) exactly before rounding to E2M1."""
    blocks = _blocks(w, MXFP4_BLOCK)
    amax = np.max(np.abs(blocks), axis=-1)
    _, ex = np.frexp(amax)  # amax = m · 2^ex, m in [0.5, 1)
    scales = np.where(amax == 0, 0, np.clip(ex.astype(np.int64) - 1 - 2 + E8M0_BIAS, 0, 254)).astype(np.uint8)
    q = np.ldexp(blocks, -(scales.astype(np.int32) - E8M0_BIAS)[..., None])
    return pack_nibbles(round_e2m1(q).reshape(w.shape)), scales


def dequantize_mxfp4(packed: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """float32 [N, K] of MXFP4 codes [N, K/2] and scale bytes [N, K/32]: E2M1[code] · 2^(byte - 127)."""
    codes = unpack_nibbles(packed)
    values = E2M1[codes.reshape(codes.shape[0], -1, MXFP4_BLOCK)]
    exps = np.asarray(scales, np.uint8).astype(np.int32) - E8M0_BIAS
    return np.ldexp(values, exps[..., None]).astype(np.float32).reshape(codes.shape)


def nvfp4_tensor_scale(w: np.ndarray) -> np.float32:
    """The per-matrix float32 scale: max|w| / (6 · 448) in float32 (1 for an all-zero matrix)."""
    amax = np.max(np.abs(np.asarray(w, np.float32)))
    return np.float32(1) if amax == 0 else np.float32(amax / np.float32(6 * 448))


def quantize_nvfp4(w: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.float32]:
    """NVFP4 of a float32 matrix [N, K]: packed codes [N, K/2], e4m3 scale bytes [N, K/16] and the
    tensor scale ts. A block's scale is e4m3(min(amax / (ts · 6), 448)); its codes are
    round_e2m1(v / (scale · ts)), or all 0 where the scale rounded to 0."""
    blocks = _blocks(w, NVFP4_BLOCK)
    ts = nvfp4_tensor_scale(w)
    amax = np.max(np.abs(blocks), axis=-1)
    s = np.minimum(amax / (ts * np.float32(6)), np.float32(E4M3_MAX)).astype(np.float32)
    scales = float_to_e4m3(s)
    sq = e4m3_to_float(scales)
    denom = (sq * ts).astype(np.float32)[..., None]
    safe = np.where(denom == 0, np.float32(1), denom)
    codes = np.where(denom == 0, np.uint8(0), round_e2m1((blocks / safe).astype(np.float32)))
    return pack_nibbles(codes.reshape(w.shape)), scales, ts


def dequantize_nvfp4(packed: np.ndarray, scales: np.ndarray, ts: np.float32) -> np.ndarray:
    """float32 [N, K] of NVFP4 codes [N, K/2], e4m3 scale bytes [N, K/16] and tensor scale ts:
    E2M1[code] · (e4m3(byte) · ts), the scale product in float32 first."""
    codes = unpack_nibbles(packed)
    values = E2M1[codes.reshape(codes.shape[0], -1, NVFP4_BLOCK)]
    scale = (e4m3_to_float(scales) * np.float32(ts)).astype(np.float32)
    return (values * scale[..., None]).astype(np.float32).reshape(codes.shape)


# FTW's packing of 4-bit codes and their block scales (the project's, restated here from its byte
# rule, not from its code): rows go in groups of FTW_ROWS, a group's codes in units of FTW_UNIT
# columns, 64 bytes a unit; a group's scales 16 bytes per block.
FTW_ROWS = 16
FTW_UNIT = 8


def ftw_code_offset(n, k, cols: int):
    """(byte, high) where FTW puts the code of row n, column k of a matrix of `cols` columns: byte
    ((n // 16) · (cols / 8) + k // 8) · 64 + (n % 16) · 4 + (k % 8) % 4 of the bank row, in its high
    nibble iff k % 8 >= 4. Scalars or broadcasting integer arrays."""
    n, k = np.asarray(n, np.int64), np.asarray(k, np.int64)
    unit = (n // FTW_ROWS) * (cols // FTW_UNIT) + k // FTW_UNIT
    byte = unit * 64 + (n % FTW_ROWS) * 4 + (k % FTW_UNIT) % 4
    return byte, (k % FTW_UNIT) >= 4


def ftw_scale_offset(n, b, blocks: int):
    """The byte where FTW puts the scale of row n, block b of a matrix of `blocks` blocks a row:
    ((n // 16) · blocks + b) · 16 + n % 16. Scalars or broadcasting integer arrays."""
    n, b = np.asarray(n, np.int64), np.asarray(b, np.int64)
    return ((n // FTW_ROWS) * blocks + b) * FTW_ROWS + n % FTW_ROWS


def _check_ftw_shape(n: int, k: int, what: str) -> None:
    if n % FTW_ROWS or k % FTW_UNIT:
        raise ValueError(f"{what} [{n}, {k}]: FTW packs rows in groups of {FTW_ROWS} and columns in units of "
                         f"{FTW_UNIT}")


def ftw_packing(packed: np.ndarray) -> np.ndarray:
    """Checkpoint-packed codes [N, K/2] (low nibble the even column) in FTW's packing: bytes [N, K/2]
    (the bank row, reshaped), each code of (n, k) at ftw_code_offset(n, k, K)."""
    codes = unpack_nibbles(packed)
    n, k = codes.shape
    _check_ftw_shape(n, k, "codes")
    byte, high = ftw_code_offset(np.arange(n)[:, None], np.arange(k)[None, :], k)
    nibbles = np.zeros((2, n * k // 2), np.uint8)
    nibbles[high.astype(np.int64), byte] = codes
    return (nibbles[0] | (nibbles[1] << 4)).reshape(packed.shape)


def checkpoint_packing(row: np.ndarray, n: int, k: int) -> np.ndarray:
    """The inverse of ftw_packing: an FTW code bank row's bytes (of an [n, k] matrix) as checkpoints
    pack them, [n, k/2] with the low nibble the even column."""
    _check_ftw_shape(n, k, "codes")
    row = np.asarray(row, np.uint8).reshape(-1)
    byte, high = ftw_code_offset(np.arange(n)[:, None], np.arange(k)[None, :], k)
    return pack_nibbles((row[byte] >> np.where(high, 4, 0)) & 15)


def ftw_scale_packing(scales: np.ndarray) -> np.ndarray:
    """Block scales [N, K/block] (row-major, as checkpoints hold them) in FTW's packing: bytes of the
    same shape (the bank row, reshaped), the scale of (n, b) at ftw_scale_offset(n, b, K/block)."""
    scales = np.asarray(scales, np.uint8)
    n, blocks = scales.shape
    if n % FTW_ROWS:
        raise ValueError(f"scales [{n}, {blocks}]: FTW packs rows in groups of {FTW_ROWS}")
    out = np.zeros(n * blocks, np.uint8)
    out[ftw_scale_offset(np.arange(n)[:, None], np.arange(blocks)[None, :], blocks)] = scales
    return out.reshape(n, blocks)


def checkpoint_scale_packing(row: np.ndarray, n: int, blocks: int) -> np.ndarray:
    """The inverse of ftw_scale_packing: an FTW scale bank row's bytes as row-major scales [n, blocks]."""
    if n % FTW_ROWS:
        raise ValueError(f"scales [{n}, {blocks}]: FTW packs rows in groups of {FTW_ROWS}")
    row = np.asarray(row, np.uint8).reshape(-1)
    return row[ftw_scale_offset(np.arange(n)[:, None], np.arange(blocks)[None, :], blocks)]


def float_bits(a: np.ndarray) -> np.ndarray:
    """The bits of float32 values, so that comparisons tell -0 from 0 and match NaNs."""
    return np.ascontiguousarray(a, np.float32).view(np.int32)
