"""FP8 e4m3 decoded from its bits in numpy, and block-scaled FP8 weights made and decoded as a
producer of FP8 checkpoints (DeepSeek-V3's and GLM-5's releases) would: the tests' references."""

from __future__ import annotations

import numpy as np
import torch


def e4m3_values() -> np.ndarray:
    """The 256 e4m3fn codes' values, decoded from their bits: sign, 4 exponent bits (bias 7), 3
    mantissa bits, subnormals at exponent 0, S.1111.111 NaN, no infinities."""
    codes = np.arange(256)
    sign = np.where(codes & 0x80, -1.0, 1.0)
    exp, man = (codes >> 3) & 0xF, codes & 0x7
    value = np.where(exp == 0, man / 8.0 * 2.0 ** -6, (1 + man / 8.0) * 2.0 ** (exp - 7.0))
    return np.where((exp == 15) & (man == 7), np.nan, sign * value).astype(np.float32)


def reference_dequantize(codes: np.ndarray, scale_inv: np.ndarray, block: tuple[int, int]) -> torch.Tensor:
    n, k = codes.shape
    scales = np.repeat(np.repeat(scale_inv, block[0], 0)[:n], block[1], 1)[:, :k]
    return torch.from_numpy(e4m3_values()[codes] * scales).to(torch.bfloat16)


def quantize_fp8(w: torch.Tensor, block: tuple[int, int], rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """e4m3 codes of w and one fp32 scale per block (amax / 448, times a random factor so that
    blocks differ), as a producer of such checkpoints would write them."""
    n, k = w.shape
    rows, cols = -(-n // block[0]), -(-k // block[1])
    scale_inv = np.zeros((rows, cols), np.float32)
    codes = np.zeros((n, k), np.uint8)
    for i in range(rows):
        for j in range(cols):
            tile = w[i * block[0]:(i + 1) * block[0], j * block[1]:(j + 1) * block[1]].float()
            s = np.float32(max(float(tile.abs().max()), 1e-8) / 448 * rng.uniform(1.0, 1.5))
            scale_inv[i, j] = s
            q = (tile / float(s)).to(torch.float8_e4m3fn)
            codes[i * block[0]:(i + 1) * block[0], j * block[1]:(j + 1) * block[1]] = q.view(torch.uint8).numpy()
    return codes, scale_inv
