"""mxfp4 experts (OCP Microscaling MXFP4): e2m1 codes, one e8m0 scale per 32 weights along a row.

A weight is `E2M1[code] · 2^(e − 127)` for its block's scale byte e; e = 255 (NaN) is refused.
Banks: e2m1 codes `gate_up` [2I, H] and `down` [H, I] (FTW's 16-row packing, `e2m1.py`), their
scales `gate_up_scales` [2I, H/32] and `down_scales` [H, I/32].

Rounding 16/32-bit weights (`--quant mxfp4`, OCP's rule): a block's scale is 2^(⌊log2 amax⌋ − 2),
so its largest weight lands in [4, 8) before rounding (above 6 it saturates to 6); the byte is
⌊log2 amax⌋ − 2 + 127 clamped to [0, 254], and 0 for an all-zero block. The codes round
w · 2^(127 − e) to e2m1 (`e2m1.round_to_e2m1`).
"""

from __future__ import annotations

import math

import torch

from ftc_runtime.formats.base import CpuTemplate, QuantizedMatrix
from ftc_runtime.formats.e2m1 import RMS_E2M1, TILE_MIN_AMX, TILE_MIN_AVX512, BlockFp4Format, pack_pairs, round_to_e2m1

BLOCK = 32
NAN_SCALE = 255


def power_of_two(exponent_field: torch.Tensor) -> torch.Tensor:
    """fp32 2^(f − 127) for an fp32 exponent field f in [0, 254] (int32), built from its bits: f = 0
    is the subnormal 2^-127."""
    bits = torch.where(exponent_field == 0, torch.full_like(exponent_field, 1 << 22), exponent_field << 23)
    return bits.view(torch.float32)


class Mxfp4Format(BlockFp4Format):
    def scale_values(self, scales: torch.Tensor) -> torch.Tensor:
        return power_of_two(scales.to(torch.int32))

    def quantize(self, w: torch.Tensor, name: str) -> QuantizedMatrix:
        rows, cols = w.shape
        blocks = w.float().reshape(rows, cols // BLOCK, BLOCK)
        amax = blocks.abs().amax(-1)
        exponent = torch.frexp(amax).exponent  # amax = m · 2^exponent, m in [0.5, 1)
        scale = torch.where(amax > 0, (exponent - 1 - 2 + 127).clamp(0, 254), 0).to(torch.int32)
        codes = round_to_e2m1(blocks * power_of_two(254 - scale)[..., None])  # w / 2^(e − 127), exactly
        return QuantizedMatrix(pack_pairs(codes.reshape(rows, cols)), scale.to(torch.uint8), None, name)

    def check_scales(self, m: QuantizedMatrix) -> None:
        bad = (m.scales == NAN_SCALE).nonzero()
        if bad.numel():
            row, block = bad[0].tolist()
            raise ValueError(f"{m.name}: e8m0 scale of row {row}, block {block} is 255 (NaN); {len(bad)} such "
                             "scales in this tensor")

    def random(self, rows: int, cols: int, std: float, generator: torch.Generator, name: str) -> QuantizedMatrix:
        """Codes drawn uniformly and one scale for all blocks, so weights have about `std`."""
        codes = torch.randint(0, 256, (rows, cols // 2), dtype=torch.uint8, generator=generator)
        e = 127 + round(math.log2(std / RMS_E2M1))
        return QuantizedMatrix(codes, torch.full((rows, cols // BLOCK), e, dtype=torch.uint8), None, name)

FORMAT = Mxfp4Format(
    name="mxfp4",
    cpu_templates={"avx512_bf16": CpuTemplate("cpu/expert_ffn_mxfp4_avx512.cpp.j2", 64, work_rows=32,
                                              prefetch_rows=32, tile_min_avx512=TILE_MIN_AVX512,
                                              tile_min_amx=TILE_MIN_AMX),
                   "avx2": CpuTemplate("cpu/expert_ffn_mxfp4_avx2.cpp.j2", 64, prefetch_rows=16)},
    triton_template="triton/expert_ffn_mxfp4.py.j2", slot_dtype=torch.uint8, block=BLOCK, scale_dtype="ue8m0")
