"""nvfp4 experts (NVIDIA NVFP4): e2m1 codes, one fp8 e4m3 scale per 16 weights along a row, and
one fp32 scale per matrix.

A weight is `E2M1[code] · (fp32(s) · t)` for its block's e4m3 scale s and its matrix's scale t
(ModelOpt's `weight_scale_2`; compressed-tensors stores 1/t as `weight_global_scale`). The gate,
up and down matrices have a tensor scale each: a fused gate_up keeps the two. Banks: e2m1 codes
`gate_up` [2I, H] and `down` [H, I] (FTW's 16-row packing, `e2m1.py`), e4m3 scales
`gate_up_scales` [2I, H/16] and `down_scales` [H, I/16], and `tensor_scales`: fp32 (gate, up,
down). A NaN scale byte (0x7F, 0xFF) or a tensor scale that is not a finite positive number is
refused.

Rounding 16/32-bit weights (`--quant nvfp4`, ModelOpt's rule, all in fp32): t = amax(W) / (6·448)
(1 for an all-zero matrix); a block's scale is s = amax(block) / (t·6), clamped to 448 and rounded
to the nearest e4m3 (ties to even); the codes round w / (fp32(s)·t) to e2m1 (`e2m1.round_to_e2m1`),
all zero where s rounded to zero.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from ftc_runtime.formats.base import BankLayout, CpuTemplate, QuantizedMatrix
from ftc_runtime.formats.e2m1 import (
    RMS_E2M1,
    TILE_MIN_AMX,
    TILE_MIN_AVX512,
    BlockFp4Format,
    ftw_scales,
    pack_pairs,
    round_to_e2m1,
)

BLOCK = 16
E4M3_MAX = 448.0
TENSOR_SCALES = ("gate", "up", "down")  # the order of the `tensor_scales` bank


def e4m3_values(scales: torch.Tensor) -> torch.Tensor:
    return scales.view(torch.float8_e4m3fn).float()


class Nvfp4Format(BlockFp4Format):
    def extra_banks(self) -> tuple[BankLayout, ...]:
        return (BankLayout("tensor_scales", "f32", 32, (len(TENSOR_SCALES),), 1, ""),)

    def extra_rows(self, gate: QuantizedMatrix, up: QuantizedMatrix,
                   down: QuantizedMatrix) -> dict[str, torch.Tensor]:
        scales = torch.tensor([m.tensor_scale for m in (gate, up, down)], dtype=torch.float32)
        return {"tensor_scales": scales.view(torch.uint8)}

    def scale_values(self, scales: torch.Tensor) -> torch.Tensor:
        return e4m3_values(scales)

    def block_scales(self, rows: Mapping[str, torch.Tensor], name: str, r: int, blocks: int) -> torch.Tensor:
        t = rows["tensor_scales"].view(torch.float32)
        s = e4m3_values(ftw_scales(rows[f"{name}_scales"], r, blocks))
        if name == "down":
            return s * t[2]
        half = r // 2  # gate rows, then up rows
        return torch.cat([s[:half] * t[0], s[half:] * t[1]])

    def quantize(self, w: torch.Tensor, name: str) -> QuantizedMatrix:
        rows, cols = w.shape
        blocks = w.float().reshape(rows, cols // BLOCK, BLOCK)
        amax = blocks.abs().amax()
        t = amax / torch.tensor(6 * E4M3_MAX) if amax > 0 else torch.tensor(1.0)
        s = (blocks.abs().amax(-1) / (t * 6)).clamp(max=E4M3_MAX).to(torch.float8_e4m3fn)
        denom = s.float() * t
        q = torch.where(denom[..., None] > 0, blocks / denom[..., None], 0.0)
        codes = torch.where(denom[..., None] > 0, round_to_e2m1(q), 0).to(torch.uint8)
        return QuantizedMatrix(pack_pairs(codes.reshape(rows, cols)), s.view(torch.uint8), float(t), name)

    def check_scales(self, m: QuantizedMatrix) -> None:
        t = m.tensor_scale
        if t is None or not (0 < t < float("inf")):
            raise ValueError(f"{m.tensor_scale_name or m.name}: nvfp4 tensor scale is {t}, expected a finite positive "
                             "number")
        bad = ((m.scales & 0x7F) == 0x7F).nonzero()
        if bad.numel():
            row, block = bad[0].tolist()
            raise ValueError(f"{m.name}: e4m3 scale of row {row}, block {block} is NaN (byte "
                             f"0x{int(m.scales[row, block]):02x}); {len(bad)} such scales in this tensor")

    def random(self, rows: int, cols: int, std: float, generator: torch.Generator, name: str) -> QuantizedMatrix:
        """Codes and block scales drawn uniformly (scales in [1, 2)), the tensor scale fitting std."""
        codes = torch.randint(0, 256, (rows, cols // 2), dtype=torch.uint8, generator=generator)
        scales = torch.randint(0x38, 0x40, (rows, cols // BLOCK), dtype=torch.uint8, generator=generator)
        return QuantizedMatrix(codes, scales, std / (RMS_E2M1 * 1.5), name)


FORMAT = Nvfp4Format(
    name="nvfp4",
    cpu_templates={"avx512_bf16": CpuTemplate("cpu/expert_ffn_nvfp4_avx512.cpp.j2", 64, work_rows=32,
                                              prefetch_rows=32, tile_min_avx512=TILE_MIN_AVX512,
                                              tile_min_amx=TILE_MIN_AMX),
                   "avx2": CpuTemplate("cpu/expert_ffn_nvfp4_avx2.cpp.j2", 64, prefetch_rows=16)},
    triton_template="triton/expert_ffn_nvfp4.py.j2", slot_dtype=torch.uint8, block=BLOCK, scale_dtype="e4m3")
